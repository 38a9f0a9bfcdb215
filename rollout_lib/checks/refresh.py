"""Policy-refresh evidence: N policy versions through one backend, then teardown with proof.

Per version: sync time (device synchronized), the identity served (recomputed by the backend from
what it holds; a mismatch is an error), a short greedy probe (its tokens and log-probabilities are
recorded so a reviewer can check that the served policy changed), and GPU memory after the refresh
(NVML device used + torch reserved). Verdict: identities unique and each equal to the requested
one; memory not monotonically growing across the versions (strictly increasing at every step
fails); after teardown the port is closed and no child process is left (backends that own a
server; `not_applicable` otherwise).

    rollout refresh --backend hf_cached --out outputs/conformance/refresh-hf_cached-h200.json
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

from rollout_lib.backends.base import Backend
from rollout_lib.models.policy import PolicyIdentityMismatch, policy_versions
from rollout_lib.study.prereg import Preregistration
from rollout_lib.study.workload import Workload

PROBE_TOKENS = 8


def _memory(backend: Backend) -> dict[str, Any]:
    device = getattr(backend, "device", None)
    out: dict[str, Any] = {}
    try:
        import torch

        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
            out["torch_reserved_bytes"] = int(torch.cuda.memory_reserved(device))
    except ImportError:  # pragma: no cover
        pass
    try:
        import pynvml

        from rollout_lib.measure.memory import nvml_handle

        pynvml.nvmlInit()
        handle = nvml_handle(0)  # this process's device 0, whatever CUDA_VISIBLE_DEVICES says
        out["nvml_device_used_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        pynvml.nvmlShutdown()
    except Exception as exc:  # CPU machine or no NVML
        out["nvml_status"] = f"not_applicable: {type(exc).__name__}"
    return out


def monotonic_growth(values: list[int]) -> bool:
    """True when every refresh used strictly more memory than the one before (a leak's signature)."""
    return len(values) >= 3 and all(b > a for a, b in itertools.pairwise(values))


def run_refresh(study: Preregistration, backend: Backend, versions: int | None = None) -> dict[str, Any]:
    workload = Workload(study)
    count = versions or study.policy_refresh.versions
    policies = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, count)
    cell = next(c for c in workload.cells() if c.sampling.name == "greedy" and c.samples_per_prompt == 1)
    probe = [dataclasses.replace(r, max_new_tokens=min(PROBE_TOKENS, r.max_new_tokens))
             for r in workload.requests(cell)[:1]]
    cold = backend.cold_start()
    rows, errors = [], []
    for policy in policies:
        # the benchmark's stand-in for training synthesizes version k in k seeded steps over ~10 M
        # parameters (seconds at version 8 on the 0.6B actor): that is not the sync's cost, so the
        # tensors and their identity exist before the timer starts, and their cost is recorded apart
        # (the growth of the H200 series, 0.25 -> 0.82 s, was this)
        start = time.perf_counter()
        _ = policy.tensors, policy.identity
        materialize_s = time.perf_counter() - start
        # likewise writing the version into a trainable actor (hf_cached's stand-in for the optimizer
        # step): outside the timer, recorded apart; the sync then copies the actor's live tensors
        stand_in_s = None
        if hasattr(backend, "set_actor_policy"):
            start = time.perf_counter()
            backend.set_actor_policy(policy)
            backend._synchronize()  # the host-to-device copies end inside the stand-in's time
            stand_in_s = time.perf_counter() - start
        start = time.perf_counter()
        try:
            served = backend.sync_policy(policy)
        except PolicyIdentityMismatch as exc:
            served = None
            errors.append(str(exc))
        sync_s = time.perf_counter() - start
        result = backend.generate(probe).results[0] if served else None
        rows.append({"version": policy.version, "requested_identity": policy.identity, "served_identity": served,
                     "served_bf16_identity": getattr(backend, "served_bf16_identity", None),
                     "sync_phases_s": (getattr(backend, "served_policies", None) or [{}])[-1].get("sync_phases_s"),
                     "exact": served == policy.identity, "sync_s": sync_s, "policy_materialize_s": materialize_s,
                     "actor_stand_in_s": stand_in_s,
                     "memory_after": _memory(backend),
                     "probe_token_ids": list(result.token_ids) if result else None,
                     "probe_logprobs": list(result.logprobs) if result and result.logprobs else None})
    environment = backend.environment()
    teardown = backend.teardown()
    proof = backend.teardown_report()
    series = [r["memory_after"].get("nvml_device_used_bytes", r["memory_after"].get("torch_reserved_bytes"))
              for r in rows]
    measured_series = [v for v in series if v is not None]
    checks = {
        "unique_identities": len({r["served_identity"] for r in rows}) == len(rows) and None not in
        {r["served_identity"] for r in rows},
        "served_exactly": all(r["exact"] for r in rows),
        "no_monotonic_memory_growth": not monotonic_growth(measured_series),
        "port_closed_after_teardown": proof.get("port_closed", True),
        "no_child_left": not proof.get("leftover_pids"),
        "probe_changed_between_versions": any(a["probe_logprobs"] != b["probe_logprobs"]
                                              for a, b in itertools.pairwise(rows)),
    }
    syncs = [r["sync_s"] for r in rows]
    # beside the preregistered gate, never part of it: a sync cost that climbs with every version
    # (adapters never unloaded, a growing CPU LoRA cache) is a finding of its own
    diagnostics = {"sync_time_not_growing_monotonically": not monotonic_growth(syncs),
                   "sync_s_first": syncs[0] if syncs else None, "sync_s_last": syncs[-1] if syncs else None,
                   "sync_s_max": max(syncs) if syncs else None}
    return {"kind": "policy_refresh", "backend": backend.name, "versions": count, "diagnostics": diagnostics,
            "preregistration_sha256": study.sha256, "preregistered": study.preregistered,
            "cold_start_s": cold.seconds, "rows": rows, "errors": errors,
            "memory_series_bytes": series if measured_series else None,
            "memory_status": "measured" if measured_series else "not_applicable (no GPU)",
            "teardown_s": teardown.seconds, "teardown_proof": proof or {"status": "not_applicable (no server)"},
            "backend_environment": environment, "verdict": {"passed": all(checks.values()), "checks": checks}}
