"""Tables and plots of the summary notebook, and the HTML rendering.

The summary notebook calls these on the aggregate that `publish.derive` computes with the
hash-checked frozen calculator; nothing here changes a number, it only lays numbers out.

    rollout report --campaign h200-v1       # papermill summary + nbconvert HTML
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

from rollout_lib.core import REPO_ROOT, project_root, sha256_file
from rollout_lib.safe_read import read_json
from rollout_lib.study.prereg import Preregistration

GIB = 2**30
NO_GPU = "no GPU"  # a raw file whose environment names no GPU (a CPU run)
BACKEND_ORDER = ("hf_reference", "hf_cached", "vllm")


def styled(frame):
    """Left-aligned text, PASS/FAIL coloured: what a reader scans first."""
    def colour(value: Any) -> str:
        return {"PASS": "color:#276749;font-weight:bold", "FAIL": "color:#c53030;font-weight:bold"}.get(value, "")

    import pandas as pd

    if not frame.index.is_unique:  # Styler needs unique labels (e.g. several "raw" artifacts)
        frame = frame.reset_index()
    # the table's HTML ids from its content, not pandas' random default: a report rendered twice from the same
    # evidence is the same bytes (a reviewer's re-render diffs clean)
    uuid = hashlib.sha256(frame.to_csv().encode()).hexdigest()[:10]
    style = (frame.style.set_uuid(uuid).map(colour)
             .set_properties(**{"text-align": "left"})
             .set_table_styles([{"selector": "th", "props": [("text-align", "left")]}]))
    if isinstance(frame.index, pd.RangeIndex):  # a bare 0, 1, 2 column tells a reader nothing
        style = style.hide(axis="index")
    return style


def text(value: Any, digits: int = 4) -> str:
    """A value as a reader wants it: never a bare None/True/False or raw JSON."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "—" if math.isnan(value) else f"{value:.{digits}g}"
    if isinstance(value, (dict, list)):
        return ", ".join(f"{k}: {text(v)}" for k, v in value.items()) if isinstance(value, dict) else \
            ", ".join(text(v) for v in value)
    return str(value)


def _fmt_status(phase: dict[str, Any]) -> str:
    """A phase: its seconds (a cell's median, or one measurement's) when measured, else its status."""
    if phase.get("status") == "measured":
        return f"{phase['median_s'] if 'median_s' in phase else phase['seconds']:.3f} s"
    return phase.get("status", "not_measured")


def model_source_text(spec: Any) -> str:
    """Where a model's weights come from: a synthetic seed and logit scale, or a local snapshot (its
    path and revision label), with the pinned payload digest."""
    if getattr(spec, "source", "synthetic") == "snapshot":
        revision = f", revision {spec.revision}" if getattr(spec, "revision", None) else ""
        return (f"{spec.architecture.name} local snapshot {spec.path}{revision}, digest "
                f"{spec.payload_digest[:16]}…")
    return (f"{spec.architecture.name} synthetic seed {spec.synthetic_seed}, logit scale {spec.logit_scale}, "
            f"digest {spec.payload_digest[:16]}…")


def setup_table(study: Preregistration, aggregate: dict[str, Any], inputs: dict[str, Any]):
    import pandas as pd

    rows = [("study", f"{study.study_id} ({study.status_label})"),
            ("preregistration", f"{Path(study.source_path).name} sha256 {study.sha256}"),
            ("calculator", f"{study.calculator.path} sha256 {aggregate['calculator_sha256']}"),
            ("actor", f"{model_source_text(study.actor)}, NF4 + LoRA r{study.actor.lora.rank}"),
            ("teacher", model_source_text(study.teacher)),
            ("memory budget", f"{study.memory.budget_bytes / GIB:.1f} GiB emulated; gate < "
                              f"{study.memory.gate_peak_total_bytes / GIB:.1f} GiB peak total (NVML, process tree)"),
            ("protocol", f"{study.protocol.warmup_repetitions} warmup + {study.protocol.measured_repetitions} "
                         f"measured repetitions per cell, median")]
    seen = set()
    for raw in inputs["raw_files"]:
        header = raw["records"][0] if raw["records"] else {}
        env = header.get("environment", {})
        gpu = env.get("gpu", {})
        budget = next((r.get("budget", {}) for r in raw["records"] if r.get("record") == "cold_start"), {})
        key = (raw["backend"], raw["run_id"])
        if key in seen:
            continue
        seen.add(key)
        source = env.get("source", {})
        packages = env.get("packages", {})
        commit = (source.get("source_commit") or "not_measured")[:12]
        commit += " (dirty)" if source.get("source_dirty") else ""
        rows.append((f"run {raw['backend']}/{raw['run_id']}",
                     f"GPU {gpu.get('name', gpu.get('status'))} driver {gpu.get('driver')}; torch "
                     f"{packages.get('torch')}, transformers {packages.get('transformers')}, bitsandbytes "
                     f"{packages.get('bitsandbytes')}; source {commit}; torch memory fraction "
                     f"{_fraction(budget.get('memory_fraction'))}"))
    return pd.DataFrame(rows, columns=["item", "value"]).set_index("item")


