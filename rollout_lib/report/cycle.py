"""The report's "Full cycle" section: the cycle aggregate (frozen cycle calculator) as a table, a
stacked bar of the phases per run, and memory per phase against the budget and the gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout_lib.safe_read import read_json, read_text

PHASES = ("rollout", "teacher_scoring", "actor_scoring", "actor_update", "policy_sync")
COLOURS = {"rollout": "#2b6cb0", "teacher_scoring": "#805ad5", "actor_scoring": "#38a169",
           "actor_update": "#dd6b20", "policy_sync": "#e53e3e", "other": "#a0aec0"}


def load_cycle_aggregate(output_dir: Path, campaign: str) -> dict[str, Any] | None:
    path = Path(output_dir) / "cycles" / "aggregate" / f"{campaign}.json"
    return read_json(path, kind="aggregate", root=output_dir) if path.is_file() else None


def _gib(value: Any) -> str:
    return f"{value / 2**30:.2f}" if isinstance(value, (int, float)) else "—"


def _rate(value: Any) -> str:
    return f"{value:,.1f}" if isinstance(value, (int, float)) else "—"


def _gate_text(gate: dict[str, Any]) -> str:
    if gate["status"] in ("pass", "fail") and "peak_process_tree_bytes" in gate:
        return f"{gate['status'].upper()} ({_gib(gate['peak_process_tree_bytes'])} GiB)"
    reason = gate.get("reason", "no measurement")
    if reason.startswith("no NVML peak for phase(s)"):  # name the status, not every phase
        reason = f"no NVML peak per phase ({reason.rsplit('(', 1)[-1].rstrip(')')})"
    return f"{gate['status'].upper()}: {reason}"


def _raw_facts(output_dir: Path | None, raw_file: str) -> dict[str, str]:
    """From a run's raw file: the commit that measured it, how its trainer bounded memory (runs of one
    table may differ in both; lease 11's runs kept every activation), the engine options it was given
    beyond the preregistered setting (key `backend options`, only where a header records some), and the
    GPU memory of the trainer and of the engine at the rollout's end, the largest over its cycles (what
    the process-tree peak is made of: the vLLM engine is the server's process tree)."""
    if output_dir is None:
        return {"source commit": "—", "trainer memory": "—"}
    try:
        text = read_text(Path(output_dir) / raw_file, kind="cycle_raw", root=output_dir)
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        header = records[0]
    except (OSError, ValueError, IndexError):
        return {"source commit": "unreadable", "trainer memory": "unreadable"}
    source = (header.get("environment") or {}).get("source") or {}
    commit = source.get("source_commit")
    strategy = header.get("training_memory")
    if strategy is None:
        trainer = "every activation kept (before the memory strategy)"
    elif strategy.get("path") == "fused_mirror":  # the fast training path (issue 41)
        parts = ["fused mirror", f"{strategy.get('logprob_kernel')} head",
                 f"micro-batches <= {strategy.get('max_tokens_per_micro_batch'):,} tokens"]
        trainer = ", ".join((["checkpointed layers"] if strategy.get("gradient_checkpointing") else []) + parts)
    else:
        parts = (["checkpointed layers"] if strategy.get("gradient_checkpointing") else []) + [
            f"head chunks of {strategy.get('logprob_chunk_tokens')}"]
        trainer = ", ".join(parts)
    facts = {"source commit": (commit[:7] + ("+dirty" if source.get("source_dirty") else "")) if commit
             else source.get("status", "—"), "trainer memory": trainer,
             "trainer / engine GiB at rollout end": _process_split(records)}
    if header.get("backend_options"):
        facts["backend options"] = json.dumps(header["backend_options"], sort_keys=True)
    return facts


def memory_split(cycle: dict[str, Any], when: str) -> tuple[int, int] | None:
    """(trainer, engine) GPU bytes of one cycle record's `memory_by_process` snapshot `when`
    (`rollout_end` or `actor_update_end`): this process, and every other process of the tree (vLLM's API
    server and engine core); None where the snapshot was not measured (CPU runs, files before lease 12)."""
    snapshot = (cycle.get("memory_by_process") or {}).get(when) or {}
    if snapshot.get("status") != "measured":
        return None
    processes = snapshot.get("processes", [])
    return (sum(p["used_bytes"] for p in processes if p.get("role") == "this process"),
            sum(p["used_bytes"] for p in processes if p.get("role") != "this process"))


