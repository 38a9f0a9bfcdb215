"""Issue 43's side by side: `rollout vllm-diagnostic --variants ...,hf_cached` measures the fast path in
its own process beside vLLM's in-process engine without LoRA, and says how far its decode step is from
the step's memory-bandwidth floor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_lib.measure.floor import decode_step_floor, kv_bytes_per_column, lora_bytes, mean_decode_columns
from rollout_lib.study.arch import get_architecture

from .conftest import REPO

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_the_weights_floor_of_the_0_6b_on_an_h200_is_a_quarter_millisecond():
    """The issue's own arithmetic (1.2 GB of bf16 weights at 4.8 TB/s is 0.25 ms) from the architecture's
    shapes, and the KV cache on top: 16 rows at a mean of 768 filled columns read more than the weights."""
    arch = get_architecture("qwen3-0.6b")
    floor = decode_step_floor(arch, "NVIDIA H200", rows=16, mean_cache_columns=768, lora_rank=16,
                              lora_targets=TARGETS)
    assert floor["status"] == "measured"
    assert 1.15e9 < floor["weight_bytes"] < 1.25e9
    assert 0.24e-3 < floor["weights_floor_s"] < 0.26e-3
    # 28 layers x (k + v) x 8 heads x 128 x 2 bytes per row and column
    assert kv_bytes_per_column(arch) == 28 * 2 * 8 * 128 * 2
    assert floor["kv_cache_bytes"] == 16 * 768 * 28 * 2 * 8 * 128 * 2
    # A [16, in] and B [out, 16] in float32 for the seven projections of 28 layers
    assert floor["lora_bytes"] == 28 * sum((o + i) * 16 for o, i in (
        (2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072))) * 4
    expected = (floor["weight_bytes"] + floor["lora_bytes"] + floor["kv_cache_bytes"]) / 4.8e12
    assert floor["step_floor_s"] == pytest.approx(expected, rel=1e-12)
    assert floor["step_floor_s"] > 2 * floor["weights_floor_s"]


def test_a_gpu_without_a_datasheet_figure_gets_not_applicable_never_a_guess():
    floor = decode_step_floor(get_architecture("tiny"), "cpu", rows=4, mean_cache_columns=20)
    assert floor["status"] == "not_applicable" and "step_floor_s" not in floor
    assert "'cpu'" in floor["reason"] and "NVIDIA H200" in floor["reason"]


def test_bad_floor_inputs_are_refused_naming_what_is_allowed():
    with pytest.raises(ValueError, match=r"lora targets \['qkv'\]: not projections of tiny; allowed: \["):
        lora_bytes(get_architecture("tiny"), 8, ("qkv",))
    with pytest.raises(ValueError, match="rows >= 1"):
        decode_step_floor(get_architecture("tiny"), "NVIDIA H200", rows=0, mean_cache_columns=1)


def test_mean_decode_columns_counts_the_prompt_and_half_the_response():
    # decode steps 1..63 read 128 + 1 .. 128 + 63 columns
    assert mean_decode_columns(128, 64) == sum(128 + k for k in range(1, 64)) / 63


def test_hf_cached_runs_in_its_own_process_beside_the_engine_without_lora(smoke_study, tmp_path, monkeypatch):
    """The fast path really runs (a child process on the tiny smoke model); the vLLM side is a stand-in
    child with a fixed rate, so the ratio and the verdict are judged on hf_cached's measured figure."""
    from rollout_lib.checks import vllm_inprocess

    started = []

    def engine_child(python, job):
        started.append("adapter_dir" in job)
        return {"adapter": False, "cells": {c: {"tokens_per_s": 50.0} for c in job["cells"]}}

    monkeypatch.setattr(vllm_inprocess, "run_child", engine_child)
    report = vllm_inprocess.run_diagnostic(smoke_study, ["p16-r8-n1-greedy"], repetitions=2,
                                           variants=("hf_cached", "inprocess_no_adapter"),
                                           backend_options={"cache_dir": str(tmp_path / "cache")},
                                           hf_cached_options={"engine": {"PREFILL": "shared_prompts"}})
    # the candidate reached the child's engine, and the file says which options the hf_cached side ran with
    assert report["hf_cached"]["environment"]["prefill"] == "shared_prompts"
    assert report["hf_cached_options"] == {"engine": {"PREFILL": "shared_prompts"}}
    assert started == [False], "only the engine without LoRA was started"
    assert report["variants"] == ["inprocess_no_adapter", "hf_cached"] and "managed" not in report
    (row,) = report["rows"]
    measured = report["hf_cached"]["cells"]["p16-r8-n1-greedy"]
    assert measured["generated_tokens"] == 4 * 8 and len(measured["wall_s"]) == 2
    assert row["hf_cached_tokens_per_s"] == measured["tokens_per_s"] > 0
    assert 0 < row["hf_cached_median_decode_step_s"] < measured["median_wall_s"]
    assert row["hf_cached_over_inprocess_no_adapter"] == pytest.approx(measured["tokens_per_s"] / 50.0)
    assert report["verdict"] == {"hf_cached_at_least_1.3x_inprocess_no_adapter":
                                 row["hf_cached_over_inprocess_no_adapter"] >= 1.3}
    # on the CPU there is no bandwidth figure: said, not guessed
    assert row["decode_step_floor"]["status"] == "not_applicable"
    assert row["hf_cached_decode_step_over_floor"] == "not_applicable"
    assert report["hf_cached"]["policy_identity"] == report["policy_identity"]


