"""FROZEN cycle calculator: cycle raw records -> cycle aggregate (phases, complete cycle, memory, mismatch).

Its SHA-256 is pinned in the cycle preregistration (`calculator.sha256`); every use checks the hash
first and refuses a calculator that differs. Pure: standard library only, no clock, no randomness,
no I/O, no imports from this project. Same inputs, same output, byte for byte.

(The cycle section lives in its own frozen file, pinned by the cycle study, rather than inside
`calculator.py`: that file is pinned by the rollout preregistration, whose hash the cycle study in
turn pins, and changing it mid-campaign would re-bind every rollout aggregate for no rollout reason.)

Rules:
- A run is one raw file: (backend, algorithm, cell). It is complete when it holds exactly `cycles`
  cycle records (indices 0..cycles-1) and a teardown record. Of several runs of one key, the
  complete run with the greatest run id is taken; without one, the greatest run id (incomplete).
  Every other run is listed as superseded, never dropped.
- Per phase (rollout, teacher_scoring, actor_scoring, actor_update, policy_sync): the median
  seconds over the run's cycles, and cycle 0 on its own (the first cycle after cold start). A phase
  that is not `measured` in any cycle carries that status instead of a number.
- Complete cycle = median of the measured span from rollout start to sync end (never a sum).
  Rollout tokens/s and full-cycle tokens/s are medians of the per-cycle values, reported side by side.
- Memory per phase = the largest NVML process-tree peak over the cycles (torch reserved beside it);
  the run's peak is the largest over phases. Memory gate: peak < gate_peak_total_bytes; a run
  without NVML peaks fails the gate with its status named.
- Mismatch: mean of the per-cycle mean |d logprob|, max of the max; importance-ratio min / max over
  cycles, mean of the means. Sync exact = every cycle served the identity it trained.
- vLLM runs are keyed by their memory mode too (`sleep`: the engine sleeps while the trainer works;
  `small_kv`: awake with a smaller KV cache). Engine sleep: medians over cycles of the sleep seconds,
  the device memory freed by the sleep and the wake seconds; `not_applicable` for other runs.
- Missing = every (backend [x memory mode for vllm], algorithm, cell) of the study without a complete run.
"""

from __future__ import annotations

import statistics
from typing import Any

CYCLE_CALCULATOR_VERSION = 1
PHASES = ("rollout", "teacher_scoring", "actor_scoring", "actor_update", "policy_sync")


def _run_key(header: dict[str, Any]) -> tuple[str, str, str, str]:
    return header["backend"], header.get("vllm_memory_mode") or "", header["algorithm"], header["cell_id"]


def _complete(records: list[dict[str, Any]], cycles: int) -> bool:
    indices = sorted(r["cycle"] for r in records if r.get("record") == "cycle")
    return indices == list(range(cycles)) and any(r.get("record") == "teardown" for r in records)


def _phase_row(cycles: list[dict[str, Any]], name: str) -> dict[str, Any]:
    values = [c["phases"][name]["seconds"] for c in cycles
              if c.get("phases", {}).get(name, {}).get("status") == "measured"]
    if not values:
        statuses = sorted({c.get("phases", {}).get(name, {}).get("status", "absent") for c in cycles})
        return {"status": statuses[0] if statuses else "absent"}
    first = cycles[0].get("phases", {}).get(name, {})
    return {"status": "measured", "median_s": statistics.median(values), "cycles": len(values),
            "cycle_0_s": first.get("seconds") if first.get("status") == "measured" else None}


def _memory_row(cycles: list[dict[str, Any]], name: str) -> dict[str, Any]:
    peaks, reserved, statuses = [], [], set()
    for cycle in cycles:
        entry = cycle.get("memory", {}).get(name, {})
        statuses.add(entry.get("status", "absent"))
        nvml = entry.get("nvml") or {}
        if "peak_process_tree_bytes" in nvml:
            peaks.append(nvml["peak_process_tree_bytes"])
        if "torch_peak_reserved_bytes" in entry:
            reserved.append(entry["torch_peak_reserved_bytes"])
    if not peaks:
        return {"status": "not_measured" if "measured" in statuses else sorted(statuses)[0],
                "torch_peak_reserved_bytes": max(reserved) if reserved else None}
    return {"status": "measured", "peak_process_tree_bytes": max(peaks),
            "torch_peak_reserved_bytes": max(reserved) if reserved else None}


def _median_of(cycles: list[dict[str, Any]], key: str) -> float | None:
    values = [c[key] for c in cycles if isinstance(c.get(key), (int, float))]
    return statistics.median(values) if values else None


def _mismatch(cycles: list[dict[str, Any]]) -> dict[str, Any]:
    measured = [c["mismatch"] for c in cycles if (c.get("mismatch") or {}).get("status") == "measured"]
    if not measured:
        return {"status": "not_measured"}
    return {"status": "measured",
            "mean_abs_logprob_diff": statistics.fmean(m["mean_abs_logprob_diff"] for m in measured),
            "max_abs_logprob_diff": max(m["max_abs_logprob_diff"] for m in measured),
            "importance_ratio_min": min(m["importance_ratio_min"] for m in measured),
            "importance_ratio_mean": statistics.fmean(m["importance_ratio_mean"] for m in measured),
            "importance_ratio_max": max(m["importance_ratio_max"] for m in measured)}


