"""Refuse before working, and leave nothing behind: each refusal exits 2 with one line that names the
field and what is allowed, and the output tree is the same before and after (no raw file, seal, lock,
notebook or folder)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_lib.measure.runner import ParameterError, validate_parameters

from .conftest import REPO, SMOKE

CELL = "p16-r8-n1-greedy"
H200_RAW = sorted((REPO / "outputs" / "raw" / "h200-v2" / "hf_cached").glob("*.jsonl"))[0]


def rollout(*argv: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "ROLLOUT_VLLM_PYTHON"}
    return subprocess.run([sys.executable, "-m", "rollout_lib.cli", *argv], capture_output=True, text=True,
                          cwd=cwd, env=base | {"TQDM_DISABLE": "1"} | (env or {}), timeout=300)


def listing(root: Path) -> list[str]:
    """Every path under `root` (files and folders, hidden ones included), or [] when it does not exist."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def refused(out: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, one line on stderr, no traceback, nothing on stdout; every needle in that line."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("rollout ") and ": error: " in lines[0], lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert out.stdout == "", out.stdout
    return lines[0]


@pytest.fixture()
def out(tmp_path) -> Path:
    """An output tree with one earlier good file in it: a refusal must leave it exactly as it was."""
    root = tmp_path / "outputs"
    (root / "runs" / "x").mkdir(parents=True)
    (root / "runs" / "x" / "earlier.ipynb").write_text("{}")
    return root


def measure(out: Path, *extra: str, backend: str = "hf_cached", campaign: str = "fresh") -> list[str]:
    return ["measure", "--backend", backend, "--params", str(SMOKE), "--campaign", campaign,
            "--output-dir", str(out), "--cells", CELL, "--device", "cpu", *extra]


# ------------------------------------------------------------------------------------------
# vLLM that cannot be imported: refused before a snapshot is synthesised or a file is written
# ------------------------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable in this interpreter")
@pytest.mark.parametrize("direct", [False, True], ids=["notebook", "direct"])
def test_measure_vllm_without_vllm_is_refused_before_any_file(out, direct):
    before = listing(out)
    started = time.monotonic()
    result = rollout(*measure(out, *(["--direct"] if direct else []), backend="vllm"))
    refused(result, "backend: vllm is not importable by this interpreter and ROLLOUT_VLLM_PYTHON is not set",
            "allowed:", "ROLLOUT_VLLM_PYTHON", "hf_reference or hf_cached")
    assert listing(out) == before
    assert time.monotonic() - started < 60  # no snapshot was built


@pytest.mark.parametrize("interpreter, needle", [
    ("/nonexistent/python", "is not an executable file"),
    (sys.executable, "cannot import vllm"),
], ids=["missing-interpreter", "interpreter-without-vllm"])
def test_measure_vllm_with_a_bad_rollout_vllm_python_is_refused(out, interpreter, needle):
    if needle == "cannot import vllm" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter imports vLLM")
    before = listing(out)
    result = rollout(*measure(out, backend="vllm"), env={"ROLLOUT_VLLM_PYTHON": interpreter})
    refused(result, f"ROLLOUT_VLLM_PYTHON: {interpreter!r}", needle, "allowed: an interpreter with vLLM")
    assert listing(out) == before


# ------------------------------------------------------------------------------------------
# A campaign bound to a GPU, on this CPU: refused before any file
# ------------------------------------------------------------------------------------------

def _gpu_campaign(out: Path) -> None:
    """A campaign whose first raw file was measured on an H200 (a copy of h200-v2's)."""
    folder = out / "raw" / "gpucamp" / "hf_cached"
    folder.mkdir(parents=True)
    shutil.copy(H200_RAW, folder / H200_RAW.name)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="the machine has a GPU: the refusal under test is a CPU's")