def largest_memory_split(records: list[dict[str, Any]], when: str) -> tuple[int, int] | None:
    """(trainer, engine) bytes, each the largest `memory_split(cycle, when)` over a run's cycle records;
    None where no cycle lists its processes."""
    splits = [s for s in (memory_split(r, when) for r in records if r.get("record") == "cycle") if s]
    return (max(s[0] for s in splits), max(s[1] for s in splits)) if splits else None


def _process_split(records: list[dict[str, Any]]) -> str:
    """`trainer / engine` GiB at the rollout's end (max over cycles); `—` where no cycle lists its
    processes (files before lease 12); the engine is `not_applicable` for an in-process backend."""
    split = largest_memory_split(records, "rollout_end")
    if split is None:
        return "—"
    trainer, engine = split
    return f"{_gib(trainer)} / {_gib(engine) if engine else 'not_applicable'}"


def runs_not_counted(aggregate: dict[str, Any]):
    """Raw files the calculator did not take, each with why: excluded (e.g. a run that died before
    its first cycle, with the failure its file records) or superseded by a newer run of its key."""
    import pandas as pd

    rows = [{"raw file": e["path"], "why": e["reason"]} for e in aggregate.get("excluded", [])]
    rows += [{"raw file": e["path"], "why": f"superseded by {e['by']}"} for e in aggregate.get("superseded", [])]
    return pd.DataFrame(rows, columns=["raw file", "why"]) if rows else None


def cycle_table(aggregate: dict[str, Any], output_dir: Path | None = None):
    """One row per run, every value formatted for a reader (units in the headers, no bare values);
    with `output_dir`, facts from each run's raw file (`_raw_facts`: its commit, its trainer's memory
    strategy, engine options if any, trainer and engine memory at the rollout's end)."""
    import pandas as pd

    from rollout_lib.report.summary import text

    rows = []
    for row in aggregate["rows"]:
        phases = {f"{name.replace('_', ' ')} s": (f"{row['phases'][name]['median_s']:.3f}"
                                                  if row["phases"][name]["status"] == "measured"
                                                  else row["phases"][name]["status"])
                  for name in PHASES}
        mismatch = row["mismatch"]
        sleep = row.get("engine_sleep") or {"status": "not_applicable"}
        complete = row["complete_cycle_median_s"]
        rows.append({"backend": row["backend"] + (f" ({row['vllm_memory_mode']})" if row.get("vllm_memory_mode")
                                                  else ""),
                     "algorithm": row["algorithm"], "cell": row["cell_id"],
                     "cycles": f"{row['cycles']}/{aggregate['cycles_required']}" + ("" if row["complete"] else
                                                                                   " (incomplete)"),
                     **phases, "complete cycle s": f"{complete:.3f}" if complete is not None else "—",
                     "rollout tok/s": _rate(row["rollout_tokens_per_s_median"]),
                     "full-cycle tok/s": _rate(row["full_cycle_tokens_per_s_median"]),
                     "memory gate (peak)": _gate_text(row["memory_gate"]),
                     "mean |d logprob|": text(mismatch.get("mean_abs_logprob_diff", mismatch["status"]), 3),
                     "max |d logprob|": text(mismatch.get("max_abs_logprob_diff", mismatch["status"]), 3),
                     "ratio min / max": _ratio(mismatch),
                     "sync exact": text(row["sync_exact"]),
                     "engine sleep / wake s": (f"{sleep['sleep_median_s']:.3f} / {sleep['wake_median_s']:.3f}"
                                               if sleep["status"] == "measured" else sleep["status"]),
                     "freed by sleep GiB": _gib(sleep.get("freed_median_bytes")),
                     **_raw_facts(output_dir, row["raw_file"])})
    if any("backend options" in r for r in rows):  # one column for all runs once any run had options
        for r in rows:
            r.setdefault("backend options", "none")
    return pd.DataFrame(rows)


def _ratio(mismatch: dict[str, Any]) -> str:
    if mismatch["status"] != "measured":
        return mismatch["status"]
    return f"{mismatch['importance_ratio_min']:.3f} / {mismatch['importance_ratio_max']:.3f}"


