"""The measure notebook, executed by papermill on the smoke profile (CPU), for both HF backends."""

from __future__ import annotations

import os

import nbformat
import papermill as pm
import pytest

from rollout_lib.measure.rawfile import read_raw

from .conftest import REPO, SMOKE


@pytest.mark.parametrize("backend", ["hf_reference", "hf_cached"])
def test_measure_notebook_smoke(backend, tmp_path, monkeypatch, smoke_study):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    out_nb = tmp_path / f"measure-{backend}.ipynb"
    cells = ["p16-r8-n1-greedy", "p16-r8-n2-stochastic"]
    parameters = dict(backend=backend, params=str(SMOKE), campaign="nbtest", cells=cells, run_id="nb",
                      output_dir=str(tmp_path / "outputs"))
    pm.execute_notebook(str(REPO / "notebooks" / "measure.ipynb"), str(out_nb), parameters=parameters,
                        cwd=str(REPO), progress_bar=False, kernel_name="python3")
    nb = nbformat.read(str(out_nb), as_version=4)
    assert nb.metadata.papermill.parameters == parameters
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "NOT PREREGISTERED" in text
    raw = tmp_path / "outputs" / "raw" / "nbtest" / backend / "nb.jsonl"
    assert f"{raw}: " in text
    records, torn = read_raw(raw)
    assert torn == b"" and records[0]["record"] == "header" and records[0]["preregistered"] is False
    assert records[0]["environment"]["preregistration_sha256"] == smoke_study.sha256
    reps = [r for r in records if r["record"] == "repetition"]
    measured = smoke_study.protocol.measured_repetitions
    assert [(r["cell_id"], r["warmup"]) for r in reps] == [(c, w) for c in cells
                                                           for w in (True, *[False] * measured)]
    assert all(r["valid"] for r in reps)
    stochastic = [r for r in reps if r["cell_id"] == "p16-r8-n2-stochastic"]
    assert all(r["generated_tokens"] == 8 * 8 for r in stochastic)
    phases = reps[1]["phases"]
    expected = "not_measured" if backend == "hf_reference" else "measured"
    assert {p["status"] for p in phases.values()} == {expected}
    assert [r["status"] for r in records if r["record"] == "cell_complete"] == ["completed", "completed"]


def test_measure_notebook_rejects_unknown_backend(tmp_path):
    with pytest.raises(pm.PapermillExecutionError, match="known backends"):
        pm.execute_notebook(str(REPO / "notebooks" / "measure.ipynb"), str(tmp_path / "bad.ipynb"),
                            parameters=dict(backend="hf_turbo", params=str(SMOKE), campaign="x"),
                            cwd=str(REPO), progress_bar=False, kernel_name="python3")


def test_measure_notebook_profiles_a_cell(tmp_path):
    pm.execute_notebook(str(REPO / "notebooks" / "measure.ipynb"), str(tmp_path / "p.ipynb"),
                        parameters=dict(backend="hf_cached", params=str(SMOKE), campaign="prof", run_id="p",
                                        output_dir=str(tmp_path / "outputs"), profile_cell="p16-r8-n1-greedy"),
                        cwd=str(REPO), progress_bar=False, kernel_name="python3")
    nb = nbformat.read(str(tmp_path / "p.ipynb"), as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "Self CPU" in text and "aten::" in text
    trace = tmp_path / "outputs" / "profiles" / "prof" / "hf_cached" / "p-p16-r8-n1-greedy.trace.json.gz"
    assert trace.stat().st_size > 1000
    assert not (tmp_path / "outputs" / "raw").exists()  # profiling does not write measurements
    assert os.path.exists(trace)
    # a CPU run's trace has no GPU kernel: no decode step breakdown, said so, and no record beside the trace
    assert "decode step breakdown: not_applicable (trace: no GPU kernels in it" in text
    assert not trace.with_name("p-p16-r8-n1-greedy.breakdown.json").exists()


def test_committed_notebooks_are_what_the_builder_writes():
    """notebooks/*.ipynb are generated (`make notebooks`): a stale copy fails here, not in a user's run."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    import build_notebooks

    builders = {"measure": build_notebooks.measure_notebook, "summary": build_notebooks.summary_notebook}
    for name, build in builders.items():
        built = build()
        committed = nbformat.read(str(REPO / "notebooks" / f"{name}.ipynb"), as_version=4)
        assert [c.source for c in committed.cells] == [c.source for c in built.cells], (
            f"notebooks/{name}.ipynb is stale: run `make notebooks`")
