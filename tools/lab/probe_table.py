"""The before/after table of a decode probe (issue 43, item 1): every variant against the probe's baseline, per
cell, from what `tools/lab/fast_path_probe.py` and `fast_path_evidence.sh` returned to a folder.

    python tools/lab/probe_table.py outputs/perf/decode-expand-attention [DIR ...] [--baseline VARIANT] [--json F]

Per folder: `probe.json` gives each variant's ms per decode step, tok/s, prefill ms, peak reserved memory
and cold start (or its error); each `trace-<variant>-<cell>-20ms.json.gz` beside it, a window of decode steps,
gives kernels per step, GPU busy time and the gaps between kernels (`rollout profile-breakdown`). The
baseline is the folder's first variant unless `--baseline` names another (the lab's queues list the
shrink-only engine first). A trace's steps are counted by its read-backs (`rollout profile-breakdown`); a
trace without two of them is counted by attention kernels, and where that count disagrees by more than 25 %
with its span over the probe's ms per step (a variant whose attention takes two kernels a layer, e.g.
split-KV with a combine kernel) by the span instead, and its row says so. Prints two markdown
tables per folder: the speed of each variant against the baseline, then where a decode step's GPU time goes
(ms per step by kernel category: GEMMs, float32 GEMMs, LoRA reductions, attention, norms, sampling, the rest,
the gaps, the part of them just before attention kernels and the part that is the GPU waiting for the host;
`rollout profile-breakdown` says how kernels are sorted). `--launches` adds a third table: per traced row,
inductor's reduction kernels (us per step in all) and the launch shapes of the four that took longest, so a
delta can be checked against the draw of launch configurations each compilation makes (docs/perf-notes.md,
lease 28). `--kernels N` adds each traced row's N kernels with the most time per step (name, launch shape, calls
per step, us per call and per step). Where the probe compiled a source more than once (`+again`, `+again2`), a
table of each source over its compilations: mean, min-max and the mean against the baseline's mean. `--json` also
writes the rows.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rollout_lib.core import write_json_atomic  # noqa: E402
from rollout_lib.measure.step_profile import StepProfileError, breakdown, gpu_events, read_trace  # noqa: E402

STEP_COUNT_TOLERANCE = 0.25
MAX_PROBE_BYTES = 16 * 1024 * 1024


def _trace_figures(path: Path, ms_per_step: float | None) -> dict[str, Any]:
    """Kernels, busy and gaps per decode step of one trimmed trace."""
    events = read_trace(path)[0]["traceEvents"]
    try:
        result = breakdown(events)
    except StepProfileError as exc:  # no attention kernel to count steps by: the span is all there is
        result = None
        why = str(exc)
    else:
        why = None
    if ms_per_step and ms_per_step > 0:
        span_us = (result["span_us_per_step"] * result["steps"]) if result else _span_us(events)
        span_steps = span_us / (1000 * ms_per_step)
        counted = result is not None and str(result["steps_from"]).startswith("read-backs")
        if not counted and (result is None or abs(result["steps"] - span_steps) > STEP_COUNT_TOLERANCE * span_steps):
            result = breakdown(events, steps=span_steps)
            result["steps_from"] = f"trace span / the probe's ms per step ({why or 'attention count disagreed'})"
    if result is None:
        raise ValueError(f"{path.name}: {why}")
    return {"kernels_per_step": result["kernels_per_step"], "busy_ms_per_step": result["gpu_busy_us_per_step"] / 1000,
            "gaps_ms_per_step": result["gaps_us_per_step"] / 1000, "steps_in_window": result["steps"],
            "gaps_before_attention_ms_per_step": result["gaps_before_attention_us_per_step"] / 1000,
            "host_waits_ms_per_step": result["host_waits_us_per_step"] / 1000,
            "steps_from": result["steps_from"], "reduction_launches": result.get("reduction_launches", []),
            "kernel_launches": result.get("kernel_launches", []),
            "ms_per_step_by_category": {label: round(row["us"] / 1000, 4)
                                        for label, row in result["categories"].items()}}


def _span_us(events: list[dict[str, Any]]) -> float:
    kernels = gpu_events(events)
    return max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)


def read_probe(folder: Path) -> dict[str, Any]:
    """The folder's probe.json (a regular file under the size limit, with at least one variant)."""
    path = folder / "probe.json"
    if not path.is_file() or path.is_symlink():
        raise ValueError(f"{folder}: no probe.json (a regular file) in it")
    if path.stat().st_size > MAX_PROBE_BYTES:
        raise ValueError(f"{path}: over {MAX_PROBE_BYTES} bytes, not a probe")
    probe = json.loads(path.read_text())
    if not [name for name in probe if name != "cells"]:
        raise ValueError(f"{path}: no variant in it")
    return probe