def _engine_sleep(cycles: list[dict[str, Any]]) -> dict[str, Any]:
    entries = [c["engine_sleep"] for c in cycles if "sleep_s" in (c.get("engine_sleep") or {})]
    if not entries:
        return {"status": "not_applicable"}

    def median(key: str) -> float | None:
        values = [e[key] for e in entries if isinstance(e.get(key), (int, float))]
        return statistics.median(values) if values else None

    return {"status": "measured", "sleep_median_s": median("sleep_s"), "wake_median_s": median("wake_s"),
            "freed_median_bytes": median("freed_bytes"), "cycles": len(entries)}


def _row(entry: dict[str, Any], cycles_required: int, gate_bytes: int) -> dict[str, Any]:
    records = entry["records"]
    header = records[0]
    cycles = sorted((r for r in records if r.get("record") == "cycle"), key=lambda r: r["cycle"])
    memory = {name: _memory_row(cycles, name) for name in PHASES}
    peaks = [m["peak_process_tree_bytes"] for m in memory.values() if m["status"] == "measured"]
    if len(peaks) == len(PHASES):
        gate = {"status": "pass" if max(peaks) < gate_bytes else "fail", "peak_process_tree_bytes": max(peaks)}
    else:
        missing = sorted(name for name, m in memory.items() if m["status"] != "measured")
        gate = {"status": "fail", "reason": f"no NVML peak for phase(s) {', '.join(missing)} "
                                            f"({memory[missing[0]]['status']})"}
    return {"backend": header["backend"], "vllm_memory_mode": header.get("vllm_memory_mode"),
            "algorithm": header["algorithm"], "cell_id": header["cell_id"], "engine_sleep": _engine_sleep(cycles),
            "raw_file": entry["path"], "raw_sha256": entry["sha256"], "run_id": header.get("run_id"),
            "complete": _complete(records, cycles_required), "cycles": len(cycles),
            "phases": {name: _phase_row(cycles, name) for name in PHASES},
            "complete_cycle_median_s": _median_of(cycles, "complete_cycle_s"),
            "rollout_tokens_per_s_median": _median_of(cycles, "rollout_tokens_per_s"),
            "full_cycle_tokens_per_s_median": _median_of(cycles, "full_cycle_tokens_per_s"),
            "memory": memory, "memory_gate": gate, "mismatch": _mismatch(cycles),
            "sync_exact": bool(cycles) and all(c.get("sync_exact") for c in cycles),
            "losses": [c.get("loss") for c in cycles], "grad_norms": [c.get("grad_norm") for c in cycles]}


def compute_cycle_aggregate(study: dict[str, Any], *, campaign: str, cycle_study_sha256: str,
                            calculator_sha256: str, raw_files: list[dict[str, Any]]) -> dict[str, Any]:
    """`raw_files`: {path, sha256, records, accepted} per raw file (seals verified by the caller)."""
    cycles_required = study["cycles"]
    gate_bytes = study["memory"]["gate_peak_total_bytes"]
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    excluded = []
    for entry in raw_files:
        if not entry.get("accepted"):
            excluded.append({"path": entry["path"], "reason": entry.get("excluded_reason", "not accepted")})
            continue
        runs.setdefault(_run_key(entry["records"][0]), []).append(entry)
    rows, superseded = [], []
    for key in sorted(runs):
        ordered = sorted(runs[key], key=lambda e: e["records"][0].get("run_id", ""))
        complete = [e for e in ordered if _complete(e["records"], cycles_required)]
        chosen = (complete or ordered)[-1]
        superseded += [{"path": e["path"], "by": chosen["path"]} for e in ordered if e is not chosen]
        rows.append(_row(chosen, cycles_required, gate_bytes))
    done = {(r["backend"], r["vllm_memory_mode"] or "", r["algorithm"], r["cell_id"]) for r in rows if r["complete"]}
    algorithms = sorted(study["algorithms"])
    variants = [(b, m) for b in study["backends"] for m in (study["memory"]["vllm_modes"] if b == "vllm" else [""])]
    missing = [{"backend": b, "vllm_memory_mode": m or None, "algorithm": a, "cell_id": c} for b, m in variants
               for a in algorithms for c in study["cells"] if (b, m, a, c) not in done]
    return {"kind": "cycle_aggregate", "campaign": campaign, "cycle_study_sha256": cycle_study_sha256,
            "calculator_sha256": calculator_sha256, "cycle_calculator_version": CYCLE_CALCULATOR_VERSION,
            "cycles_required": cycles_required, "gate_peak_total_bytes": gate_bytes,
            "budget_bytes": study["memory"]["budget_bytes"], "rows": rows, "missing": missing,
            "superseded": superseded, "excluded": excluded}
