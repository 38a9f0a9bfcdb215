"""FROZEN calculator: raw records -> aggregate (rates, medians, speedups, gates, selection).

Its SHA-256 is pinned in the preregistration (`calculator.sha256`); every code path that uses it
checks the hash first and refuses a calculator that differs. Pure: standard library only, no
clock, no randomness, no I/O, no imports from this project. Same inputs, same output, byte for byte.

Rules (the preregistration fixes thresholds; this file fixes arithmetic):
- A cell of a backend is taken from the raw file with the greatest run id that completed it
  (status `completed`); only when no file completed it, from the greatest run id that attempted
  it (a failed attempt, which makes the cell invalid). A later failed attempt never replaces an
  earlier completed one. Every other copy is listed as superseded, never dropped.
- Measured repetitions = non-warmup repetitions of that attempt. The cell is valid when exactly
  `measured_repetitions` measured repetitions exist and all are valid.
- Segments. A cell cut off mid-way (deadline, lost machine) keeps its measured repetitions; the
  attempt that completes it names the earlier attempts in `cell_start.continues` (run id, attempt,
  measured indices). The cell is assembled from the measured repetitions of every segment plus its
  own: each segment must be found in an accepted raw file of the same backend whose
  `measurement_identity_sha256` equals the completing file's (GPU model and driver, packages,
  models, preregistration measurement hash, measurement code), and the measured indices of all
  segments together must be 0..measured_repetitions-1, each exactly once. Otherwise the cell is
  invalid, with the reason named. Warmups of every segment are recorded and never counted. Peak
  memory of an assembled cell is the largest peak of its segments.
- Cell rate = median generated tokens / median wall_s of the measured repetitions (generated tokens
  are the actual counts; they are equal across repetitions when the outputs are deterministic).
- Spread = max wall_s / min wall_s, reported beside the median; it changes no gate.
- Speedup of a paired cell (same prompt, response, n, sampling) = candidate rate / baseline rate.
- Gates are conservative: every covered cell must be present, valid and pass; a missing or
  invalid cell fails the gate and is named. Missing evidence fails its gate.
- Peak total GPU memory = NVML peak of the backend's process tree over the cell; a cell without
  that measurement fails the memory gate (named with its status).
- Selection fails closed all the way. The local backend is `selection.fallback` (hf_cached) only when
  every gate it takes part in passes (its own gates, and its share of the gates that cover all
  backends: memory, policy refresh); otherwise the frozen oracle (hf_reference) stays the local
  backend. For each algorithm, `selection.candidate` (vllm) is selected when all its required gates
  pass (for gates over all backends: its own share), otherwise the selected local backend.
"""

from __future__ import annotations

import statistics
from typing import Any

CALCULATOR_VERSION = 3
ORACLE = "hf_reference"  # the frozen compatibility oracle: where selection falls back to in the end


def _cell_id(prompt: int, response: int, n: int, sampling: str) -> str:
    return f"p{prompt}-r{response}-n{n}-{sampling}"


def workload_cells(prereg: dict[str, Any]) -> list[dict[str, Any]]:
    work = prereg["workload"]
    return [{"cell_id": _cell_id(p, r, n, s["name"]), "prompt_tokens": p, "response_tokens": r,
             "samples_per_prompt": n, "sampling": s["name"]}
            for p in work["prompt_tokens"] for r in work["response_tokens"]
            for n in work["samples_per_prompt"] for s in work["samplings"]]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _phase(reps: list[dict[str, Any]], name: str) -> dict[str, Any]:
    statuses = {(r.get("phases") or {}).get(name, {}).get("status", "not_measured") for r in reps}
    if statuses == {"measured"}:
        return {"status": "measured", "median_s": _median([r["phases"][name]["seconds"] for r in reps])}
    if len(statuses) == 1:
        status = statuses.pop()
        reason = (reps[0].get("phases") or {}).get(name, {}).get("reason")
        return {"status": status, "reason": reason} if reason else {"status": status}
    return {"status": "mixed", "statuses": sorted(statuses)}


def _measured_index(rep: dict[str, Any], position: int) -> int:
    return rep.get("measured_index", position)