def probe_rows(folder: Path, baseline: str | None = None) -> list[dict[str, Any]]:
    """One row per (variant, cell) of the folder's probe, with its difference to the baseline's same cell."""
    probe = read_probe(folder)
    path = folder / "probe.json"
    variants = [name for name in probe if name != "cells"]
    baseline = baseline if baseline is not None else variants[0]
    if baseline not in variants:
        raise ValueError(f"--baseline: {baseline!r} is not a variant of {path}; allowed: {', '.join(variants)}")
    base_cells = probe[baseline].get("cells") or {}
    rows = []
    for variant in variants:
        entry = probe[variant]
        cells = entry.get("cells") or {}
        if "error" in entry and not cells:
            rows.append({"folder": str(folder), "variant": variant, "cell": None, "error": entry["error"]})
            continue
        for cell, figures in cells.items():
            ms, base = figures["ms_per_decode_step"], base_cells.get(cell)
            row: dict[str, Any] = {
                "folder": str(folder), "variant": variant, "cell": cell, "baseline": baseline,
                "ms_per_decode_step": round(ms, 3), "tokens_per_s": round(figures["tokens_per_s"], 1),
                "ms_prefill": round(figures["ms_prefill"], 2) if "ms_prefill" in figures else None,
                "delta_ms_per_step": round(ms - base["ms_per_decode_step"], 3) if base else None,
                "tokens_per_s_ratio": round(figures["tokens_per_s"] / base["tokens_per_s"], 3) if base else None,
                "peak_reserved_gib": (round(entry["peak_reserved_bytes"] / 2**30, 2)
                                      if "peak_reserved_bytes" in entry else None),
                "cold_start_s": round(entry["cold_start_s"], 1) if "cold_start_s" in entry else None}
            trace = folder / f"trace-{variant}-{cell}-20ms.json.gz"
            if trace.is_file() and not trace.is_symlink():
                try:
                    row |= _trace_figures(trace, ms)
                except ValueError as exc:
                    row["trace_error"] = str(exc)
            rows.append(row)
    return rows


def _cell(value: Any, fmt: str = "{}") -> str:
    return "—" if value is None else fmt.format(value)


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | cell | ms/step | Δ ms | tok/s | × base | prefill ms | peak GiB | kernels/step | gaps ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.get("cell") is None:
            lines.append(f"| {row['variant']} | failed: {row['error'][:80]} | | | | | | | | |")
            continue
        note = " (steps by span)" if "span" in str(row.get("steps_from", "")) else ""
        lines.append(
            f"| {row['variant']} | {row['cell']} | {row['ms_per_decode_step']:.3f} | "
            f"{_cell(row['delta_ms_per_step'], '{:+.3f}')} | {row['tokens_per_s']:.0f} | "
            f"{_cell(row['tokens_per_s_ratio'], '{:.3f}')} | {_cell(row['ms_prefill'], '{:.1f}')} | "
            f"{_cell(row['peak_reserved_gib'])} | {_cell(row.get('kernels_per_step'))}{note} | "
            f"{_cell(row.get('gaps_ms_per_step'), '{:.3f}')} |")
    return "\n".join(lines)


# The time table's columns: (heading, step_profile categories summed into it); what no column names is "rest".
TIME_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GEMM", ("gemm",)), ("float32 GEMM", ("gemm_float32",)), ("LoRA reductions", ("low_rank_reductions",)),
    ("attention", ("attention",)), ("norms", ("rmsnorm",)), ("sampling", ("sampling",)))