def _fraction(value: float | None) -> str:
    return "not set (CPU or GPU <= budget)" if value is None else f"{value:.4f} of the GPU = budget"


def throughput_table(aggregate: dict[str, Any]):
    """Rows prompt/response/n; columns backend x sampling tokens/s, and peak memory."""
    import pandas as pd

    rows: dict[tuple, dict[str, Any]] = {}
    for cell in aggregate["cells"]:
        key = (cell["prompt_tokens"], cell["response_tokens"], cell["samples_per_prompt"])
        row = rows.setdefault(key, {})
        rate = cell.get("tokens_per_s")
        label = f"{cell['backend']} {cell['sampling']} tok/s"
        row[label] = (f"{rate:.1f}" if rate is not None else "—") + ("" if cell["valid"] else " (invalid)")
        peak = cell["memory"]["nvml_peak_process_tree_bytes"]
        mem_label = f"{cell['backend']} peak GiB"
        value = peak / GIB if peak is not None else None
        row[mem_label] = max(filter(None, [row.get(mem_label), value]), default=None)
    frame = pd.DataFrame.from_dict(rows, orient="index")
    if frame.empty:
        return frame
    frame.index = pd.MultiIndex.from_tuples(frame.index, names=["prompt", "response", "n"])
    ordered = [c for b in BACKEND_ORDER for c in sorted(frame.columns) if c.startswith(b + " ")]
    frame = frame[ordered].sort_index()
    def fmt(value: Any) -> Any:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "—"
        return f"{value:.3f}" if isinstance(value, float) else value

    return frame.map(fmt)


def _walls_by_process(cell: dict[str, Any]) -> list[tuple[str, list[float]]]:
    """(run id, walls) per process that measured a cell: the earlier segments in the calculator's order
    (each holds its `measured_indices`), then the attempt that completed it (its raw file)."""
    walls = list(cell.get("wall_s") or [])
    parts = []
    for segment in cell.get("segments") or []:
        count = len(segment["measured_indices"])
        parts.append((segment["run_id"], walls[:count]))
        walls = walls[count:]
    parts.append((Path(cell["raw_file"]).stem, walls))
    return [(run_id, w) for run_id, w in parts if w]


def _spread(walls: list[float]) -> float | None:
    return max(walls) / min(walls) if len(walls) >= 2 and min(walls) > 0 else None


def segment_table(aggregate: dict[str, Any]):
    """The cells whose measured repetitions come from more than one process: a cell cut at a lease's deadline
    is continued by a later process, often in another machine hold on another host (DESIGN.md 9). Per cell,
    each process's walls, the cell's spread, and the largest spread within one process, so a reader sees
    how much of a spread lies between holds (h200-v2's oracle: the same cell ran 36% slower in one lease)."""
    import pandas as pd

    rows = []
    for cell in aggregate["cells"]:
        parts = _walls_by_process(cell)
        if len(parts) < 2:
            continue
        within = [x for x in (_spread(w) for _, w in parts) if x is not None]
        rows.append({"backend": cell["backend"], "cell": cell["cell_id"], "valid": text(cell["valid"]),
                     "measured walls by process (s)": "; ".join(
                         f"{run_id}: {', '.join(f'{w:.1f}' for w in walls)}" for run_id, walls in parts),
                     "median s": f"{cell['median_wall_s']:.1f}" if cell.get("median_wall_s") else "—",
                     "spread max/min": (f"{cell['spread_max_over_min']:.2f}"
                                        if cell.get("spread_max_over_min") is not None else "—"),
                     "largest within one process": f"{max(within):.2f}" if within else "—"})
    return pd.DataFrame(rows, columns=["backend", "cell", "valid", "measured walls by process (s)", "median s",
                                       "spread max/min", "largest within one process"])


