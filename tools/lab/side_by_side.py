"""hf_cached and vllm side by side on the same cells in one process tree and one machine hold (issue 12's
evidence): 1 warmup + N measured repetitions per cell, tokens/s = generated tokens / median wall, and the
ratio vllm / hf_cached per cell. Writes JSON as it goes and prints a markdown table.

    python tools/lab/side_by_side.py --out side-by-side.json [--cells ...] [--repetitions 3] [--profile-params P]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollout_lib.backends import create_backend
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.prereg import load
from rollout_lib.study.workload import Workload

ISSUE_CELLS = ("p128-r64-n1-greedy,p128-r64-n1-stochastic,p128-r64-n4-greedy,p128-r64-n4-stochastic,"
               "p512-r256-n1-greedy,p512-r256-n1-stochastic,p512-r256-n4-greedy,p512-r256-n4-stochastic")


def measure(backend, workload, cells, repetitions, policy):
    cold = backend.cold_start()
    backend.sync_policy(policy)
    rows = {}
    for cell_id in cells:
        requests = workload.requests(workload.cell(cell_id))
        backend.generate(requests)  # warmup, excluded
        walls, tokens = [], None
        for _ in range(repetitions):
            batch = backend.generate(requests)
            walls.append(batch.wall_s)
            tokens = sum(len(r.token_ids) for r in batch.results)
        rows[cell_id] = {"wall_s": walls, "generated_tokens": tokens,
                         "tokens_per_s": tokens / statistics.median(walls)}
        print(backend.name, cell_id, round(rows[cell_id]["tokens_per_s"], 1), flush=True)
    environment = backend.environment()
    backend.teardown()
    return {"cold_start_s": cold.seconds, "cells": rows, "environment": environment}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", default="params/rollout-runtime-v2.yaml")
    parser.add_argument("--cells", default=ISSUE_CELLS)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--backend-option", action="append", default=[], metavar="BACKEND:KEY=VALUE",
                        help="e.g. vllm:server_python=/path/python (JSON values allowed)")
    parser.add_argument("--out", required=True)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    study = load(args.params)
    workload = Workload(study)
    policy = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, 1)[-1]
    cells = [c for c in args.cells.split(",") if c]
    options: dict[str, dict] = {"hf_cached": {}, "vllm": {}}
    for item in args.backend_option:
        name, _, pair = item.partition(":")
        key, _, value = pair.partition("=")
        try:
            options[name][key] = json.loads(value)
        except json.JSONDecodeError:
            options[name][key] = value
    report = {"cells": cells, "repetitions": args.repetitions, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                              time.gmtime())}
    for name in ("hf_cached", "vllm"):
        report[name] = measure(create_backend(name, study, **options[name]), workload, cells, args.repetitions,
                               policy)
        Path(args.out).write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    print("| cell | hf_cached tok/s | vllm tok/s | vllm / hf_cached |\n|---|---|---|---|")
    for cell in cells:
        a, b = report["hf_cached"]["cells"][cell]["tokens_per_s"], report["vllm"]["cells"][cell]["tokens_per_s"]
        print(f"| {cell} | {a:,.1f} | {b:,.1f} | {b / a:.2f} |")
    report["ratio_vllm_over_hf_cached"] = {c: report["vllm"]["cells"][c]["tokens_per_s"]
                                           / report["hf_cached"]["cells"][c]["tokens_per_s"] for c in cells}
    Path(args.out).write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