def test_the_engine_without_lora_also_runs_with_its_prefix_cache_reset_before_each_call(smoke_study, tmp_path,
                                                                                        monkeypatch):
    """vLLM 0.26 caches prompt prefixes by default, so its measured repetitions could reuse the warm-up's prompt
    KV while hf_cached prefills every call: the reset-cache side takes that away (the child resets before every
    call, outside the timing) and hf_cached is judged against it too."""
    from rollout_lib.checks import vllm_inprocess
    from rollout_lib.report.diagnostics import _inprocess_row

    jobs = []

    def engine_child(python, job):
        jobs.append(job)
        rate = 40.0 if job.get("reset_prefix_cache") else 50.0
        return {"adapter": False, "cells": {c: {"tokens_per_s": rate} for c in job["cells"]}}

    monkeypatch.setattr(vllm_inprocess, "run_child", engine_child)
    monkeypatch.setattr(vllm_inprocess, "run_backend_child", lambda job: {
        "gpu": "no GPU", "cells": {c: {"tokens_per_s": 60.0, "rows": 4, "median_decode_step_s": 0.002}
                                   for c in job["cells"]}})
    report = vllm_inprocess.run_diagnostic(
        smoke_study, ["p16-r8-n1-greedy"], repetitions=2,
        variants=("inprocess_no_adapter_reset_cache", "hf_cached", "inprocess_no_adapter"),
        backend_options={"cache_dir": str(tmp_path / "cache")})
    assert [bool(j.get("reset_prefix_cache")) for j in jobs] == [False, True]
    assert report["variants"] == ["inprocess_no_adapter", "inprocess_no_adapter_reset_cache", "hf_cached"]
    (row,) = report["rows"]
    assert row["inprocess_no_adapter_reset_cache_tokens_per_s"] == 40.0
    assert row["hf_cached_over_inprocess_no_adapter"] == pytest.approx(1.2)
    assert row["hf_cached_over_inprocess_no_adapter_reset_cache"] == pytest.approx(1.5)
    assert report["verdict"] == {"hf_cached_at_least_1.3x_inprocess_no_adapter": False,
                                 "hf_cached_at_least_1.3x_inprocess_no_adapter_reset_cache": True}
    shown = _inprocess_row(row)
    assert shown["in-process, no adapter, prefix cache reset per call tok/s"] == "40.0"
    assert shown["hf_cached / same, prefix cache reset"] == "1.50"