def render_time(rows: list[dict[str, Any]]) -> str:
    """Where each traced row's decode step spends its GPU time, ms per step by kernel category, and the gaps."""
    named = {label for _, labels in TIME_COLUMNS for label in labels}
    lines = ["| variant | cell | " + " | ".join(heading for heading, _ in TIME_COLUMNS)
             + " | rest | busy | gaps | of which before attention | of which host waits |",
             "|---|---|" + "---|" * (len(TIME_COLUMNS) + 5)]
    for row in rows:
        by_category = row.get("ms_per_step_by_category")
        if by_category is None:
            continue
        figures = [sum(by_category.get(label, 0.0) for label in labels) for _, labels in TIME_COLUMNS]
        rest = sum(ms for label, ms in by_category.items() if label not in named)
        lines.append(f"| {row['variant']} | {row['cell']} | " + " | ".join(f"{ms:.3f}" for ms in figures)
                     + f" | {rest:.3f} | {row['busy_ms_per_step']:.3f} | {row['gaps_ms_per_step']:.3f} | "
                     f"{row['gaps_before_attention_ms_per_step']:.3f} | {row['host_waits_ms_per_step']:.3f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def render_launches(rows: list[dict[str, Any]], top: int = 4) -> str:
    """Per traced row: inductor's reductions, us per step in all, and the `top` longest as grid/block: us per call."""
    lines = ["| variant | cell | reductions us/step | longest: grid / block, us per call |", "|---|---|---|---|"]
    for row in rows:
        launches = row.get("reduction_launches")
        if not launches:
            continue
        total = sum(launch["us_per_step"] for launch in launches)
        picks = "; ".join(f"{launch['grid'][0] if launch['grid'] else '?'} / "
                          f"{launch['block'][0] if launch['block'] else '?'}, {launch['us_per_call']:.2f}"
                          for launch in launches[:top])
        lines.append(f"| {row['variant']} | {row['cell']} | {total:.1f} | {picks} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def render_kernels(rows: list[dict[str, Any]], top: int) -> str:
    """Per traced row, its `top` kernels by time per step (any kind, by name and launch shape): calls per step, us
    per call and per step, so a delta reads kernel by kernel against the baseline's (lease 34: the o/down epilogue
    kernel's 10.5 us a call was found so)."""
    lines = ["| variant | cell | kernel | grid / threads | calls/step | us/call | us/step |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        for launch in (row.get("kernel_launches") or [])[:top]:
            shape = (f"{'x'.join(str(d) for d in launch['grid']) if launch['grid'] else '?'} / "
                     f"{launch['block'][0] if launch['block'] else '?'}")
            name = launch["name"] if len(launch["name"]) <= 60 else launch["name"][:57] + "..."
            lines.append(f"| {row['variant']} | {row['cell']} | `{name}` | {shape} | {launch['calls_per_step']:.2f} "
                         f"| {launch['us_per_call']:.2f} | {launch['us_per_step']:.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


# probe suffixes that change nothing: the same source compiled again from empty caches (its draw)
AGAIN_SUFFIXES = ("again", "again2")


def source_of(variant: str) -> str:
    """The variant without its `+again` / `+again2` suffixes: the source it compiled."""
    return "+".join(part for part in variant.split("+") if part not in AGAIN_SUFFIXES)


def compilations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per source (a variant with its `+again` / `+again2` suffixes taken off) and cell, where the probe compiled
    it more than once: the compilations' ms per step (mean, min, max), their mean against the baseline source's
    mean in that cell, and the mean tok/s. A delta between two sources is readable where it exceeds the spread of
    each (lease 31: one pair of compilations of the same source differed by up to 0.33 ms per step)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("cell") is None:
            continue
        groups.setdefault((source_of(row["variant"]), row["cell"]), []).append(row)
    if not any(len(members) > 1 for members in groups.values()):
        return []
    base_source = source_of(rows[0].get("baseline") or rows[0]["variant"])
    out = []
    for (source, cell), members in groups.items():
        steps = [m["ms_per_decode_step"] for m in members]
        mean = sum(steps) / len(steps)
        base = groups.get((base_source, cell))
        base_mean = sum(m["ms_per_decode_step"] for m in base) / len(base) if base else None
        out.append({"source": source, "cell": cell, "compilations": len(steps), "mean_ms_per_step": round(mean, 3),
                    "min_ms_per_step": round(min(steps), 3), "max_ms_per_step": round(max(steps), 3),
                    "delta_mean_ms_per_step": round(mean - base_mean, 3) if base_mean is not None else None,
                    "mean_tokens_per_s": round(sum(m["tokens_per_s"] for m in members) / len(members), 1)})
    return out


def render_compilations(groups: list[dict[str, Any]]) -> str:
    lines = ["| source | cell | compilations | mean ms/step | min-max | Δ mean vs base | mean tok/s |",
             "|---|---|---|---|---|---|---|"]
    for g in groups:
        lines.append(f"| {g['source']} | {g['cell']} | {g['compilations']} | {g['mean_ms_per_step']:.3f} | "
                     f"{g['min_ms_per_step']:.3f}-{g['max_ms_per_step']:.3f} | "
                     f"{_cell(g['delta_mean_ms_per_step'], '{:+.3f}')} | {g['mean_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="folders holding a probe.json (and its traces)")
    parser.add_argument("--baseline", default=None, help="the variant to compare against (default: each "
                                                         "folder's first)")
    parser.add_argument("--json", type=Path, default=None, help="also write every row as JSON here")
    parser.add_argument("--launches", action="store_true",
                        help="also print the inductor reductions' launch shapes per traced row")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also print each traced row's N kernels that take the most time per step")
    args = parser.parse_args(argv)
    if args.kernels < 0:
        parser.error(f"--kernels: {args.kernels} is not allowed; allowed: 0 (none) or more kernels per traced row")
    all_rows = []
    try:
        for folder in args.folders:
            rows = probe_rows(folder, args.baseline)
            print(f"### {folder} (baseline {rows[0].get('baseline') or rows[0]['variant']})\n{render(rows)}\n")
            time_table = render_time(rows)
            if time_table:
                print(f"GPU time per decode step by kernel category, ms (from the traces):\n{time_table}\n")
            groups = compilations(rows)
            if groups:
                print("Each source over its compilations (`+again`, `+again2`: the same source compiled again):\n"
                      f"{render_compilations(groups)}\n")
            launches = render_launches(rows) if args.launches else ""
            if launches:
                print("Inductor's reduction kernels, launch shapes picked at first run (from the traces):\n"
                      f"{launches}\n")
            kernels = render_kernels(rows, args.kernels) if args.kernels else ""
            if kernels:
                print(f"The {args.kernels} kernels with the most GPU time per decode step (from the traces):\n"
                      f"{kernels}\n")
            all_rows += rows
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        write_json_atomic(args.json, all_rows, overwrite=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
