"""tools/lab/probe_table.py on a hand-made probe folder: each variant against the baseline per cell (differences
computed by hand below), kernels and gaps per step from its trimmed trace, a variant whose attention takes two
kernels a layer counted by the trace's span instead, a failed variant shown as failed, bad input refused."""

from __future__ import annotations

import gzip
import json

import pytest

from tools.lab.probe_table import (
    compilations,
    main,
    probe_rows,
    render,
    render_kernels,
    render_launches,
    render_time,
)

LAYERS = 28


def _trace(path, steps: int, attention_kernels_per_layer: int) -> float:
    """Kernels of `steps` decode steps: per layer a 10 us GEMM then the attention kernels of 5 us, 1 us apart.
    Returns the ms per step."""
    events, ts = [], 0.0
    for _ in range(steps):
        for _ in range(LAYERS):
            events.append({"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": ts, "dur": 10.0})
            ts += 11.0
            for k in range(attention_kernels_per_layer):
                events.append({"ph": "X", "cat": "kernel", "name": f"triton_tem_fused_flex_attention_{k}",
                               "ts": ts, "dur": 5.0})
                ts += 6.0
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    return ts / steps / 1000


@pytest.fixture
def folder(tmp_path):
    ms_base = _trace(tmp_path / "trace-inductor+shrinkgemm-p128-r64-n1-greedy-20ms.json.gz", 5, 1)
    ms_flex = _trace(tmp_path / "trace-inductor+shrinkgemm+flex-p128-r64-n1-greedy-20ms.json.gz", 5, 2)
    probe = {"cells": ["p128-r64-n1-greedy", "p512-r256-n4-greedy"],
             "inductor+shrinkgemm": {"cold_start_s": 30.0, "peak_reserved_bytes": 3 * 2**30, "cells": {
                 "p128-r64-n1-greedy": {"ms_per_decode_step": ms_base, "tokens_per_s": 1400.0, "ms_prefill": 40.0},
                 "p512-r256-n4-greedy": {"ms_per_decode_step": 2.7, "tokens_per_s": 5000.0, "ms_prefill": 98.0}}},
             "inductor+shrinkgemm+flex": {"cold_start_s": 45.0, "cells": {
                 "p128-r64-n1-greedy": {"ms_per_decode_step": ms_flex, "tokens_per_s": 1500.0, "ms_prefill": 39.0},
                 "p512-r256-n4-greedy": {"ms_per_decode_step": 2.5, "tokens_per_s": 5400.0, "ms_prefill": 97.0}}},
             "inductor+shrinkgemm+maxat": {"error": "RuntimeError: autotune failed"}}
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    return tmp_path


def test_each_variant_is_compared_with_the_baseline_cell_by_cell(folder):
    rows = probe_rows(folder)
    by = {(r["variant"], r["cell"]): r for r in rows}
    flex_long = by[("inductor+shrinkgemm+flex", "p512-r256-n4-greedy")]
    assert flex_long["delta_ms_per_step"] == -0.2 and flex_long["tokens_per_s_ratio"] == 1.08  # 5400 / 5000
    assert flex_long["ms_prefill"] == 97.0 and flex_long["peak_reserved_gib"] is None
    base = by[("inductor+shrinkgemm", "p128-r64-n1-greedy")]
    assert base["delta_ms_per_step"] == 0 and base["peak_reserved_gib"] == 3.0
    assert base["kernels_per_step"] == 2 * LAYERS and base["steps_in_window"] == 5
    assert base["gaps_ms_per_step"] == pytest.approx(2 * LAYERS * 1e-3 - 1e-3 / 5, abs=1e-6)  # no gap after the last
    assert "attention kernels" in base["steps_from"]
    flex = by[("inductor+shrinkgemm+flex", "p128-r64-n1-greedy")]
    assert flex["kernels_per_step"] == pytest.approx(3 * LAYERS, rel=0.01), "two attention kernels a layer"
    assert "span" in flex["steps_from"] and flex["steps_in_window"] == pytest.approx(5, rel=0.01)
    assert by[("inductor+shrinkgemm+maxat", None)]["error"] == "RuntimeError: autotune failed"
    table = render(rows)
    assert "| inductor+shrinkgemm+flex | p512-r256-n4-greedy | 2.500 | -0.200 | 5400 | 1.080 | 97.0 |" in table
    assert "| inductor+shrinkgemm+maxat | failed: RuntimeError: autotune failed |" in table
    assert "(steps by span)" in table