def test_rounds_interleave_fresh_processes_and_compare_each_sides_median(smoke_study, tmp_path, monkeypatch,
                                                                         capsys):
    """Lease 31 read the engine without LoRA at 1,286 and 1,993 tok/s on one cell in two processes of one hold:
    with rounds, each side runs once per round in a fresh process (interleaved), each side's median over the
    rounds is compared, and each round's ratio (its two sides measured next to each other) is kept beside it."""
    from rollout_lib import cli
    from rollout_lib.checks import vllm_inprocess

    order, engine_rates, hf_rates = [], iter([50.0, 80.0, 60.0]), iter([60.0, 90.0, 72.0])

    def engine_child(python, job):
        order.append("engine")
        return {"adapter": False, "cells": {c: {"tokens_per_s": next(engine_rates)} for c in job["cells"]}}

    def hf_child(job):
        order.append("hf_cached")
        rate = next(hf_rates)
        return {"gpu": "no GPU", "cells": {c: {"tokens_per_s": rate, "rows": 4, "median_decode_step_s": 1 / rate}
                                           for c in job["cells"]}}

    monkeypatch.setattr(vllm_inprocess, "run_child", engine_child)
    monkeypatch.setattr(vllm_inprocess, "run_backend_child", hf_child)
    report = vllm_inprocess.run_diagnostic(smoke_study, ["p16-r8-n1-greedy"], repetitions=2,
                                           variants=("inprocess_no_adapter", "hf_cached"), rounds=3,
                                           backend_options={"cache_dir": str(tmp_path / "cache")})
    assert order == ["engine", "hf_cached"] * 3 and report["rounds"] == 3
    (row,) = report["rows"]
    assert row["inprocess_no_adapter_tokens_per_s"] == 60.0 and row["hf_cached_tokens_per_s"] == 72.0  # medians
    assert report["inprocess"]["no_adapter"]["cells"]["p16-r8-n1-greedy"]["tokens_per_s_by_round"] == [50.0, 80.0,
                                                                                                    60.0]
    assert row["hf_cached_median_decode_step_s"] == pytest.approx(1 / 72.0)
    assert row["hf_cached_over_inprocess_no_adapter"] == pytest.approx(1.2)
    assert row["hf_cached_over_inprocess_no_adapter_by_round"] == pytest.approx([1.2, 1.125, 1.2])
    assert report["verdict"] == {"hf_cached_at_least_1.3x_inprocess_no_adapter": False,
                                 "hf_cached_at_least_1.3x_inprocess_no_adapter_in_every_round": False}
    assert "hf_cached / in-process without LoRA by round: 1.20x, 1.12x, 1.20x" in cli._diagnostic_figures(row)
    from rollout_lib.report.diagnostics import _inprocess_row

    assert _inprocess_row(row)["hf_cached / no LoRA, each round"] == "1.20, 1.12, 1.20"