def row_label(row: dict[str, Any]) -> str:
    """One line per run: `vllm (sleep) · pg_k1 · p512-r512` (the cell's sampling and n are the study's)."""
    mode = f" ({row['vllm_memory_mode']})" if row.get("vllm_memory_mode") else ""
    return f"{row['backend']}{mode} · {row['algorithm']} · {row['cell_id'].rsplit('-', 2)[0]}"


def cycle_phase_figure(aggregate: dict[str, Any]):
    """One cycle campaign's phase breakdown (`cycle_phase_figure_by_campaign` with one panel)."""
    return cycle_phase_figure_by_campaign([(aggregate.get("campaign", ""), aggregate)])


def cycle_phase_figure_by_campaign(campaigns: list[tuple[str, dict[str, Any]]]):
    """One panel per cycle campaign, stacked top to bottom on one shared time axis (each panel as tall as its
    runs; side by side, four campaigns' labels left the bars no width): a horizontal stacked bar per run
    (rollout, teacher scoring, actor scoring, actor update, policy sync, and `other`: the complete cycle minus
    the phases, bookkeeping between them), the complete cycle's seconds at the end of each bar. None when no
    campaign has a complete run."""
    import matplotlib.pyplot as plt

    shown = [(n, [r for r in a["rows"] if r.get("complete_cycle_median_s") is not None]) for n, a in campaigns]
    shown = [(n, rows) for n, rows in shown if rows]
    if not shown:
        return None
    total_rows = sum(len(rows) for _, rows in shown)
    fig, axes = plt.subplots(len(shown), 1, figsize=(12.6, 0.27 * total_rows + 0.55 * len(shown) + 1.0),
                             sharex=True, squeeze=False, height_ratios=[len(rows) for _, rows in shown])
    longest = max(r["complete_cycle_median_s"] for _, rows in shown for r in rows)
    for ax, (name, rows) in zip(axes[:, 0], shown, strict=True):
        rows = sorted(rows, key=lambda r: (r["backend"], r.get("vllm_memory_mode") or "", r["algorithm"], r["cell_id"]))
        left = [0.0] * len(rows)
        for phase in PHASES:
            values = [r["phases"][phase].get("median_s", 0.0) if r["phases"][phase]["status"] == "measured" else 0.0
                      for r in rows]
            ax.barh(range(len(rows)), values, left=left, color=COLOURS[phase], label=phase.replace("_", " "))
            left = [a + b for a, b in zip(left, values, strict=True)]
        other = [max(0.0, r["complete_cycle_median_s"] - b) for r, b in zip(rows, left, strict=True)]
        ax.barh(range(len(rows)), other, left=left, color=COLOURS["other"], label="other")
        for i, r in enumerate(rows):
            ax.text(r["complete_cycle_median_s"] + longest * 0.005, i, f"{r['complete_cycle_median_s']:.2f} s",
                    va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [row_label(r) for r in rows], fontsize=8.5)
        ax.invert_yaxis()
        ax.set_title(f"cycle campaign {name}" if name else "one RL cycle, by phase", fontsize=10, loc="left")
    axes[-1][0].set_xlabel("seconds per cycle (median over cycles)")
    axes[-1][0].set_xlim(0, longest * 1.08)
    axes[0][0].legend(fontsize=8.5, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def cycle_memory_figure(aggregate: dict[str, Any]):
    """Peak process-tree GiB per phase (NVML), one group per run, against the budget and the gate."""
    import matplotlib.pyplot as plt

    rows = [r for r in aggregate["rows"] if any(m["status"] == "measured" for m in r["memory"].values())]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(12.6, 4.2))
    width = 0.8 / len(PHASES)
    for k, name in enumerate(PHASES):
        values = [r["memory"][name].get("peak_process_tree_bytes", 0) / 2**30 for r in rows]
        ax.bar([i + k * width for i in range(len(rows))], values, width, label=name.replace("_", " "),
               color=COLOURS[name])
    ax.axhline(aggregate["budget_bytes"] / 2**30, color="black", linestyle="--", linewidth=1, label="budget")
    ax.axhline(aggregate["gate_peak_total_bytes"] / 2**30, color="#e53e3e", linestyle=":", linewidth=1.5,
               label="gate")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [row_label(r) for r in rows], fontsize=8,
                  rotation=30, ha="right")
    ax.set_ylabel("peak GiB (process tree, NVML)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("memory per phase against the budget and the gate")
    fig.tight_layout()
    return fig
