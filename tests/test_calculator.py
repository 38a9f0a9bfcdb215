"""The frozen calculator on hand-built raw records with known answers."""

from __future__ import annotations

import copy

import pytest
import yaml

from rollout_lib.calculator import compute_aggregate

from .conftest import PREREG

PREREG_DICT = yaml.safe_load(PREREG.read_text())
GIB = 2**30


def _reps(cell_id, walls, tokens, valid=None, warmup_wall=9.0):
    valid = valid or [True] * len(walls)
    out = [{"record": "repetition", "cell_id": cell_id, "attempt": 0, "repetition": 0, "warmup": True,
            "valid": True, "invalid_reasons": [], "wall_s": warmup_wall, "generated_tokens": tokens,
            "phases": None, "memory": {"torch": {"status": "not_applicable"}}}]
    for i, (wall, ok) in enumerate(zip(walls, valid, strict=True), start=1):
        out.append({"record": "repetition", "cell_id": cell_id, "attempt": 0, "repetition": i, "warmup": False,
                    "valid": ok, "invalid_reasons": [] if ok else [{"rule": "INV-TIME", "detail": "x"}],
                    "wall_s": wall, "generated_tokens": tokens, "prompt_tokens_total": 512,
                    "phases": {"prefill_s": {"status": "measured", "seconds": 0.1 * i},
                               "decode_s": {"status": "measured", "seconds": wall - 0.1},
                               "ttft_s": {"status": "not_measured", "reason": "r"}},
                    "memory": {"torch": {"status": "measured", "peak_reserved_bytes": 2 * GIB,
                                         "peak_allocated_bytes": GIB}}})
    return out


def raw_file(backend, run_id, cells, peak=4 * GIB):
    records = [{"record": "header", "backend": backend, "run_id": run_id}]
    for cell_id, spec in cells.items():
        records.append({"record": "cell_start", "cell_id": cell_id, "attempt": 0})
        records += _reps(cell_id, *spec)
        records.append({"record": "cell_complete", "cell_id": cell_id, "attempt": 0, "status": "completed",
                        "nvml_cell": {"status": "measured", "peak_process_tree_bytes": peak}})
    return {"path": f"outputs/raw/t/{backend}/{run_id}.jsonl", "sha256": "0" * 64, "backend": backend,
            "run_id": run_id, "accepted": True, "binding": "pinned", "records": records}


def gate_cells(prereg=PREREG_DICT, responses=(256, 512)):
    return [f"p{p}-r{r}-n{n}-{s['name']}" for p in prereg["workload"]["prompt_tokens"] for r in responses
            for n in prereg["workload"]["samples_per_prompt"] for s in prereg["workload"]["samplings"]]


def all_cells(rate_walls, tokens=1000, responses=(64, 256, 512)):
    return {c: (rate_walls, tokens) for c in gate_cells(responses=responses)}


def evidence(kind, passed, max_diff):
    return {"path": f"outputs/conformance/{kind}.json", "sha256": "1" * 64, "kind": kind, "accepted": True,
            "verdict": {"passed": passed, "checks": {"x": passed}, "max_abs_logprob_diff": max_diff}}


def run(raws, ev=()):
    return compute_aggregate(PREREG_DICT, campaign="t", preregistration_sha256="p" * 64, calculator_sha256="c" * 64,
                             raw_files=raws, evidence=list(ev))


def gate(agg, gate_id):
    return next(g for g in agg["gates"] if g["id"] == gate_id)


def test_median_of_three_rate_and_spread():
    agg = run([raw_file("hf_cached", "r1", {"p128-r64-n1-greedy": ([3.0, 1.0, 2.0], 100)})])
    cell = agg["cells"][0]
    assert cell["median_wall_s"] == 2.0 and cell["tokens_per_s"] == 50.0
    assert cell["spread_max_over_min"] == 3.0 and cell["wall_s"] == [3.0, 1.0, 2.0]
    assert cell["warmup_wall_s"] == [9.0] and cell["valid"]
    assert cell["phases"]["prefill_s"] == {"status": "measured", "median_s": pytest.approx(0.2)}
    assert cell["phases"]["ttft_s"] == {"status": "not_measured", "reason": "r"}
    assert cell["memory"]["nvml_peak_process_tree_bytes"] == 4 * GIB