def test_a_run_stopped_in_a_later_round_leaves_the_rounds_it_finished(smoke_study, snapshot_cache, tmp_path,
                                                                      monkeypatch, capsys):
    """Lease 46: three rounds overran their 480 s job and nothing was written. Now each finished round but the
    last replaces --out atomically, marked incomplete; a run that dies in round 2 leaves round 1's figures and
    its own error, and a run that finishes ends complete."""
    from rollout_lib import cli
    from rollout_lib.checks import vllm_inprocess

    rounds_started = []

    def engine_child(python, job):
        rounds_started.append("engine")
        if len(rounds_started) == 2:  # round 2's first side: the job's time limit, or a crash
            raise RuntimeError("in-process vLLM child failed (exit -9): killed")
        return {"adapter": False, "cells": {c: {"tokens_per_s": 50.0} for c in job["cells"]}}

    def hf_child(job):
        return {"gpu": "no GPU", "cells": {c: {"tokens_per_s": 80.0, "rows": 4, "median_decode_step_s": 0.0125}
                                           for c in job["cells"]}}

    monkeypatch.setattr(vllm_inprocess, "run_child", engine_child)
    monkeypatch.setattr(vllm_inprocess, "run_backend_child", hf_child)
    out = tmp_path / "side-by-side.json"
    argv = ["vllm-diagnostic", "--params", smoke_study.source_path, "--cells", "p16-r8-n1-greedy",
            "--variants", "inprocess_no_adapter,hf_cached", "--rounds", "3", "--repetitions", "1", "--out", str(out)]
    monkeypatch.setattr("rollout_lib.backends.vllm_managed.DEFAULT_CACHE_DIR", Path(snapshot_cache))
    with pytest.raises(RuntimeError, match="killed"):
        cli.main(argv)
    assert "round 1 of 3 measured; wrote" in capsys.readouterr().out
    partial = json.loads(out.read_text())
    assert (partial["rounds"], partial["rounds_requested"], partial["complete"]) == (1, 3, False)
    (row,) = partial["rows"]
    assert row["hf_cached_over_inprocess_no_adapter_by_round"] == [pytest.approx(1.6)]
    assert list(tmp_path.glob("*.tmp*")) == [], "no temporary file is left beside --out"

    rounds_started[:] = ["engine", "engine"]  # the same stand-ins, now every round finishes
    done = tmp_path / "side-by-side-2.json"
    assert cli.main([*argv[:-1], str(done)]) == 0
    full = json.loads(done.read_text())
    assert (full["rounds"], full["rounds_requested"], full["complete"]) == (3, 3, True)
    assert full["rows"][0]["hf_cached_over_inprocess_no_adapter_by_round"] == pytest.approx([1.6, 1.6, 1.6])

    # a file put in the run's place between two rounds is not replaced
    swapped = tmp_path / "side-by-side-3.json"
    calls = []

    def swapping_child(job):
        calls.append(1)
        if len(calls) == 2:
            swapped.write_text('{"kind": "someone else\'s"}')
        return hf_child(job)

    monkeypatch.setattr(vllm_inprocess, "run_backend_child", swapping_child)
    rounds_started[:] = ["engine", "engine"]
    assert cli.main([*argv[:-1], str(swapped)]) == 2
    assert "changed since this run wrote it" in capsys.readouterr().err
    assert json.loads(swapped.read_text()) == {"kind": "someone else's"}

    # nor one put there before the run's first write
    early = tmp_path / "side-by-side-4.json"
    calls.clear()
    monkeypatch.setattr(vllm_inprocess, "run_backend_child",
                        lambda job: (early.write_text('{"kind": "early"}'), hf_child(job))[1])
    rounds_started[:] = ["engine", "engine"]
    assert cli.main([*argv[:-1], str(early)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists; evidence is never overwritten" in err[0], err
    assert json.loads(early.read_text()) == {"kind": "early"}


def test_the_report_table_shows_only_the_sides_that_ran():
    from rollout_lib.report.diagnostics import _inprocess_row

    row = _inprocess_row({"cell_id": "c", "inprocess_no_adapter_tokens_per_s": 1000.0,
                          "hf_cached_tokens_per_s": 1500.0, "hf_cached_over_inprocess_no_adapter": 1.5,
                          "hf_cached_median_decode_step_s": 0.0021, "hf_cached_decode_step_over_floor": 7.6,
                          "decode_step_floor": {"status": "measured", "step_floor_s": 0.000276}})
    assert row == {"cell": "c", "in-process, no adapter tok/s": "1,000.0", "hf_cached tok/s": "1,500.0",
                   "hf_cached / in-process, no LoRA": "1.50", "hf_cached ms/step": "2.10",
                   "floor ms/step (weights + LoRA + KV)": "0.276", "step / floor": "7.6"}


@pytest.mark.parametrize("extra, message", [
    (["--variants", "hf_cached,sglang"], "variants ['hf_cached', 'sglang']: unknown sglang; allowed: a "
                                         "comma-separated subset of managed, inprocess_adapter, inprocess_no_adapter, "
                                         "inprocess_no_adapter_reset_cache, hf_cached"),
    (["--variants", ","], "variants []: none given; allowed:"),
    (["--variants", "hf_cached", "--hf-cached-option", 'engine={"LORA_SHRINK": "fused"}'],
     "hf_cached: LORA_SHRINK 'fused' is not allowed; allowed: reductions, in_base_gemm"),
    (["--hf-cached-option", "decode=eager"], "hf_cached_options: options of the hf_cached side; add hf_cached"),
    (["--rounds", "2"], "rounds 2 is not allowed; allowed: an integer >= 1, and 1 when managed is among the "
                        "variants (the managed backend is measured once)"),
    (["--variants", "hf_cached", "--rounds", "0"], "rounds 0 is not allowed; allowed: an integer >= 1"),
])
def test_bad_variants_and_options_are_refused_in_one_line_before_anything_runs(tmp_path, extra, message):
    out = tmp_path / "diag.json"
    done = subprocess.run([sys.executable, "-m", "rollout_lib.cli", "vllm-diagnostic", "--params",
                           "params/profiles/smoke.yaml", "--cells", "p16-r8-n1-greedy", *extra,
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists()


def test_non_streamed_needs_the_managed_side(smoke_study):
    from rollout_lib.checks.vllm_inprocess import run_diagnostic

    with pytest.raises(ValueError, match="non_streamed: a setting of the managed backend; add managed"):
        run_diagnostic(smoke_study, ["p16-r8-n1-greedy"], variants=("hf_cached",), non_streamed=True)


def test_the_child_writes_one_json_line_a_parent_can_read(smoke_study, tmp_path):
    job = {"params": smoke_study.source_path, "backend": "hf_cached", "cells": ["p16-r8-n1-greedy"],
           "repetitions": 1, "options": {}}
    done = subprocess.run([sys.executable, "-m", "rollout_lib.checks.backend_child"], input=json.dumps(job),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "hf_cached" and result["gpu"] == "cpu"
    assert result["cells"]["p16-r8-n1-greedy"]["rows"] == 4


def _repetition(cell_id, wall_s, decode_s, steps, warmup=False):
    return {"record": "repetition", "cell_id": cell_id, "wall_s": wall_s, "warmup": warmup, "decode_steps": steps,
            "phases": {"decode_s": {"status": "measured", "seconds": decode_s}}}


def test_the_report_reads_the_calculators_repetitions_and_puts_each_step_beside_its_floor(prereg_study):
    """The decode step per cell is the median over exactly the repetitions the aggregate used (matched by wall
    time; a warm-up and a repetition of another segment with another wall are not), against the floor for the
    GPU its raw file names; a cell whose repetitions expose no step count is left out, never a 0."""
    from rollout_lib.report import summary

    header = {"record": "header", "environment": {"gpu": {"name": "NVIDIA H200"}}}
    records = [header,
               _repetition("p128-r64-n1-greedy", 9.0, 8.0, 63, warmup=True),
               _repetition("p128-r64-n1-greedy", 0.20, 0.126, 63),   # 2.0 ms
               _repetition("p128-r64-n1-greedy", 0.21, 0.1449, 63),  # 2.3 ms
               _repetition("p128-r64-n1-greedy", 0.22, 0.1512, 63),  # 2.4 ms
               _repetition("p128-r64-n1-greedy", 0.50, 0.315, 63),   # not among the aggregate's walls
               _repetition("p512-r512-n4-greedy", 1.9, 1.533, 511),  # 3.0 ms
               {"record": "repetition", "cell_id": "p128-r64-n4-greedy", "wall_s": 0.3, "warmup": False,
                "phases": {"decode_s": {"status": "not_measured", "reason": "x"}}}]
    inputs = {"raw_files": [{"backend": "hf_cached", "records": records, "path": "a", "run_id": "a"}]}
    cell = {"backend": "hf_cached", "valid": True, "prompt_tokens": 128, "response_tokens": 64, "samples_per_prompt": 1}
    aggregate = {"cells": [cell | {"cell_id": "p128-r64-n1-greedy", "wall_s": [0.20, 0.21, 0.22]},
                           cell | {"cell_id": "p512-r512-n4-greedy", "wall_s": [1.9], "prompt_tokens": 512,
                                   "response_tokens": 512, "samples_per_prompt": 4},
                           cell | {"cell_id": "p128-r64-n4-greedy", "wall_s": [0.3], "samples_per_prompt": 4},
                           cell | {"cell_id": "p128-r64-n1-stochastic", "wall_s": [0.2], "valid": False}]}
    floor = summary.decode_floor(aggregate, inputs, prereg_study)
    assert [(r["cell_id"], r["rows"]) for r in floor["cells"]] == [("p128-r64-n1-greedy", 4),
                                                                    ("p512-r512-n4-greedy", 16)]
    assert floor["cells"][0]["step_s"] == pytest.approx(0.0023)
    assert floor["by_rows"][4]["median_step_s"] == pytest.approx(0.0023)
    expected = decode_step_floor(get_architecture("qwen3-0.6b"), "NVIDIA H200", 16, mean_decode_columns(512, 512),
                                 16, TARGETS)
    assert floor["cells"][1]["floor"] == expected
    assert floor["by_rows"][16]["median_over_floor"] == pytest.approx(0.003 / expected["step_floor_s"])
    sentence = summary.decode_floor_sentence(floor)
    assert sentence.startswith("hf_cached decode step: 2.30 ms at 4 rows (median of 1 cells; ")
    assert "3.00 ms at 16 rows" in sentence
    table = summary.decode_floor_table(floor)
    assert list(table["decode step"]) == ["2.30 ms", "3.00 ms"]
    # on a machine without a bandwidth figure: said so in every place
    header["environment"]["gpu"] = {"status": "not_applicable"}
    floor = summary.decode_floor(aggregate, inputs, prereg_study)
    assert floor["by_rows"][4]["median_over_floor"] == "not_applicable"
    sentence = summary.decode_floor_sentence(floor)
    assert sentence.startswith("hf_cached decode step: 2.30 ms at 4 rows (median of 1 cells), 3.00 ms at 16 rows")
    assert sentence.endswith("No bandwidth floor: measured without a GPU.")
    header["environment"]["gpu"] = {"status": "measured", "name": "NVIDIA B200"}
    assert summary.decode_floor_sentence(summary.decode_floor(aggregate, inputs, prereg_study)).endswith(
        "No bandwidth floor: no nominal HBM figure for NVIDIA B200.")
    assert set(summary.decode_floor_table(floor)["step / floor"]) == {"not_applicable"}


def test_the_side_by_side_is_speed_evidence_and_the_lora_tax_stays_with_exactness(prereg_study, tmp_path):
    """A diagnostic with hf_cached among its sides is shown in the speed section's details (with its ratio and
    floor columns); the vLLM-only diagnostics stay in the exactness section's."""
    from rollout_lib.evidence.publish import collect_inputs
    from rollout_lib.evidence.reproducibility import reproducibility
    from rollout_lib.report import sections

    aggregate = json.loads((REPO / "outputs" / "aggregate" / "h200-v2.json").read_text())
    inputs = collect_inputs(prereg_study, "h200-v2", REPO / "outputs")
    (tmp_path / "perf").mkdir()
    side = {"kind": "vllm_inprocess_diagnostic", "variants": ["inprocess_no_adapter", "hf_cached"],
            "rows": [{"cell_id": "p128-r64-n1-greedy", "inprocess_no_adapter_tokens_per_s": 1248.0,
                      "hf_cached_tokens_per_s": 1500.0, "hf_cached_over_inprocess_no_adapter": 1500 / 1248,
                      "hf_cached_median_decode_step_s": 0.0021, "hf_cached_decode_step_over_floor": 7.7,
                      "decode_step_floor": {"status": "measured", "step_floor_s": 0.000272}}]}
    tax = {"kind": "vllm_inprocess_diagnostic", "rows": [{"cell_id": "c1", "managed_tokens_per_s": 800.0,
                                                          "inprocess_adapter_tokens_per_s": 1000.0}]}
    (tmp_path / "perf" / "side.json").write_text(json.dumps(side))
    (tmp_path / "perf" / "tax.json").write_text(json.dumps(tax))
    speed = sections.speed_html(aggregate, prereg_study, inputs, tmp_path)
    assert "in-process engine without LoRA (diagnostic runs, beside the gates)" in speed
    assert "side.json" in speed and "tax.json" not in speed and " >1.20</td>" in speed
    exactness = sections.exactness_html(aggregate, prereg_study, reproducibility(aggregate, inputs), "h200-v2",
                                        tmp_path)
    assert "tax.json" in exactness and "side.json" not in exactness


def test_a_side_by_side_of_candidate_settings_says_so_in_its_caption(tmp_path):
    """A run with `--hf-cached-option engine=...` measured candidates, not the engine a campaign measured: the
    report's caption names the options; a run without options adds nothing."""
    from rollout_lib.report.diagnostics import caption

    base = {"kind": "vllm_inprocess_diagnostic", "variants": ["inprocess_no_adapter", "hf_cached"], "rows": []}
    path = tmp_path / "vllm-diagnostic-hf_cached-h200.json"
    path.write_text(json.dumps(base))
    plain = caption(path, base)
    assert "bandwidth floor" in plain and "options" not in plain and "candidates" not in plain
    with_options = dict(base, hf_cached_options={"engine": {"LORA_SHRINK": "in_base_gemm", "ATTENTION_BACKEND": "fa3"}})
    text = caption(path, with_options)
    assert ('hf_cached with options `engine={"ATTENTION_BACKEND": "fa3", "LORA_SHRINK": "in_base_gemm"}` '
            "(candidates, not the campaign's engine)") in text