def _segment_peak(end: dict[str, Any] | None, reps: list[dict[str, Any]]) -> int | None:
    nvml = (end or {}).get("nvml_cell") or {}
    if nvml.get("peak_process_tree_bytes") is not None:
        return nvml["peak_process_tree_bytes"]
    windows = [(r.get("nvml_repetition") or {}).get("peak_process_tree_bytes") for r in reps]
    windows = [w for w in windows if w is not None]
    return max(windows) if windows else None


def _assemble(backend: str, cell_id: str, attempt: dict[str, Any], identity: str | None,
              index: dict[tuple[str, str, int, str], dict[str, Any]]) -> tuple[list, list, list, list]:
    """(measured repetitions, segments, problems, segment peaks) of a cell that continues others."""
    measured, segments, problems, peaks = [], [], [], []
    for ref in attempt["start"].get("continues", []):
        label = f"segment {ref['run_id']} attempt {ref['attempt']}"
        seg = index.get((backend, ref["run_id"], ref["attempt"], cell_id))
        if seg is None:
            problems.append(f"{label}: not found in an accepted raw file")
            continue
        if identity is None or seg["identity"] != identity:
            problems.append(f"{label}: measurement identity {seg['identity']} differs from {identity}")
        own = [r for r in seg["reps"] if not r["warmup"]]
        chosen = [dict(r, measured_index=_measured_index(r, position)) for position, r in enumerate(own)
                  if _measured_index(r, position) in ref["measured_indices"]]
        if len(chosen) != len(ref["measured_indices"]):
            problems.append(f"{label}: holds {len(chosen)} of the {len(ref['measured_indices'])} declared "
                            "measured repetitions")
        measured += chosen
        segments.append({"run_id": ref["run_id"], "attempt": ref["attempt"], "raw_file": seg["path"],
                         "measured_indices": list(ref["measured_indices"])})
        peaks.append(_segment_peak(seg["end"], seg["reps"]))
    return measured, segments, problems, peaks


def _cell_from_attempt(meta: dict[str, Any], reps: list[dict[str, Any]], complete: dict[str, Any],
                       expected_reps: int, earlier: tuple[list, list, list, list] | None = None) -> dict[str, Any]:
    own = [r for r in reps if not r["warmup"]]
    measured = own
    problems: list[str] = []
    if earlier is not None:
        measured = earlier[0] + [dict(r, measured_index=_measured_index(r, p)) for p, r in enumerate(own)]
        problems = list(earlier[2])
        indices = sorted(_measured_index(r, p) for p, r in enumerate(measured))
        if indices != list(range(expected_reps)):
            problems.append(f"measured indices {indices} are not 0..{expected_reps - 1} exactly once")
    invalid = [{"repetition": r["repetition"], "reasons": r["invalid_reasons"]} for r in measured if not r["valid"]]
    walls = [r["wall_s"] for r in measured if r.get("wall_s") is not None]
    tokens = [r["generated_tokens"] for r in measured if r.get("generated_tokens") is not None]
    valid = (complete["status"] == "completed" and len(measured) == expected_reps and not invalid
             and len(walls) == expected_reps and not problems)
    cell: dict[str, Any] = dict(meta)
    cell.update({"status": complete["status"], "valid": valid, "invalid_repetitions": invalid,
                 "measured_repetitions": len(measured), "wall_s": walls,
                 "warmup_wall_s": [r["wall_s"] for r in reps if r["warmup"] and r.get("wall_s") is not None]})
    if not valid:
        cell["invalid_reason"] = ("cell " + complete["status"] if complete["status"] != "completed" else
                                  "; ".join(problems) if problems else
                                  f"{len(measured)} measured repetitions, {len(invalid)} invalid")
    if earlier is not None:
        cell["segments"] = earlier[1]
    if walls and tokens:
        median_wall = _median(walls)
        generated = _median(tokens)
        cell.update({"generated_tokens": generated, "median_wall_s": median_wall,
                     "tokens_per_s": generated / median_wall, "spread_max_over_min": max(walls) / min(walls),
                     "prompt_tokens_total": measured[0].get("prompt_tokens_total")})
    torch_peaks = [r["memory"]["torch"].get("peak_reserved_bytes") for r in measured
                   if r.get("memory", {}).get("torch", {}).get("status") == "measured"]
    torch_alloc = [r["memory"]["torch"].get("peak_allocated_bytes") for r in measured
                   if r.get("memory", {}).get("torch", {}).get("status") == "measured"]
    nvml = dict(complete.get("nvml_cell") or {})
    if earlier is not None:  # an assembled cell: the largest peak of its segments
        peaks = [*earlier[3], _segment_peak(complete, reps)]
        if all(p is not None for p in peaks):
            nvml["peak_process_tree_bytes"] = max(peaks)
        else:
            nvml = {"status": "not_measured", "reason": "a segment has no NVML process-tree peak"}
    cell["memory"] = {
        "torch_peak_reserved_bytes": max(torch_peaks) if torch_peaks else None,
        "torch_peak_allocated_bytes": max(torch_alloc) if torch_alloc else None,
        "nvml_peak_process_tree_bytes": nvml.get("peak_process_tree_bytes"),
        "nvml_peak_device_used_bytes": nvml.get("peak_device_used_bytes"),
        "status": "measured" if nvml.get("peak_process_tree_bytes") is not None else
        (nvml.get("status") or "not_measured") + ("" if not nvml.get("reason") else f": {nvml['reason']}"),
    }
    cell["phases"] = {name: _phase(measured, name) for name in ("prefill_s", "decode_s", "ttft_s")} \
        if measured else {}
    return cell