def test_another_baseline_and_the_json_rows(folder, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main([str(folder), "--baseline", "inductor+shrinkgemm+flex", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    base_long = next(r for r in rows if r["variant"] == "inductor+shrinkgemm" and r["cell"] == "p512-r256-n4-greedy")
    assert base_long["delta_ms_per_step"] == 0.2 and base_long["baseline"] == "inductor+shrinkgemm+flex"
    assert "(baseline inductor+shrinkgemm+flex)" in capsys.readouterr().out


def test_bad_input_is_refused_in_one_line(folder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(folder), "--baseline", "inductor+nothing"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--baseline: 'inductor+nothing' is not a variant" in err and "allowed: inductor+shrinkgemm," in err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty")])
    assert "no probe.json (a regular file) in it" in capsys.readouterr().err


def test_the_time_table_sums_each_category_per_step(folder, capsys):
    rows = probe_rows(folder)
    base = next(r for r in rows if r["variant"] == "inductor+shrinkgemm" and r["cell"] == "p128-r64-n1-greedy")
    # per step: 28 GEMMs of 10 us ("nvjet" -> GEMM) and 28 attention kernels of 5 us
    assert base["ms_per_step_by_category"] == {"gemm": 0.28, "attention": 0.14}
    flex = next(r for r in rows if r["variant"] == "inductor+shrinkgemm+flex" and r["cell"] == "p128-r64-n1-greedy")
    assert flex["ms_per_step_by_category"]["attention"] == pytest.approx(0.28, rel=0.01)  # steps by span: still 5
    table = render_time(rows)
    assert table.splitlines()[0] == ("| variant | cell | GEMM | float32 GEMM | LoRA reductions | attention | norms | "
                                     "sampling | rest | busy | gaps | of which before attention | "
                                     "of which host waits |")
    # gaps: 1 us before each of the 28 attention kernels and after each GEMM but the window's last (1 us / 5 steps)
    assert ("| inductor+shrinkgemm | p128-r64-n1-greedy | 0.280 | 0.000 | 0.000 | 0.140 | 0.000 | 0.000 | 0.000 | "
            "0.420 | 0.056 | 0.028 | 0.000 |") in table
    assert "p512-r256-n4-greedy" not in table, "an untraced cell has no time row"
    assert main([str(folder)]) == 0
    assert "GPU time per decode step by kernel category, ms (from the traces):" in capsys.readouterr().out
    assert render_time([r for r in rows if r.get("cell") is None]) == ""


def _one_trace_folder(folder, events, ms_per_step: float):
    """A probe folder of one variant and cell whose trace holds `events`, at `ms_per_step`."""
    with gzip.open(folder / "trace-inductor+shrinkgemm-p128-r64-n1-greedy-20ms.json.gz", "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    (folder / "probe.json").write_text(json.dumps({"cells": ["p128-r64-n1-greedy"], "inductor+shrinkgemm": {
        "cells": {"p128-r64-n1-greedy": {"ms_per_decode_step": ms_per_step, "tokens_per_s": 1.0}}}}))


def test_the_launches_table_lists_each_traced_row_s_reductions(tmp_path, capsys):
    """`--launches`: per traced row, inductor's reductions in all (us per step) and the longest by launch shape."""
    events, ts = [], 0.0
    for _ in range(2):
        for _ in range(LAYERS):
            events.append({"ph": "X", "cat": "kernel", "name": "triton_per_fused_add_mul_select_slice_sum_0", "ts": ts,
                           "dur": 2.0, "args": {"grid": [12288, 1, 1], "block": [64, 1, 1]}})
            events.append({"ph": "X", "cat": "kernel", "name": "cudnn_sdpa", "ts": ts + 3, "dur": 5.0})
            ts += 9.0
    _one_trace_folder(tmp_path, events, ts / 2 / 1000)
    table = render_launches(probe_rows(tmp_path))
    assert "| inductor+shrinkgemm | p128-r64-n1-greedy | 56.0 | 12288 / 64, 2.00 |" in table
    assert main([str(tmp_path), "--launches"]) == 0
    assert "launch shapes picked at first run" in capsys.readouterr().out
    assert main([str(tmp_path)]) == 0 and "launch shapes" not in capsys.readouterr().out