def test_speedup_gate_passes_and_names_a_failing_cell():
    base = raw_file("hf_reference", "r1", all_cells([10.0, 10.0, 10.0]))
    fast = all_cells([4.0, 4.0, 4.0])
    fast["p512-r512-n4-stochastic"] = ([6.0, 6.0, 6.0], 1000)  # 1.67x: below 2x
    agg = run([base, raw_file("hf_cached", "r1", fast)])
    g = gate(agg, "hf_cached_speedup")
    assert not g["passed"] and g["paired_cells"] == 16
    assert [f["cell_id"] for f in g["failing_cells"]] == ["p512-r512-n4-stochastic"]
    assert g["observed_min"] == pytest.approx(10 / 6) and g["observed_max"] == pytest.approx(2.5)
    agg_ok = run([base, raw_file("hf_cached", "r1", all_cells([4.0, 4.0, 4.0]))])
    assert gate(agg_ok, "hf_cached_speedup")["passed"]


def test_missing_cell_fails_the_gate_and_is_named():
    fast = all_cells([4.0, 4.0, 4.0])
    del fast["p128-r256-n1-greedy"]
    agg = run([raw_file("hf_reference", "r1", all_cells([10.0, 10.0, 10.0])), raw_file("hf_cached", "r1", fast)])
    g = gate(agg, "hf_cached_speedup")
    assert not g["passed"]
    assert {"cell_id": "p128-r256-n1-greedy", "reason": "hf_cached: missing"} in g["failing_cells"]
    assert "p128-r256-n1-greedy" in agg["missing_cells"]["hf_cached"]


def test_invalid_repetition_invalidates_the_cell():
    fast = all_cells([4.0, 4.0, 4.0])
    fast["p128-r512-n4-greedy"] = ([4.0, 4.0, 4.0], 1000, [True, False, True])
    agg = run([raw_file("hf_reference", "r1", all_cells([10.0, 10.0, 10.0])), raw_file("hf_cached", "r1", fast)])
    g = gate(agg, "hf_cached_speedup")
    assert not g["passed"]
    assert g["failing_cells"][0]["cell_id"] == "p128-r512-n4-greedy"
    assert "invalid" in g["failing_cells"][0]["reason"]
    assert agg["invalid_cells"]["hf_cached"] == ["p128-r512-n4-greedy"]


def test_memory_gate_and_selection_fail_closed():
    cells = all_cells([1.0, 1.0, 1.0])
    raws = [raw_file("hf_reference", "r1", all_cells([10.0, 10.0, 10.0])),
            raw_file("hf_cached", "r1", all_cells([4.0, 4.0, 4.0])),
            raw_file("vllm", "r1", cells, peak=12 * GIB)]
    refresh = [{"path": f"outputs/conformance/refresh-{b}.json", "sha256": "2" * 64, "kind": "policy_refresh",
                "backend": b, "accepted": True, "verdict": {"passed": True, "checks": {"unique": True}}}
               for b in ("hf_cached", "vllm")]
    agg = run(raws, [*refresh, evidence("local_conformance", True, 0.002), evidence("vllm_conformance", False, 0.0196)])
    assert gate(agg, "peak_memory")["passed"] and gate(agg, "peak_memory")["observed_max"] == 12 * GIB
    assert gate(agg, "vllm_speedup")["passed"] and gate(agg, "policy_refresh")["passed"]
    assert not gate(agg, "vllm_pgk1_conformance")["passed"]
    assert agg["selection"]["direct_gkd"]["backend"] == "vllm"
    assert agg["selection"]["local"]["backend"] == "hf_cached" and agg["selection"]["local"]["candidate_qualified"]
    pg = agg["selection"]["pg_k1"]
    assert (pg["backend"], pg["candidate_qualified"], pg["failed_requirements"], pg["requires"]) == (
        "hf_cached", False, ["vllm_pgk1_conformance"], PREREG_DICT["selection"]["pg_k1_requires"])
    assert pg["decided_by"] == "failed: vllm_pgk1_conformance -> local backend hf_cached"
    over = copy.deepcopy(raws)
    over[2] = raw_file("vllm", "r1", cells, peak=15 * GIB)
    agg_over = run(over, [*refresh, evidence("local_conformance", True, 0.002)])
    only_vllm = run(raws, refresh[1:])
    assert gate(only_vllm, "policy_refresh")["failing_cells"] == [
        {"cell_id": None, "reason": "hf_cached: no accepted policy_refresh evidence"}]
    assert not gate(agg_over, "peak_memory")["passed"]
    assert agg_over["selection"]["direct_gkd"]["backend"] == "hf_cached"