@pytest.mark.parametrize("argv", [
    ("measure",), ("measure", "--direct"),
    ("campaign", "run", "--backend", "hf_cached", "--deadline-s", "60"),
], ids=["measure-notebook", "measure-direct", "campaign-run"])
def test_a_gpu_campaign_on_a_cpu_is_refused_before_any_file(out, argv):
    _gpu_campaign(out)
    before = listing(out)
    if argv[0] == "measure":
        command = measure(out, *argv[1:], campaign="gpucamp")
    else:
        command = [*argv, "--params", str(SMOKE), "--campaign", "gpucamp", "--output-dir", str(out)]
    line = refused(rollout(*command), "campaign: 'gpucamp' is bound to NVIDIA H200",
                   "this process runs on a CPU (no GPU): use another campaign name")
    assert "raw file:" not in line
    assert listing(out) == before  # no raw file, seal, lock, notebook, log or driver state


# ------------------------------------------------------------------------------------------
# Run ids and campaign names: checked before any file operation
# ------------------------------------------------------------------------------------------

LONG = "r" * 300


@pytest.mark.parametrize("argv, needles", [
    (["--run-id", LONG], ("run_id: 300 characters", "at most 64 allowed", "letters, digits, '.', '_', '-'")),
    (["--run-id", "a/b"], ("run_id: 'a/b' must match", "at most 64 characters")),
    (["--run-id", "r1", "--direct"], None),  # placeholder replaced below: the campaign is the bad one
], ids=["run-id-300-chars", "run-id-slash", "campaign-300-chars"])
def test_measure_names_are_checked_before_any_file(out, argv, needles):
    before = listing(out)
    if needles is None:
        command = measure(out, *argv, campaign="c" * 300)
        needles = ("campaign: 300 characters", "at most 64 allowed", "lower-case letters, digits")
    else:
        command = measure(out, *argv)
    refused(rollout(*command), *needles)
    assert listing(out) == before


@pytest.mark.parametrize("command", [
    ["publish"], ["check"], ["report"], ["missing"], ["campaign", "status"], ["campaign", "plan"],
    ["cycle-publish"],
])
def test_every_command_checks_the_campaign_name_first(out, command):
    before = listing(out)
    argv = [*command, "--campaign", "x" * 300, "--output-dir", str(out)]
    refused(rollout(*argv), "campaign: 300 characters", "at most 64 allowed")
    assert listing(out) == before


def test_cycle_checks_its_run_id_first(out):
    before = listing(out)
    argv = ["cycle", "--params", str(REPO / "params" / "profiles" / "smoke-cycle.yaml"), "--backend", "hf_cached",
            "--algorithm", "direct_gkd", "--cell", "p16-r24-n2-stochastic", "--campaign", "smoke",
            "--output-dir", str(out), "--run-id", LONG]
    refused(rollout(*argv), "run_id: 300 characters", "at most 64 allowed")
    assert listing(out) == before


@pytest.mark.parametrize("command", ["publish", "check", "report"])
def test_publish_check_report_need_a_campaign_with_raw_files(out, command):
    (out / "raw" / "pub" / "hf_cached").mkdir(parents=True)
    (out / "raw" / "pub" / "hf_cached" / "r1.jsonl").write_text("")
    before = listing(out)
    result = rollout(command, "--campaign", "nope", "--params", str(SMOKE), "--output-dir", str(out))
    refused(result, "campaign: 'nope' has no raw files under", "allowed: pub")
    assert listing(out) == before and not (out / "aggregate").exists()


def test_publish_in_an_empty_output_tree_says_measure_first(tmp_path):
    result = rollout("publish", "--campaign", "nope", "--params", str(SMOKE), "--output-dir", str(tmp_path / "o"))
    refused(result, "campaign: 'nope' has no raw files", "allowed: none yet (measure first)")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------
# The measure notebook's papermill parameters: type-checked, one line
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value, needle", [
    ("run_id", 5, "run_id: expected str, got int 5"),
    ("cells", 3.5, "cells: expected list or tuple or str or None, got float 3.5"),
    ("campaign", ["smoke"], "campaign: expected str, got list ['smoke']"),
    ("device", True, "device: expected str or None, got bool True"),
    ("backend", None, "backend: expected str, got NoneType None"),
])
def test_parameter_types_are_named(tmp_path, name, value, needle):
    values = dict(backend="hf_cached", params=str(SMOKE), campaign="smoke", output_dir=str(tmp_path)) | {name: value}
    with pytest.raises(ParameterError) as info:
        validate_parameters(**values)
    assert str(info.value) == needle and "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_the_notebook_refuses_a_bad_parameter_type_in_one_line(tmp_path):
    import papermill as pm

    out = tmp_path / "o"
    with pytest.raises(pm.PapermillExecutionError) as info:
        pm.execute_notebook(str(REPO / "notebooks" / "measure.ipynb"), str(tmp_path / "bad.ipynb"),
                            parameters={"run_id": 5, "output_dir": str(out)}, cwd=str(REPO), kernel_name="python3",
                            progress_bar=False)
    assert info.value.ename == "ParameterError" and info.value.evalue == "run_id: expected str, got int 5"
    assert not out.exists()