def test_the_kernels_table_lists_each_traced_row_s_costliest_kernels_with_their_launch_shapes(tmp_path, capsys):
    """`--kernels N`: per traced row, its N kernels by time per step, any kind, a name's launch shapes apart
    (cuBLAS's 3-D grids whole), with calls per step and us per call; a negative N is refused in one line."""
    events, ts = [], 0.0
    for _ in range(2):
        for layer in range(LAYERS):
            grid = [4, 5, 1] if layer % 2 else [4, 25, 1]  # two shapes of one GEMM kernel, 14 calls a step each
            events.append({"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tss_64x8", "ts": ts, "dur": 6.0,
                           "args": {"grid": grid, "block": [384, 1, 1]}})
            events.append({"ph": "X", "cat": "kernel", "name": "residual_norm_epilogue_kernel", "ts": ts + 7,
                           "dur": 10.5, "args": {"grid": [4, 1, 1], "block": [256, 1, 1]}})
            events.append({"ph": "X", "cat": "kernel", "name": "cudnn_sdpa", "ts": ts + 18, "dur": 5.0})
            ts += 24.0
    _one_trace_folder(tmp_path, events, ts / 2 / 1000)
    table = render_kernels(probe_rows(tmp_path), 3)
    assert table.splitlines()[2:] == [
        "| inductor+shrinkgemm | p128-r64-n1-greedy | `residual_norm_epilogue_kernel` | 4x1x1 / 256 | 28.00 | 10.50 "
        "| 294.0 |",
        "| inductor+shrinkgemm | p128-r64-n1-greedy | `cudnn_sdpa` | ? / ? | 28.00 | 5.00 | 140.0 |",
        "| inductor+shrinkgemm | p128-r64-n1-greedy | `nvjet_sm90_tss_64x8` | 4x25x1 / 384 | 14.00 | 6.00 | 84.0 |"]
    assert main([str(tmp_path), "--kernels", "4"]) == 0
    out = capsys.readouterr().out
    assert "The 4 kernels with the most GPU time" in out and "4x5x1 / 384" in out
    assert main([str(tmp_path)]) == 0 and "most GPU time" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--kernels", "-1"])
    assert exit_info.value.code == 2
    assert "--kernels: -1 is not allowed; allowed: 0 (none) or more" in capsys.readouterr().err


def test_a_source_compiled_more_than_once_is_read_over_its_compilations(tmp_path, capsys):
    """Lease 32's draw probe: X, X+again, X+again2 are one source; its mean, spread and mean against the base's."""
    cell = "p128-r64-n4-stochastic"
    steps = {"inductor+shrinkgemm": 2.40, "inductor+shrinkgemm+again": 2.70, "inductor+shrinkgemm+again2": 2.50,
             "inductor+shrinkgemm+combo": 2.20, "inductor+shrinkgemm+combo+again": 2.30,
             "inductor+shrinkgemm+flex": 3.00}
    probe = {"cells": [cell]} | {v: {"cells": {cell: {"ms_per_decode_step": ms, "tokens_per_s": 4000.0 / ms}}}
                                 for v, ms in steps.items()}
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    groups = {g["source"]: g for g in compilations(probe_rows(tmp_path))}
    assert groups["inductor+shrinkgemm"] == {
        "source": "inductor+shrinkgemm", "cell": cell, "compilations": 3, "mean_ms_per_step": 2.533,
        "min_ms_per_step": 2.4, "max_ms_per_step": 2.7, "delta_mean_ms_per_step": 0.0,
        "mean_tokens_per_s": round((4000 / 2.4 + 4000 / 2.7 + 4000 / 2.5) / 3, 1)}
    assert groups["inductor+shrinkgemm+combo"]["compilations"] == 2
    assert groups["inductor+shrinkgemm+combo"]["delta_mean_ms_per_step"] == pytest.approx(2.25 - 2.5333, abs=1e-3)
    assert groups["inductor+shrinkgemm+flex"]["compilations"] == 1
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| inductor+shrinkgemm+combo | p128-r64-n4-stochastic | 2 | 2.250 | 2.200-2.300 | -0.283 |" in out
    # a probe without a repeated source prints no such table
    assert compilations([r for r in probe_rows(tmp_path) if "again" not in r["variant"]]) == []
