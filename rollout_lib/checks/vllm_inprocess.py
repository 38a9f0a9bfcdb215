"""Diagnostic: the managed vLLM backend side by side with the in-process engine (`vllm.LLM`, in a clean
subprocess) on the same requests and seeds, with the same adapter and without one.

Answers two questions of the vLLM issue: does the managed server (HTTP, streaming, one request per
sample) cost throughput against the engine itself (goal: within 5% in every cell), and what does
serving through a LoRA adapter cost against the bare base weights (the "LoRA tax")? Each variant
runs in its own process, one after the other (no two engines share the GPU): one warmup, then the
timed repetitions; tokens/s = generated tokens / median wall. Not a gate: evidence beside them.

    rollout vllm-diagnostic --cells p128-r64-n1-greedy,p512-r256-n4-stochastic --out outputs/perf/x.json
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from rollout_lib.backends import create_backend
from rollout_lib.backends.vllm_managed import LORA_RANKS
from rollout_lib.lifetime import run_bound
from rollout_lib.models.policy import policy_versions, write_peft_adapter
from rollout_lib.study.prereg import Preregistration
from rollout_lib.study.workload import Workload

CHILD = Path(__file__).with_name("vllm_inprocess_child.py")


def _job_requests(workload: Workload, cells: list[str]) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for cell_id in cells:
        out[cell_id] = [{"prompt_token_ids": list(r.prompt_token_ids), "max_new_tokens": r.max_new_tokens,
                         "temperature": 0.0 if r.greedy else r.temperature, "seed": r.seed,
                         "eos_token_ids": list(r.eos_token_ids)} for r in workload.requests(workload.cell(cell_id))]
    return out


def run_child(python: str, job: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
    # bound: own process group, SIGKILL on our death, a watchdog for the engine's own children
    done = run_bound([python, str(CHILD)], input=json.dumps(job), timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"in-process vLLM child failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_managed(study: Preregistration, workload: Workload, policy, cells: list[str], repetitions: int,
                     options: dict[str, Any]) -> dict[str, Any]:
    """The managed backend on `cells`: one cold start, the policy synced, per cell one warmup and the
    timed repetitions (the engine-side phases are read after each timer, as the runner does)."""
    managed = create_backend("vllm", study, **options)
    started = time.perf_counter()
    cold = managed.cold_start()
    managed.sync_policy(policy)
    measured = {}
    try:
        for cell_id in cells:
            requests = workload.requests(workload.cell(cell_id))
            managed.generate(requests)  # warmup, excluded
            walls, tokens = [], None
            for _ in range(repetitions):
                begin = time.perf_counter()
                batch = managed.generate(requests)
                walls.append(time.perf_counter() - begin)
                _ = batch.phases
                tokens = batch.generated_tokens
            median = statistics.median(walls)
            measured[cell_id] = {"wall_s": walls, "median_wall_s": median, "generated_tokens": tokens,
                                 "tokens_per_s": tokens / median}
    finally:
        managed.teardown()
    return {"cold_start_s": cold.seconds, "cells": measured, "environment": managed.environment(),
            "total_s": time.perf_counter() - started}


def run_diagnostic(study: Preregistration, cells: list[str], repetitions: int = 3,
                   backend_options: dict[str, Any] | None = None,
                   stream_intervals: tuple[int, ...] = (1,), non_streamed: bool = False) -> dict[str, Any]:
    """`stream_intervals`: the managed backend once per value (`stream_interval` option; 1 is the
    preregistered setting and the one the 5% goal is judged on). `non_streamed`: once more with
    `streaming: false` (one response per request, built once at the end as the in-process engine
    does), reported beside the preregistered setting, never instead of it."""
    if 1 not in stream_intervals or any(not isinstance(n, int) or n < 1 for n in stream_intervals):
        raise ValueError(f"stream_intervals {list(stream_intervals)!r}: integers >= 1, including 1 (the "
                         "preregistered setting)")
    workload = Workload(study)
    policy = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, 1)[-1]
    options = dict(backend_options or {})
    managed = create_backend("vllm", study, **options)
    model_dir = managed._model_dir()  # the same mirror snapshot the server loads
    adapter_dir = managed.cache_dir / "adapters" / f"diagnostic-{policy.identity[:16]}"
    write_peft_adapter(policy, adapter_dir)
    work = study.workload
    job = {"model_dir": model_dir, "max_model_len": max(work.prompt_tokens) + max(work.response_tokens) + 8,
           "kv_cache_memory_bytes": managed.kv_cache_bytes, "repetitions": repetitions,
           "max_lora_rank": next(r for r in LORA_RANKS if r >= study.actor.lora.rank),
           "cells": _job_requests(workload, cells),
           "engine_overrides": {} if managed.on_gpu else {"gpu_memory_utilization": 0.1}}
    inprocess = {"adapter": run_child(managed.server_python, job | {"adapter_dir": str(adapter_dir)}),
                 "no_adapter": run_child(managed.server_python, job)}
    by_interval = {n: _measure_managed(study, workload, policy, cells, repetitions,
                                       options | {"stream_interval": n}) for n in sorted(set(stream_intervals))}
    unstreamed = (_measure_managed(study, workload, policy, cells, repetitions, options | {"streaming": False})
                  if non_streamed else None)
    rows = []
    for cell_id in cells:
        m, a, b = (by_interval[1]["cells"][cell_id]["tokens_per_s"],
                   inprocess["adapter"]["cells"][cell_id]["tokens_per_s"],
                   inprocess["no_adapter"]["cells"][cell_id]["tokens_per_s"])
        rows.append({"cell_id": cell_id, "managed_tokens_per_s": m, "inprocess_adapter_tokens_per_s": a,
                     "inprocess_no_adapter_tokens_per_s": b, "managed_over_inprocess_adapter": m / a,
                     "lora_tax_fraction": 1.0 - a / b,
                     "managed_tokens_per_s_by_stream_interval": {
                         str(n): by_interval[n]["cells"][cell_id]["tokens_per_s"] for n in by_interval}})
        if unstreamed is not None:
            rate = unstreamed["cells"][cell_id]["tokens_per_s"]
            rows[-1] |= {"managed_non_streamed_tokens_per_s": rate,
                         "managed_non_streamed_over_inprocess_adapter": rate / a}
    return {"kind": "vllm_inprocess_diagnostic", "cells": cells, "repetitions": repetitions,
            "policy_identity": policy.identity, "managed": by_interval[1],
            "managed_by_stream_interval": {str(n): v for n, v in by_interval.items() if n != 1},
            **({"managed_non_streamed": unstreamed} if unstreamed is not None else {}),
            "inprocess": inprocess, "rows": rows,
            "verdict": {"managed_within_5_percent_of_inprocess": all(r["managed_over_inprocess_adapter"] >= 0.95
                                                                      for r in rows)}}