def test_missing_evidence_fails_and_later_run_supersedes():
    a = raw_file("hf_cached", "a", {"p128-r64-n1-greedy": ([2.0, 2.0, 2.0], 100)})
    b = raw_file("hf_cached", "b", {"p128-r64-n1-greedy": ([1.0, 1.0, 1.0], 100)})
    agg = run([b, a])
    assert [c["tokens_per_s"] for c in agg["cells"]] == [100.0]
    assert agg["cells"][0]["raw_file"].endswith("/b.jsonl")
    superseded = {f["run_id"]: f["superseded_cells"] for f in agg["raw_files"]}
    assert superseded == {"a": ["p128-r64-n1-greedy"], "b": []}
    assert not gate(agg, "local_conformance")["passed"]
    assert gate(agg, "local_conformance")["failing_cells"][0]["reason"] == "no accepted local_conformance evidence"


def test_excluded_raw_file_is_listed_not_used():
    bad = raw_file("hf_cached", "x", {"p128-r64-n1-greedy": ([1.0, 1.0, 1.0], 100)})
    bad.update(accepted=False, excluded_reason="bound to another preregistration")
    agg = run([bad])
    assert agg["cells"] == [] and agg["raw_files"][0]["excluded_reason"] == "bound to another preregistration"


def test_deterministic_output():
    from rollout_lib.core import canonical_json

    raws = [raw_file("hf_cached", "r1", all_cells([4.0, 3.0, 5.0]))]
    assert canonical_json(run(raws)) == canonical_json(run(copy.deepcopy(raws)))


def test_selection_falls_back_to_the_oracle_when_hf_cached_fails_its_own_gates():
    """Fail closed all the way: hf_cached is not the local backend unless its speedup, memory share,
    refresh share and local conformance pass; vLLM failing then falls back to the oracle too."""
    raws = [raw_file("hf_reference", "r1", all_cells([10.0, 10.0, 10.0])),
            raw_file("hf_cached", "r1", all_cells([8.0, 8.0, 8.0]))]  # 1.25x: below the 2x gate
    refresh = [{"path": f"outputs/conformance/refresh-{b}.json", "sha256": "2" * 64, "kind": "policy_refresh",
                "backend": b, "accepted": True, "verdict": {"passed": True, "checks": {"unique": True}}}
               for b in ("hf_cached", "vllm")]
    agg = run(raws, [*refresh, evidence("local_conformance", True, 0.002)])
    local = agg["selection"]["local"]
    assert local["backend"] == "hf_reference" and local["failed_requirements"] == ["hf_cached_speedup"]
    assert "oracle hf_reference" in local["decided_by"]
    assert agg["selection"]["direct_gkd"]["backend"] == "hf_reference"  # vllm missing -> the local backend
    # the same hf_cached with a failing local conformance, fast enough: still not selected
    fast = [raws[0], raw_file("hf_cached", "r1", all_cells([4.0, 4.0, 4.0]))]
    agg = run(fast, [*refresh, evidence("local_conformance", False, 0.3)])
    assert agg["selection"]["local"]["backend"] == "hf_reference"
    assert agg["selection"]["local"]["failed_requirements"] == ["local_conformance"]
    # and its share of the refresh gate: vllm's refresh evidence alone does not qualify hf_cached
    agg = run(fast, [refresh[1], evidence("local_conformance", True, 0.002)])
    assert agg["selection"]["local"]["failed_requirements"] == ["policy_refresh"]


def test_a_later_failed_attempt_never_replaces_an_earlier_completed_cell():
    good = raw_file("hf_cached", "a", {"p128-r64-n1-greedy": ([2.0, 2.0, 2.0], 100)})
    later = raw_file("hf_cached", "b", {"p128-r64-n1-greedy": ([1.0, 1.0, 1.0], 100)})
    later["records"][-1]["status"] = "failed"  # the later run's attempt failed (an OOM, a dead server)
    agg = run([good, later])
    (cell,) = agg["cells"]
    assert cell["raw_file"].endswith("/a.jsonl") and cell["valid"] and cell["tokens_per_s"] == 50.0
    assert {f["run_id"]: f["superseded_cells"] for f in agg["raw_files"]} == {"a": [], "b": ["p128-r64-n1-greedy"]}
    # with no completed copy anywhere, the failed attempt is the cell (and it is invalid, named)
    agg = run([later])
    assert not agg["cells"][0]["valid"] and agg["invalid_cells"]["hf_cached"] == ["p128-r64-n1-greedy"]