def segment_summary(aggregate: dict[str, Any]) -> str:
    """One line per backend with continued cells: how many, and their median spread against the cells one
    process measured whole (valid cells only)."""
    import statistics

    lines = []
    for backend in BACKEND_ORDER:
        valid = [c for c in aggregate["cells"] if c["backend"] == backend and c["valid"]
                 and c.get("spread_max_over_min") is not None]
        continued, whole = [], []
        for c in valid:
            (continued if len(_walls_by_process(c)) > 1 else whole).append(c["spread_max_over_min"])
        if not continued:
            continue
        lines.append(f"{backend}: {len(continued)} of {len(valid)} valid cells measured by more than one process, "
                     f"repetition spread (max/min) median {statistics.median(continued):.3f}"
                     + (f" against {statistics.median(whole):.3f} for the {len(whole)} measured by one"
                        if whole else ""))
    return "\n\n".join(lines) or "Every cell's measured repetitions come from one process."


def speedup_figure(aggregate: dict[str, Any], study: Preregistration):
    import matplotlib.pyplot as plt

    all_pairs = [("hf_cached", "hf_reference"), ("vllm", "hf_cached")]
    pairs = [p for p in all_pairs if any(s["candidate"] == p[0] and s["baseline"] == p[1]
                                         for s in aggregate["speedups"])]
    if not pairs:
        return None  # the notebook says in one line what is missing
    cells = {(c["backend"], c["cell_id"]): c for c in aggregate["cells"]}
    fig, axes = plt.subplots(len(pairs), 1, figsize=(11, 3.6 * len(pairs)), squeeze=False)
    for ax, (candidate, baseline) in zip(axes[:, 0], pairs, strict=True):
        points = [s for s in aggregate["speedups"] if s["candidate"] == candidate and s["baseline"] == baseline]
        gate = next((g for g in study.gates if g.kind == "speedup" and g.candidate == candidate), None)
        labels, ratios, lows, highs, colors = [], [], [], [], []
        for point in points:
            cand, base = cells[(candidate, point["cell_id"])], cells[(baseline, point["cell_id"])]
            low = (cand["generated_tokens"] / max(cand["wall_s"])) / (base["generated_tokens"] / min(base["wall_s"]))
            high = (cand["generated_tokens"] / min(cand["wall_s"])) / (base["generated_tokens"] / max(base["wall_s"]))
            labels.append(point["cell_id"])
            ratios.append(point["ratio"])
            lows.append(point["ratio"] - low)
            highs.append(high - point["ratio"])
            covered = gate is not None and point["response_tokens"] in gate.response_tokens
            colors.append("#2b6cb0" if covered else "#a0aec0")
        x = range(len(points))
        ax.bar(x, ratios, color=colors, yerr=[lows, highs], capsize=3)
        if gate is not None:
            ax.axhline(gate.threshold, color="#c53030", linestyle="--",
                       label=f"gate {gate.id}: >= {gate.threshold}x (response {list(gate.response_tokens)})")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("speedup (tokens/s ratio)")
        ax.set_title(f"{candidate} / {baseline} per paired cell (whiskers: repetition extremes; grey: not gated)")
    fig.tight_layout()
    return fig


