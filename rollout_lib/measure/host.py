"""The host a measurement ran on: its CPU, which the eager HF paths are bound by (host work and kernel
launches). Recorded beside the measurement identity, never part of it: the same GPU model and driver ran
the oracle's p128-r512-n1-greedy at 34-35 s per repetition on one lease's host and 57 s on another's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")


def cpu_model(cpuinfo: str) -> str | None:
    """The first `model name` of /proc/cpuinfo's text, or None."""
    for line in cpuinfo.splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip() or None
    return None


def host_identity() -> dict[str, Any]:
    """CPU model (`not_measured` where /proc/cpuinfo does not name it) and logical CPU count."""
    try:
        model = cpu_model(CPUINFO.read_text())
    except OSError:
        model = None
    return {"cpu_model": model or "not_measured", "logical_cpus": os.cpu_count()}
