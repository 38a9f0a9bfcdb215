"""GPU memory per cell: torch's peak reserved/allocated and NVML's total for the process tree.

- torch: `reset_peak_memory_stats` before a cell, `max_memory_reserved/allocated` after it.
- NVML: a background thread samples every few milliseconds the GPU memory used by every process of
  this process tree (this process and its descendants: a vLLM server child included), and the
  device's used memory; the cell's peak total is the largest sampled process-tree sum. Processes
  outside the tree that hold GPU memory are reported (invalidation rule INV-FOREIGN-GPU-PROCESS).
On a CPU-only machine every field is `not_applicable`; where NVML cannot attribute memory to
processes (some containers), the per-process field is `not_measured` and says why.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


def process_tree(root: int | None = None) -> set[int]:
    """pid and all descendants, from /proc/<pid>/task/<tid>/children."""
    root = os.getpid() if root is None else root
    seen, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stack.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
    return seen


class NVMLSampler:
    """Background sampler of process-tree GPU memory; use as a context manager around a cell."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.005):
        self.device_index = device_index
        self.interval_s = interval_s
        self.peak_tree_bytes: int | None = None
        self.peak_device_used_bytes: int | None = None
        self.foreign_pids: set[int] = set()
        self.samples = 0
        self.status = "not_measured"
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None

    def __enter__(self) -> NVMLSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception as exc:  # no NVML: say so
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}"
            return self
        self.status = "measured"
        self._sample()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        import pynvml

        tree = process_tree()
        info = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        self.peak_device_used_bytes = max(self.peak_device_used_bytes or 0, int(info.used))
        total, attributed = 0, True
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
            used = proc.usedGpuMemory
            if proc.pid in tree:
                if used is None:
                    attributed = False
                else:
                    total += int(used)
            elif used:
                self.foreign_pids.add(int(proc.pid))
        if attributed:
            self.peak_tree_bytes = max(self.peak_tree_bytes or 0, total)
        else:
            self.reason = "NVML reports no per-process memory here"
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception as exc:  # keep the cell alive; record why sampling stopped
                self.reason = f"sampling stopped: {type(exc).__name__}: {exc}"
                return

    def __exit__(self, *exc_info: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            try:
                self._sample()  # one last sample at the boundary
                import pynvml

                pynvml.nvmlShutdown()
            except Exception:
                pass

    def to_json(self) -> dict[str, Any]:
        if self.status != "measured":
            return {"status": self.status, "reason": self.reason}
        out: dict[str, Any] = {"status": "measured", "samples": self.samples,
                               "peak_device_used_bytes": self.peak_device_used_bytes,
                               "foreign_pids": sorted(self.foreign_pids)}
        if self.peak_tree_bytes is None:
            out["peak_process_tree_bytes_status"] = "not_measured"
            out["reason"] = self.reason
        else:
            out["peak_process_tree_bytes"] = self.peak_tree_bytes
        return out


class CellMemory:
    """torch peaks (reset at entry) + NVML process-tree sampling for one cell."""

    def __init__(self, device):
        self.device = device
        self.nvml: NVMLSampler | None = None
        self.started = 0.0

    def __enter__(self) -> CellMemory:
        import torch

        self.started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.nvml = NVMLSampler(self.device.index or 0).__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.nvml is not None:
            self.nvml.__exit__(*exc_info)

    def snapshot(self) -> dict[str, Any]:
        import torch

        if self.device.type != "cuda":
            reason = "CPU run: no GPU memory"
            return {"torch": {"status": "not_applicable", "reason": reason},
                    "nvml": {"status": "not_applicable", "reason": reason}}
        torch.cuda.synchronize(self.device)
        return {"torch": {"status": "measured",
                          "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)),
                          "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(self.device))},
                "nvml": self.nvml.to_json() if self.nvml else {"status": "not_measured"}}