def _segments_index(raw_files: list[dict[str, Any]]) -> dict[tuple[str, str, int, str], dict[str, Any]]:
    """(backend, run id, attempt, cell) -> reps, end record, file identity, path: every attempt of
    every accepted file, for assembling continued cells."""
    index = {}
    for raw in raw_files:
        if not raw["accepted"] or not raw["records"]:
            continue
        identity = raw["records"][0].get("measurement_identity_sha256")
        for record in raw["records"]:
            kind = record.get("record")
            if kind not in ("cell_start", "repetition", "cell_complete", "cell_suspended"):
                continue
            key = (raw["backend"], raw["run_id"], record["attempt"], record["cell_id"])
            entry = index.setdefault(key, {"reps": [], "end": None, "identity": identity, "path": raw["path"]})
            if kind == "repetition":
                entry["reps"].append(record)
            elif kind != "cell_start":
                entry["end"] = record
    return index


def _attempts(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """cell_id -> the last *completed-or-failed* attempt of this file: start, reps, complete."""
    starts, reps, completes = {}, {}, {}
    for record in records:
        kind = record.get("record")
        if kind == "cell_start":
            starts[(record["cell_id"], record["attempt"])] = record
        elif kind == "repetition":
            reps.setdefault((record["cell_id"], record["attempt"]), []).append(record)
        elif kind == "cell_complete":
            completes[record["cell_id"]] = (record["attempt"], record)
    out = {}
    for cell_id, (attempt, complete) in completes.items():
        out[cell_id] = {"start": starts.get((cell_id, attempt), {}), "reps": reps.get((cell_id, attempt), []),
                        "complete": complete, "attempt": attempt}
    return out


def aggregate_cells(prereg: dict[str, Any], raw_files: list[dict[str, Any]]) -> tuple[list, list]:
    """(cells, raw_file_summaries). raw_files: {path, sha256, backend, run_id, accepted, records}."""
    expected = prereg["protocol"]["measured_repetitions"]
    meta = {c["cell_id"]: c for c in workload_cells(prereg)}
    completed: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    failed: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    summaries = []
    for raw in sorted(raw_files, key=lambda f: (f["backend"], f["run_id"], f["path"])):
        summary = {k: raw[k] for k in ("path", "sha256", "backend", "run_id", "accepted")}
        if raw.get("binding"):
            summary["binding"] = raw["binding"]
        if not raw["accepted"]:
            summary["excluded_reason"] = raw.get("excluded_reason", "not accepted")
            summaries.append(summary)
            continue
        attempts = _attempts(raw["records"])
        summary["completed_cells"] = sorted(c for c, a in attempts.items() if a["complete"]["status"] == "completed")
        summary["failed_cells"] = sorted(c for c, a in attempts.items() if a["complete"]["status"] != "completed")
        summaries.append(summary)
        for cell_id, attempt in attempts.items():
            if cell_id in meta:  # files come in run-id order: a later one of the same kind wins
                target = completed if attempt["complete"]["status"] == "completed" else failed
                target[(raw["backend"], cell_id)] = (raw["path"], attempt)
    chosen = dict(failed) | completed  # a completed attempt anywhere beats every failed one
    index = _segments_index(raw_files)
    identities = {raw["path"]: raw["records"][0].get("measurement_identity_sha256")
                  for raw in raw_files if raw["accepted"] and raw["records"]}
    cells = []
    for (backend, cell_id), (path, attempt) in sorted(chosen.items()):
        earlier = (_assemble(backend, cell_id, attempt, identities.get(path), index)
                   if attempt["start"].get("continues") else None)
        cell = _cell_from_attempt(meta[cell_id], attempt["reps"], attempt["complete"], expected, earlier)
        cell.update({"backend": backend, "raw_file": path, "attempt": attempt["attempt"]})
        cells.append(cell)
    for summary in summaries:
        used = {c["cell_id"] for c in cells if c["raw_file"] == summary["path"]}
        if summary["accepted"]:
            listed = set(summary["completed_cells"]) | set(summary["failed_cells"])
            summary["superseded_cells"] = sorted(listed - used)
    return cells, summaries


def _index(cells: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["backend"], c["cell_id"]): c for c in cells}


