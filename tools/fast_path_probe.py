"""Quick probe of the hf_cached fast path on one GPU: capture time, ms per decode step and tok/s for
the graph path (and optionally the eager path) on a few cells, float32 greedy equality of the two.

    python tools/fast_path_probe.py --params params/rollout-runtime-v2.yaml --out probe.json [--eager]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout_lib.backends import create_backend
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.prereg import load
from rollout_lib.study.workload import Workload


def measure(backend, workload, cell_ids, repetitions):
    rows = {}
    for cell_id in cell_ids:
        requests = workload.requests(workload.cell(cell_id))
        backend.generate(requests)  # warmup, excluded
        walls, decode, steps, tokens = [], [], None, None
        for _ in range(repetitions):
            batch = backend.generate(requests)
            walls.append(batch.wall_s)
            decode.append(batch.phases["decode_s"].seconds)
            steps, tokens = batch.decode_steps, batch.generated_tokens
        rows[cell_id] = {"median_wall_s": statistics.median(walls), "tokens_per_s": tokens / statistics.median(walls),
                         "ms_per_decode_step": 1000 * statistics.median(decode) / max(steps, 1),
                         "decode_steps": steps, "generated_tokens": tokens}
        print(cell_id, json.dumps(rows[cell_id]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", default="params/rollout-runtime-v2.yaml")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cells", default="p128-r64-n1-greedy,p128-r64-n4-stochastic,p512-r256-n4-greedy")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="also the eager path, side by side")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    study = load(args.params)
    workload = Workload(study)
    policy = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, 1)[-1]
    cells = args.cells.split(",")
    report = {"cells": cells}
    for decode in ("graphs", "eager") if args.eager else ("graphs",):
        options = {"decode": decode} | ({"device": args.device} if args.device else {})
        backend = create_backend("hf_cached", study, **options)
        started = time.perf_counter()
        cold = backend.cold_start()
        sync_started = time.perf_counter()
        backend.sync_policy(policy)
        sync_s = time.perf_counter() - sync_started
        env = backend.environment()
        print(decode, "cold start", round(cold.seconds, 2), "capture", env.get("graph_capture_s"), "sync", sync_s,
              flush=True)
        report[decode] = {"cold_start_s": cold.seconds, "policy_sync_s": sync_s, "environment": env,
                          "cells": measure(backend, workload, cells, args.repetitions),
                          "total_s": time.perf_counter() - started}
        backend.teardown()
    Path(args.out).write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