# ------------------------------------------------------------------------------------------
# A measure notebook run writes to a temporary file and renames it only on success
# ------------------------------------------------------------------------------------------

class _FakePapermill:
    """papermill's interface as `run_measure_notebook` uses it: writes a partial notebook, then ends as told."""

    def __init__(self, ename: str | None):
        import papermill

        self.PapermillExecutionError = papermill.PapermillExecutionError
        self.ename = ename
        self.written: list[Path] = []

    def execute_notebook(self, template, output, **kwargs):
        Path(output).write_text('{"partial": true}')
        self.written.append(Path(output))
        if self.ename is not None:
            raise self.PapermillExecutionError(cell_index=2, exec_count=2, source="", ename=self.ename,
                                               evalue="boom: the reason", traceback=[])


def _run(tmp_path: Path, ename: str | None) -> tuple[Path, _FakePapermill, BaseException | None]:
    from rollout_lib.cli import CommandError, run_measure_notebook

    fake = _FakePapermill(ename)
    notebook = tmp_path / "outputs" / "runs" / "c" / "measure-hf_cached-r1-1.ipynb"
    try:
        run_measure_notebook(fake, REPO / "notebooks" / "measure.ipynb", notebook, {})
    except CommandError as exc:
        return notebook, fake, exc
    return notebook, fake, None


def test_a_successful_notebook_run_is_renamed_into_place(tmp_path):
    notebook, fake, error = _run(tmp_path, None)
    assert error is None and notebook.read_text() == '{"partial": true}'
    assert fake.written[0].parent == notebook.parent and fake.written[0].name.startswith(".")  # hidden temp beside it
    assert sorted(p.name for p in notebook.parent.iterdir()) == [notebook.name]


def test_a_failed_notebook_run_keeps_a_named_failure_notebook_and_no_partial(tmp_path):
    notebook, _fake, error = _run(tmp_path, "RuntimeError")
    failed = notebook.with_name(notebook.stem + ".FAILED.ipynb")
    assert "measure notebook failed: RuntimeError: boom: the reason" in str(error)
    assert f"the failed notebook is kept for debugging: {failed}" in str(error)
    assert sorted(p.name for p in notebook.parent.iterdir()) == [failed.name]  # no partial, no good name


def test_a_refusal_inside_the_notebook_leaves_nothing(tmp_path):
    _notebook, _fake, error = _run(tmp_path, "ParameterError")
    assert str(error) == "boom: the reason"
    assert not (tmp_path / "outputs").exists()  # the folders this run created are gone too


def test_a_failed_run_leaves_an_earlier_good_notebook_alone(tmp_path):
    good = tmp_path / "outputs" / "runs" / "c" / "measure-hf_cached-r1-0.ipynb"
    good.parent.mkdir(parents=True)
    good.write_text('{"good": true}')
    _run(tmp_path, "RuntimeError")
    _run(tmp_path, "ParameterError")
    assert good.read_text() == '{"good": true}'
    assert sorted(p.name for p in good.parent.iterdir()) == [good.name, "measure-hf_cached-r1-1.FAILED.ipynb"]


@pytest.mark.skipif(_cuda(), reason="the machine has a GPU")
def test_a_cuda_device_on_a_cpu_is_refused_before_any_file(out):
    before = listing(out)
    refused(rollout(*measure(out)[:-2], "--device", "cuda"), "device: 'cuda' is not available on this machine",
            "allowed: '' (auto), 'cpu'")
    assert listing(out) == before