def speedups(prereg: dict[str, Any], cells: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> list[dict]:
    index = _index(cells)
    out = []
    for candidate, baseline in pairs:
        for meta in workload_cells(prereg):
            cand, base = index.get((candidate, meta["cell_id"])), index.get((baseline, meta["cell_id"]))
            if not cand or not base or "tokens_per_s" not in cand or "tokens_per_s" not in base:
                continue
            out.append({"candidate": candidate, "baseline": baseline, "cell_id": meta["cell_id"],
                        "response_tokens": meta["response_tokens"],
                        "ratio": cand["tokens_per_s"] / base["tokens_per_s"],
                        "both_valid": cand["valid"] and base["valid"],
                        "candidate_spread": cand["spread_max_over_min"],
                        "baseline_spread": base["spread_max_over_min"]})
    return out


def _compare(value: float, comparison: str, threshold: float) -> bool:
    return {">=": value >= threshold, "<": value < threshold, "<=": value <= threshold}[comparison]


def _speedup_gate(gate: dict[str, Any], prereg: dict[str, Any], index: dict) -> dict[str, Any]:
    failing, ratios = [], []
    for meta in workload_cells(prereg):
        if meta["response_tokens"] not in gate["response_tokens"]:
            continue
        cell_id = meta["cell_id"]
        for backend in (gate["candidate"], gate["baseline"]):
            cell = index.get((backend, cell_id))
            if cell is None:
                failing.append({"cell_id": cell_id, "reason": f"{backend}: missing"})
            elif not cell["valid"]:
                failing.append({"cell_id": cell_id, "reason": f"{backend}: invalid ({cell.get('invalid_reason')})"})
        cand, base = index.get((gate["candidate"], cell_id)), index.get((gate["baseline"], cell_id))
        if cand and base and cand["valid"] and base["valid"]:
            ratio = cand["tokens_per_s"] / base["tokens_per_s"]
            ratios.append(ratio)
            if not _compare(ratio, gate["comparison"], gate["threshold"]):
                failing.append({"cell_id": cell_id, "reason": f"ratio {ratio:.4f} not {gate['comparison']} "
                                                              f"{gate['threshold']}"})
    return {"observed_min": min(ratios) if ratios else None, "observed_max": max(ratios) if ratios else None,
            "failing_cells": failing, "passed": bool(ratios) and not failing, "paired_cells": len(ratios)}


def _memory_gate(gate: dict[str, Any], prereg: dict[str, Any], index: dict, backends: list[str]) -> dict[str, Any]:
    failing, peaks = [], []
    targets = backends if gate["candidate"] == "all" else [gate["candidate"]]
    for backend in targets:
        for meta in workload_cells(prereg):
            if meta["response_tokens"] not in gate["response_tokens"]:
                continue
            cell = index.get((backend, meta["cell_id"]))
            if cell is None:
                failing.append({"cell_id": meta["cell_id"], "backend": backend, "reason": "missing"})
                continue
            peak = cell["memory"]["nvml_peak_process_tree_bytes"]
            if peak is None:
                failing.append({"cell_id": meta["cell_id"], "backend": backend,
                                "reason": f"peak total GPU memory {cell['memory']['status']}"})
                continue
            peaks.append(peak)
            if not _compare(peak, gate["comparison"], gate["threshold"]):
                failing.append({"cell_id": meta["cell_id"], "backend": backend, "reason": f"{peak} bytes"})
    per_backend = {b: not any(f["backend"] == b for f in failing) and any(
        (b, m["cell_id"]) in index for m in workload_cells(prereg) if m["response_tokens"] in gate["response_tokens"])
        for b in targets}
    return {"observed_min": min(peaks) if peaks else None, "observed_max": max(peaks) if peaks else None,
            "failing_cells": failing, "passed": bool(peaks) and not failing, "backends": targets,
            "per_backend_passed": per_backend}


EVIDENCE_KINDS = {("conformance", "hf_cached"): "local_conformance", ("conformance", "vllm"): "vllm_conformance"}
REFRESH_BACKENDS = ("hf_cached", "vllm")  # the backends that serve a policy which changes every step


def _verdict_failures(entry: dict[str, Any], gate: dict[str, Any], label: str) -> list[dict[str, Any]]:
    verdict = entry["verdict"]
    failing = [{"cell_id": None, "reason": f"{label}check {name} failed"}
               for name, ok in sorted(verdict.get("checks", {}).items()) if not ok]
    observed = verdict.get("max_abs_logprob_diff")
    if observed is not None and not _compare(observed, gate["comparison"], gate["threshold"]):
        failing.append({"cell_id": None, "reason": f"{label}max |d logprob| {observed:.6f} > {gate['threshold']}"})
    if not failing and not verdict.get("passed"):
        failing.append({"cell_id": None, "reason": f"{label}verdict not passed"})
    return failing


def _evidence_gate(gate: dict[str, Any], evidence: list[dict[str, Any]]) -> dict[str, Any]:
    """Conformance and policy-refresh gates read the verdict of their latest accepted evidence file
    (per backend for policy refresh: every backend in REFRESH_BACKENDS needs its own)."""
    accepted = sorted((e for e in evidence if e["accepted"]), key=lambda e: e["path"])
    if gate["kind"] == "policy_refresh":
        wanted = [("policy_refresh", b) for b in (REFRESH_BACKENDS if gate["candidate"] == "all" else
                                                  (gate["candidate"],))]
    else:
        wanted = [(EVIDENCE_KINDS.get((gate["kind"], gate["candidate"]), f"{gate['kind']}:{gate['candidate']}"),
                   None)]
    failing, used, observed, per_backend = [], [], [], {}
    for kind, backend in wanted:
        label = f"{backend}: " if backend else ""
        relevant = [e for e in accepted if e["kind"] == kind and (backend is None or e.get("backend") == backend)]
        if not relevant:
            failing.append({"cell_id": None, "reason": f"{label}no accepted {kind} evidence"})
            if backend:
                per_backend[backend] = False
            continue
        latest = relevant[-1]
        used.append(latest["path"])
        these = _verdict_failures(latest, gate, label)
        failing += these
        if backend:
            per_backend[backend] = not these
        if latest["verdict"].get("max_abs_logprob_diff") is not None:
            observed.append(latest["verdict"]["max_abs_logprob_diff"])
    outcome = {"observed_min": min(observed) if observed else None,
               "observed_max": max(observed) if observed else None,
               "failing_cells": failing, "passed": not failing, "used_evidence": used}
    if per_backend:
        outcome["per_backend_passed"] = per_backend
    return outcome


def _requirement_passed(gate: dict[str, Any], backend: str) -> bool:
    """A gate as a requirement of `backend`: gates over all backends count with the backend's share."""
    if gate["candidate"] == "all":
        return bool(gate.get("per_backend_passed", {}).get(backend, False))
    return bool(gate["passed"])


def select_backends(prereg: dict[str, Any], gates: list[dict[str, Any]]) -> dict[str, Any]:
    """Fail-closed selection: local backend first, then per algorithm (see the module docstring)."""
    spec = prereg["selection"]
    by_id = {g["id"]: g for g in gates}
    local_candidate = spec["fallback"]
    local_required = [g["id"] for g in gates if g["candidate"] in (local_candidate, "all")]
    local_failed = [g for g in local_required if not _requirement_passed(by_id[g], local_candidate)]
    local = local_candidate if not local_failed else ORACLE
    out: dict[str, Any] = {"local": {"backend": local, "candidate": local_candidate, "requires": local_required,
                                     "failed_requirements": local_failed, "candidate_qualified": not local_failed,
                                     "decided_by": (f"every gate of {local_candidate} passed" if not local_failed
                                                    else f"failed: {', '.join(local_failed)} -> oracle {ORACLE}")}}
    for algorithm, key in (("direct_gkd", "direct_gkd_requires"), ("pg_k1", "pg_k1_requires")):
        required = list(spec[key])
        failed = [g for g in required if g not in by_id or not _requirement_passed(by_id[g], spec["candidate"])]
        backend = spec["candidate"] if not failed else local
        out[algorithm] = {"backend": backend, "candidate": spec["candidate"], "requires": required,
                          "failed_requirements": failed, "candidate_qualified": not failed,
                          "decided_by": (f"every required gate of {spec['candidate']} passed" if not failed else
                                         f"failed: {', '.join(failed)} -> local backend {local}")}
    return out


def compute_aggregate(prereg: dict[str, Any], *, campaign: str, preregistration_sha256: str,
                      calculator_sha256: str, raw_files: list[dict[str, Any]],
                      evidence: list[dict[str, Any]]) -> dict[str, Any]:
    """The aggregate of a campaign. Inputs are plain data (publish.py reads and hashes the files)."""
    cells, raw_summaries = aggregate_cells(prereg, raw_files)
    index = _index(cells)
    backends = sorted({"hf_reference", "hf_cached", "vllm"})
    pairs = [("hf_cached", "hf_reference"), ("vllm", "hf_cached")]
    gates = []
    for gate in prereg["gates"]:
        if gate["kind"] == "speedup":
            outcome = _speedup_gate(gate, prereg, index)
        elif gate["kind"] == "peak_memory":
            outcome = _memory_gate(gate, prereg, index, backends)
        else:
            outcome = _evidence_gate(gate, evidence)
        gates.append({"id": gate["id"], "kind": gate["kind"], "description": gate["description"],
                      "candidate": gate["candidate"], "baseline": gate["baseline"], "comparison": gate["comparison"],
                      "threshold": gate["threshold"], "unit": gate["unit"],
                      "response_tokens": list(gate["response_tokens"]), **outcome})
    selection = select_backends(prereg, gates)
    all_ids = [c["cell_id"] for c in workload_cells(prereg)]
    missing = {b: [c for c in all_ids if (b, c) not in index] for b in backends}
    invalid = {b: [c for c in all_ids if (b, c) in index and not index[(b, c)]["valid"]] for b in backends}
    return {"calculator_version": CALCULATOR_VERSION, "campaign": campaign,
            "preregistered": prereg["preregistered"], "study_id": prereg["study_id"],
            "preregistration_sha256": preregistration_sha256, "calculator_sha256": calculator_sha256,
            "raw_files": raw_summaries,
            "evidence_files": [{k: e[k] for k in ("path", "sha256", "kind", "accepted")} for e in evidence],
            "cells": cells, "speedups": speedups(prereg, cells, pairs), "gates": gates,
            "selection": selection, "missing_cells": missing, "invalid_cells": invalid}