def memory_figure(aggregate: dict[str, Any], study: Preregistration):
    import matplotlib.pyplot as plt

    cells = [c for c in aggregate["cells"] if c["memory"]["nvml_peak_process_tree_bytes"] is not None]
    if not cells:
        return None  # the notebook says in one line what is missing
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for backend, color in zip(BACKEND_ORDER, ("#718096", "#2b6cb0", "#38a169"), strict=True):
        mine = [c for c in cells if c["backend"] == backend]
        if mine:
            ax.scatter([c["cell_id"] for c in mine], [c["memory"]["nvml_peak_process_tree_bytes"] / GIB for c in mine],
                       label=f"{backend} (NVML process tree)", color=color)
            ax.scatter([c["cell_id"] for c in mine],
                       [(c["memory"]["torch_peak_reserved_bytes"] or 0) / GIB for c in mine], marker="x",
                       color=color, label=f"{backend} (torch peak reserved)")
    ax.axhline(study.memory.gate_peak_total_bytes / GIB, color="#c53030", linestyle="--", label="gate 14.5 GiB")
    ax.axhline(study.memory.budget_bytes / GIB, color="#dd6b20", linestyle=":", label="budget 16 GiB")
    ax.set_ylabel("GiB")
    ax.set_ylim(0, study.memory.budget_bytes / GIB * 1.08)
    ax.tick_params(axis="x", rotation=35, labelsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: it hides no point
    ax.set_title("peak GPU memory per cell against budget and gate")
    fig.tight_layout()
    return fig


def phase_table(aggregate: dict[str, Any]):
    import pandas as pd

    rows = [{"backend": c["backend"], "cell_id": c["cell_id"], "median wall": f"{c['median_wall_s']:.3f} s"
             if "median_wall_s" in c else "—", **{k: _fmt_status(v) for k, v in c.get("phases", {}).items()}}
            for c in aggregate["cells"]]
    return pd.DataFrame(rows).set_index(["backend", "cell_id"]) if rows else pd.DataFrame()


def decode_floor(aggregate: dict[str, Any], inputs: dict[str, Any], study: Preregistration,
                 backend: str = "hf_cached") -> dict[str, Any]:
    """`backend`'s decode step against the step's memory-bandwidth floor (rollout_lib/measure/floor.py), per
    valid cell: the median over the repetitions the calculator used (matched by wall time in the raw files
    of the campaign) of decode seconds / decode steps, and the floor for the GPU its raw file names. Also the
    median over the cells at each row count, the figure issue 43's targets name (ms per step at 4 and 16
    rows). Cells whose backend exposes no decode phase or step count are left out."""
    import statistics

    from rollout_lib.measure.floor import cell_floor, over_floor

    repetitions: dict[tuple[str, float], tuple[float, str]] = {}
    for raw in inputs["raw_files"]:
        if raw["backend"] != backend or not raw["records"]:
            continue
        gpu = (raw["records"][0].get("environment", {}).get("gpu", {}) or {}).get("name") or NO_GPU
        for record in raw["records"]:
            phase = (record.get("phases") or {}).get("decode_s") or {}
            if (record.get("record") == "repetition" and not record.get("warmup") and record.get("decode_steps")
                    and phase.get("status") == "measured"):
                repetitions[(record["cell_id"], record["wall_s"])] = (phase["seconds"] / record["decode_steps"], gpu)
    rows = []
    for cell in aggregate["cells"]:
        if cell["backend"] != backend or not cell.get("valid"):
            continue
        walls = cell.get("wall_s", [])
        found = [repetitions[(cell["cell_id"], w)] for w in walls if (cell["cell_id"], w) in repetitions]
        if len(found) != len(walls) or not found:
            continue
        step = statistics.median(s for s, _ in found)
        row_count = study.workload.logical_prompts * cell["samples_per_prompt"]
        floor = cell_floor(study, found[0][1], row_count, cell["prompt_tokens"], cell["response_tokens"])
        rows.append({"cell_id": cell["cell_id"], "rows": row_count, "step_s": step, "floor": floor,
                     "over_floor": over_floor(step, floor)})
    by_rows = {}
    for count in sorted({r["rows"] for r in rows}):
        chosen = [r for r in rows if r["rows"] == count]
        ratios = [r["over_floor"] for r in chosen if isinstance(r["over_floor"], float)]
        by_rows[count] = {"cells": len(chosen), "median_step_s": statistics.median(r["step_s"] for r in chosen),
                          "median_over_floor": statistics.median(ratios) if ratios else "not_applicable"}
    return {"backend": backend, "cells": rows, "by_rows": by_rows}


def decode_floor_table(floor: dict[str, Any]):
    import pandas as pd

    rows = [{"cell": r["cell_id"], "rows": r["rows"], "decode step": f"{1000 * r['step_s']:.2f} ms",
             "floor (weights + LoRA + KV)": (f"{1000 * r['floor']['step_floor_s']:.3f} ms"
                                             if r["floor"]["status"] == "measured" else r["floor"]["status"]),
             "step / floor": (f"{r['over_floor']:.1f}x" if isinstance(r["over_floor"], float) else r["over_floor"])}
            for r in floor["cells"]]
    return pd.DataFrame(rows)


def decode_floor_sentence(floor: dict[str, Any]) -> str:
    """One line: the median step per row count and, where the GPU has a bandwidth figure, its distance to the
    floor."""
    parts, floors = [], False
    for count, entry in floor["by_rows"].items():
        over = entry["median_over_floor"]
        floors = floors or isinstance(over, float)
        parts.append(f"{1000 * entry['median_step_s']:.2f} ms at {count} rows (median of {entry['cells']} cells"
                     + (f"; {over:.1f}x the bandwidth floor)" if isinstance(over, float) else ")"))
    if not parts:
        return ""
    said = f"{floor['backend']} decode step: " + ", ".join(parts) + "."
    if not floors:
        gpus = sorted({r["floor"]["gpu"] for r in floor["cells"]} - {NO_GPU})
        return said + (f" No bandwidth floor: no nominal HBM figure for {', '.join(gpus)}." if gpus
                       else " No bandwidth floor: measured without a GPU.")
    return said + (" The floor reads the bf16 weights, the float32 LoRA tensors and each row's filled KV cache "
                   "once at the GPU's nominal HBM bandwidth; the gap is kernel launches and kernels below "
                   "bandwidth (docs/perf-notes.md).")


def cold_start_table(aggregate: dict[str, Any], inputs: dict[str, Any]):
    """One row per raw file whose cells the calculator uses: the cold start's total (this process's
    timer, from the raw file's `cold_start` record) and the phases its backend exposes (vLLM: its own
    steps and its server log's lines; the HF backends expose none: `not_measured` there, never 0)."""
    import pandas as pd

    used = {c["raw_file"] for c in aggregate["cells"] if c.get("raw_file")}
    rows = []
    for raw in inputs["raw_files"]:
        if raw["path"] not in used:
            continue
        record = next((r for r in raw["records"] if r.get("record") == "cold_start"), None)
        if record is None:
            continue
        env = record.get("backend_environment") or {}
        phases = env.get("cold_start_phases") or {}
        warm = env.get("compile_cache_warm_at_start")
        rows.append({"backend": raw["backend"], "run": raw["run_id"],
                     "cold start": _fmt_status(record.get("cold_start_s") or {}),
                     **({k: _fmt_status(v) for k, v in phases.items()} if phases else
                        {"phases": "not_measured (this backend exposes no start-up phases)"}),
                     "compile cache at start": {True: "warm", False: "cold"}.get(warm, "not_applicable")})
    return pd.DataFrame(rows).fillna("—").set_index(["backend", "run"]) if rows else pd.DataFrame()


def _failure_text(failure: dict[str, Any]) -> str:
    where = " ".join(x for x in (failure.get("backend"), failure.get("cell_id")) if x)
    return f"{where}: {failure['reason']}" if where else failure["reason"]


INCOMPLETE_MARKERS = ("missing", "no accepted", "not_measured", "not_applicable")


def _lacks_evidence(failure: dict[str, Any]) -> bool:
    return any(marker in failure["reason"] for marker in INCOMPLETE_MARKERS)


def gate_outcome(gate: dict[str, Any]) -> str:
    """PASS, FAIL (a measured value fails) or INCOMPLETE (it fails only for lack of evidence)."""
    if gate["passed"]:
        return "PASS"
    if gate["failing_cells"] and all(_lacks_evidence(f) for f in gate["failing_cells"]):
        return "INCOMPLETE"
    return "FAIL"


def failing_count_text(gate: dict[str, Any]) -> str:
    """How many entries keep a gate from passing, split as the outcome is: `2 failing, 4 without evidence`.
    A missing cell is not a failing one: an INCOMPLETE gate has no failing entry, only entries to measure."""
    lacking = sum(1 for f in gate["failing_cells"] if _lacks_evidence(f))
    failing = len(gate["failing_cells"]) - lacking
    parts = ([f"{failing} failing"] if failing else []) + ([f"{lacking} without evidence"] if lacking else [])
    return ", ".join(parts) or "none failing"


def all_failures_html(aggregate: dict[str, Any]) -> str:
    """Every failing or missing entry of every gate, each gate under its own anchor."""
    import html

    parts = []
    for g in aggregate["gates"]:
        if not g["failing_cells"]:
            continue
        items = "".join(f"<li>{html.escape(_failure_text(f))}</li>" for f in g["failing_cells"])
        parts.append(f'<h4 id="failures-{g["id"]}">{g["id"]} — {gate_outcome(g)}, '
                     f'{failing_count_text(g)}</h4><ul>{items}</ul>')
    return "".join(parts) or "<p>No gate has a failing cell.</p>"


def cut_cell_text(cell_id: str, segments: list[tuple[str, int]], measured_repetitions: int | None = None) -> str:
    """A cell to measure, with how far its cut segments got per measurement identity (`(SHA-256, measured
    repetitions)`, `campaign.driver.waiting_repetitions`): what `rollout missing` and the report print."""
    of = f" of {measured_repetitions}" if measured_repetitions else ""
    return cell_id + "".join(f" ({count}{of} measured, identity {sha[:10]})" for sha, count in segments)


def missing_table(aggregate: dict[str, Any], waiting: dict[str, dict[str, list[tuple[str, int]]]] | None = None,
                  measured_repetitions: int | None = None):
    """Per backend, the cells the calculator has no valid row for. `waiting` (per backend, per cell: (identity
    SHA-256, measured repetitions) of its cut segments, `campaign.driver.waiting_repetitions`) says how far a
    cell cut at a deadline got: a later process under that identity continues it."""
    import pandas as pd

    rows = []
    for b, cells in aggregate["missing_cells"].items():
        shown = [cut_cell_text(c, (waiting or {}).get(b, {}).get(c, []), measured_repetitions) for c in cells[:8]]
        rows.append({"backend": b, "missing": len(cells), "invalid": len(aggregate["invalid_cells"].get(b, [])),
                     "missing cells": ", ".join(shown) + (f", … ({len(cells)})" if len(cells) > 8 else "")})
    return pd.DataFrame(rows).set_index("backend")


def candidates_table(aggregate: dict[str, Any]):
    import pandas as pd

    rows = [{"raw file": f["path"], "backend": f["backend"], "accepted": text(f["accepted"]),
             "binding": f.get("binding") or f.get("excluded_reason"),
             "completed": len(f.get("completed_cells", [])), "failed": ", ".join(f.get("failed_cells", [])) or "—",
             "superseded": len(f.get("superseded_cells", []))} for f in aggregate["raw_files"]]
    return pd.DataFrame(rows).set_index("raw file") if rows else pd.DataFrame()


def conformance_table(aggregate: dict[str, Any]):
    import pandas as pd

    rows = []
    for entry in aggregate["evidence_files"]:
        if "conformance" not in entry["kind"]:  # local, vllm, and the diagnostics beside them
            continue
        report = read_evidence(entry["path"])
        verdict = report.get("verdict", {})
        measured = report.get("bfloat16") or report.get("float32", {})
        tf = measured.get("teacher_forced", {})
        f32 = report.get("float32", {})
        options = report.get("candidate_options") or {}
        rows.append({"evidence": entry["path"], "kind": entry["kind"], "accepted": text(entry["accepted"]),
                     "candidate options": ", ".join(f"{k}={v}" for k, v in sorted(options.items())) or "as measured",
                     "passed": "PASS" if verdict.get("passed") else "FAIL",
                     "float32 greedy identical": _count_of(f32.get("greedy_free_running_identical"),
                                                           f32.get("greedy_free_running_requests"),
                                                           (report.get("float32_free_running") or {}).get("reason")),
                     "float32 partitions identical": _count_of(f32.get("partitions_identical"),
                                                               f32.get("partitions_requests"), "no float32 run"),
                     "bf16 free-running identical": _count_of(
                         verdict.get("bf16_free_running_identical", verdict.get("greedy_free_running_identical")),
                         verdict.get("bf16_free_running_requests", verdict.get("greedy_free_running_requests")),
                         "not in this evidence"),
                     "bf16 teacher-forced argmax agreement": text(tf.get("argmax_agreement_rate")),
                     "beyond tie margin": text(tf.get("disagreements_beyond_tie_margin")),
                     "max |d logprob| bf16": text(verdict.get("max_abs_logprob_diff")),
                     "max |d logprob| float32": text(f32.get("sampled_logprob", {}).get("max_abs_diff"))})
    return pd.DataFrame(rows).set_index("evidence") if rows else pd.DataFrame()


def _count_of(same: Any, total: Any, reason: str | None) -> str:
    """`3/16`, or a dash with the reason when the evidence has no such count (never `None/None`)."""
    if same is None or total is None:
        return f"— ({reason or 'not in this evidence'})"
    return f"{same}/{total}"


def read_evidence(path: str) -> Any:
    """An evidence file an aggregate names: a relative path is the project's (and must stay inside it),
    an absolute one is taken as named; either way a regular file, size-checked before it is read."""
    if Path(path).is_absolute():
        return read_json(path, kind="evidence")
    return read_json(project_root() / path, kind="evidence", root=project_root())


def refresh_reports(aggregate: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(aggregate entry, evidence report) of every policy-refresh evidence file of the campaign."""
    out = []
    for entry in aggregate["evidence_files"]:
        if entry["kind"] == "policy_refresh":
            out.append((entry, read_evidence(entry["path"])))
    return out


def refresh_table(aggregate: dict[str, Any]):
    """One row per policy-refresh evidence file: checks, sync time, memory after each version."""
    import pandas as pd

    rows = []
    for entry, report in refresh_reports(aggregate):
        syncs = [r["sync_s"] for r in report["rows"]]
        series = report.get("memory_series_bytes")
        failed = [name for name, ok in report["verdict"]["checks"].items() if not ok]
        rows.append({"evidence": entry["path"], "backend": report["backend"], "versions": report["versions"],
                     "passed": "PASS" if report["verdict"]["passed"] else "FAIL",
                     "failed checks": ", ".join(failed) or "none",
                     "sync s (min-max)": f"{min(syncs):.3f}-{max(syncs):.3f}" if syncs else "—",
                     "sync grows every version (diagnostic)": text(
                         not report.get("diagnostics", {}).get("sync_time_not_growing_monotonically", True)),
                     "memory after each refresh": ", ".join(f"{v / GIB:.2f}" for v in series) + " GiB" if series
                     else report.get("memory_status", "—"),
                     "teardown": _teardown_text(report.get("teardown_proof"))})
    return pd.DataFrame(rows).set_index("evidence") if rows else pd.DataFrame()


def _teardown_text(proof: Any) -> str:
    if not isinstance(proof, dict) or not proof:
        return "not applicable (no server process)"
    parts = []
    if "port_closed" in proof:
        parts.append("port closed" if proof["port_closed"] else "PORT STILL OPEN")
    if "leftover_processes" in proof:
        left = proof["leftover_processes"]
        parts.append("no process left" if not left else f"{len(left)} process(es) left")
    if "exit_code" in proof:
        parts.append(f"exit code {proof['exit_code']}")
    return ", ".join(parts) or text(proof)


def integrity_table(study: Preregistration, aggregate: dict[str, Any], aggregate_file: Path | None):
    import pandas as pd

    rows = [("preregistration", Path(study.source_path).name, study.sha256),
            ("calculator", study.calculator.path, aggregate["calculator_sha256"])]
    if aggregate_file is not None and aggregate_file.exists():
        rows.append(("aggregate", str(aggregate_file.relative_to(REPO_ROOT)) if aggregate_file.is_relative_to(REPO_ROOT)
                     else str(aggregate_file), sha256_file(aggregate_file)))
    rows += [("raw", f["path"], f["sha256"]) for f in aggregate["raw_files"]]
    rows += [("evidence", e["path"], e["sha256"]) for e in aggregate["evidence_files"]]
    return pd.DataFrame(rows, columns=["artifact", "path", "sha256"]).set_index("artifact")


def render(campaign: str, params: str, output_dir: Path, cycle_campaigns: str = "") -> Path:
    """Execute notebooks/summary.ipynb with papermill, render HTML with code hidden and images embedded.

    Atomic: papermill writes the executed notebook to a temp file in the report folder and the HTML is
    written to another; both are fsynced and renamed over the report only when everything succeeded. A
    failed render leaves the previous good report and no partial file."""
    import os

    import nbformat
    import papermill as pm
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor

    report_dir = output_dir / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    executed, html = report_dir / f"{campaign}.ipynb", report_dir / f"{campaign}.html"
    tmp_notebook = report_dir / f".{campaign}.tmp-{os.getpid()}.ipynb"
    tmp_html = report_dir / f".{campaign}.tmp-{os.getpid()}.html"
    from rollout_lib.core import notebook_kernel_options

    root = project_root()  # the notebook is the project's, found from the working directory, not the package
    parameters = {"campaign": campaign, "params": str(Path(params).resolve()),
                  "output_dir": str(Path(output_dir).resolve()), "cycle_campaigns": cycle_campaigns}
    try:
        with notebook_kernel_options() as kernel_options:
            pm.execute_notebook(str(root / "notebooks" / "summary.ipynb"), str(tmp_notebook), parameters=parameters,
                                cwd=str(root), progress_bar=False, kernel_name="python3", **kernel_options)
        nb = nbformat.read(str(tmp_notebook), as_version=4)
        exporter = HTMLExporter(exclude_input_prompt=True, exclude_output_prompt=True)
        hide = TagRemovePreprocessor(remove_input_tags={"hide-input"},
                                     remove_cell_tags={"remove-cell", "injected-parameters"})
        exporter.register_preprocessor(hide, enabled=True)
        body, _ = exporter.from_notebook_node(nb)
        page = offline_html(body, title=f"Rollout report — {campaign}")
        with open(tmp_html, "w", encoding="utf-8") as handle:
            handle.write(page)
            handle.flush()
            os.fsync(handle.fileno())
        with open(tmp_notebook, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp_notebook, executed)
        os.replace(tmp_html, html)
    finally:
        for leftover in (tmp_notebook, tmp_html):
            leftover.unlink(missing_ok=True)
    return html


def external_references(soup) -> list[str]:
    """Every URL the page would fetch: src/href attributes, CSS url(...), script imports."""
    import re

    found = []
    for tag in soup.find_all(True):
        for attribute in ("src", "href", "data"):
            value = tag.get(attribute)
            if isinstance(value, str) and re.match(r"\s*(https?:)?//", value):
                found.append(f"<{tag.name} {attribute}={value}>")
    for tag in soup.find_all(["script", "style"]):
        for match in re.findall(r"(?:url\(|import\s*\(?|from\s*)[\"']?\s*((?:https?:)?//[^\"')\s]+)", tag.get_text()):
            found.append(f"<{tag.name}> {match}")
    return found


def offline_html(body: str, title: str | None = None) -> str:
    """nbconvert's page loads require.js, MathJax and mermaid from a CDN; the report needs none of
    them (no widgets, no maths, no diagrams), so those tags go: the file opens fully offline."""
    import re

    from bs4 import BeautifulSoup, Comment

    soup = BeautifulSoup(body, "html.parser")
    for comment in soup.find_all(string=lambda s: isinstance(s, Comment)):  # "load mathjax" and the like
        comment.extract()
    for tag in soup.find_all(["script", "link"]):
        source = tag.get("src") or tag.get("href") or ""
        content = tag.get_text()
        if (re.match(r"\s*(https?:)?//", source) or tag.get("type") == "text/x-mathjax-config"
                or re.search(r"(https?:)?//cdn", content)):
            tag.decompose()
    for style in soup.find_all("style"):  # comments in the theme CSS cite URLs; drop the comments
        if style.string:
            style.string = re.sub(r"/\*.*?\*/", "", style.string, flags=re.S)
    if title and soup.title is not None:  # nbconvert names the page after the temp notebook file
        soup.title.string = title
    left = external_references(soup)
    if left:
        raise RuntimeError(f"the report still references external URLs: {left[:5]}")
    return str(soup)
