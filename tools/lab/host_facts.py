"""Facts about the lent machine that the measurement identity does not hold, written once per queue.

The oracle (and every eager HF path) is bound by host work and kernel launches, not by the GPU: the
same GPU model and driver ran p128-r512-n1-greedy at 34-35 s per repetition in lease 5 and 57 s in
lease 6. The raw files' environment identity names the GPU, the driver and the packages, not the
host CPU (its module is frozen while the oracle's campaign runs), so each lease's queue records the
host beside its logs, with two small timings that make leases comparable:

- `python_loop_ns_per_iteration`: a pure-Python loop (interpreter speed);
- `eager_launch_us_per_op`: one tiny CUDA op launched eagerly, synchronized once at the end (the
  per-launch host cost that bounds the eager decode loops); `not_measured` without CUDA.

    python3 tools/lab/host_facts.py > host.json
    python3 tools/lab/host_facts.py --gpu-is H200 && <a job that only this card may run>

`--gpu-is NAME` writes nothing on stdout: exit 0 when GPU 0's name (NVML) contains NAME, else 3 with the
reason on stderr (another card, or no NVML), so a queue job measured only on one card is skipped on another.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollout_lib.measure.host import host_identity


def python_loop_ns_per_iteration(iterations: int = 2_000_000) -> float:
    started = time.perf_counter_ns()
    total = 0
    for i in range(iterations):
        total += i
    return (time.perf_counter_ns() - started) / iterations


def eager_launch_us_per_op(operations: int = 20_000) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"status": "not_measured", "reason": "torch is not importable"}
    if not torch.cuda.is_available():
        return {"status": "not_measured", "reason": "no CUDA device"}
    x = torch.zeros(16, device="cuda")
    for _ in range(1_000):  # first launches: context, allocator, kernel load
        x.add_(1.0)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(operations):
        x.add_(1.0)
    torch.cuda.synchronize()
    return {"status": "measured", "value": (time.perf_counter() - started) / operations * 1e6,
            "operations": operations, "torch": torch.__version__}


def host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = host_identity() | {
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_loop_ns_per_iteration": python_loop_ns_per_iteration(),
        "eager_launch_us_per_op": eager_launch_us_per_op(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    facts["gpu"] = gpu_facts()
    return facts


def gpu_facts() -> dict[str, Any]:
    """GPU 0's name, driver and highest SM clock from NVML; `not_measured` with the reason without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        facts = {"name": name.decode() if isinstance(name, bytes) else name,
                 "driver": pynvml.nvmlSystemGetDriverVersion(),
                 "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)}
        pynvml.nvmlShutdown()
        return facts
    except Exception as exc:  # no NVML here (a CPU machine): say so, do not invent it
        return {"status": "not_measured", "reason": f"{type(exc).__name__}: {exc}"}


def gpu_is(wanted: str) -> tuple[bool, str]:
    """Whether GPU 0's name contains `wanted` (case-insensitive), and why not."""
    gpu = gpu_facts()
    if "name" not in gpu:
        return False, f"no GPU name to compare with {wanted!r}: {gpu['reason']}"
    if wanted.lower() not in gpu["name"].lower():
        return False, f"the GPU is {gpu['name']}, not {wanted}: skipped"
    return True, ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="facts about the lent machine (JSON on stdout)")
    parser.add_argument("--gpu-is", default="", metavar="NAME",
                        help="print nothing; exit 0 when GPU 0's name contains NAME, else 3 with the reason")
    return parser


if __name__ == "__main__":
    args = build_parser().parse_args()
    if args.gpu_is:
        matched, reason = gpu_is(args.gpu_is)
        if not matched:
            print(f"host_facts --gpu-is: {reason}", file=sys.stderr)
        sys.exit(0 if matched else 3)
    print(json.dumps(host_facts(), indent=1, sort_keys=True))
