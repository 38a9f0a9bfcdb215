"""Child process of `rollout vllm-diagnostic --variants ...,hf_cached`: one of this project's backends
measured in a fresh process, as each vLLM variant of the diagnostic is, so that no two engines share a
process or the GPU at once.

Reads a JSON job on stdin (`params`: the study file; `backend`; `cells`; `repetitions`; `options`: the
backend's options), measures as the campaign runner does (one cold start, the diagnostic's policy synced,
per cell one warmup excluded, then the timed repetitions; tokens/s = generated tokens / median wall) and
writes one JSON result on stdout (last line), with the decode step's median seconds where the backend
exposes its decode phase and step count.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from rollout_lib.backends import create_backend
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.prereg import load
from rollout_lib.study.workload import Workload


def _gpu_name(backend) -> str:
    import torch

    device = getattr(backend, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def measure(job: dict[str, Any]) -> dict[str, Any]:
    study = load(job["params"])
    workload = Workload(study)
    policy = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, 1)[-1]
    backend = create_backend(job["backend"], study, **job.get("options", {}))
    started = time.perf_counter()
    cold = backend.cold_start()
    cells = {}
    try:
        backend.sync_policy(policy)
        for cell_id in job["cells"]:
            requests = workload.requests(workload.cell(cell_id))
            backend.generate(requests)  # warmup, excluded
            walls, step_s, tokens = [], [], None
            for _ in range(job["repetitions"]):
                batch = backend.generate(requests)
                walls.append(batch.wall_s)
                tokens = batch.generated_tokens
                decode, steps = batch.phases.get("decode_s"), getattr(batch, "decode_steps", None)
                if decode is not None and decode.status == "measured" and steps:
                    step_s.append(decode.seconds / steps)
            median = statistics.median(walls)
            cells[cell_id] = {"wall_s": walls, "median_wall_s": median, "generated_tokens": tokens,
                              "tokens_per_s": tokens / median, "rows": len(requests),
                              "median_decode_step_s": statistics.median(step_s) if step_s else "not_measured"}
        environment, gpu = backend.environment(), _gpu_name(backend)
    finally:
        backend.teardown()
    return {"backend": job["backend"], "cold_start_s": cold.seconds, "cells": cells, "gpu": gpu,
            "environment": environment, "policy_identity": policy.identity, "total_s": time.perf_counter() - started}


def main() -> int:
    print(json.dumps(measure(json.loads(sys.stdin.read())), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
