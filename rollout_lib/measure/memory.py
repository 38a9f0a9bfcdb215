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

# Processes outside this process's tree that belong to its measurement (a cycle's rollout placed in a Ray
# actor beside the trainer, issue 44): pid -> role. Empty unless `counted_processes` registered some.
COUNTED_PROCESSES: dict[int, str] = {}


class counted_processes:
    """Count `roles` ({pid: role}) and their descendants as part of this process tree while inside
    (NVMLSampler and the cycle's per-process memory read `process_tree()`)."""

    def __init__(self, roles: dict[int, str]):
        self.roles = dict(roles)

    def __enter__(self) -> counted_processes:
        COUNTED_PROCESSES.update(self.roles)
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in self.roles:
            COUNTED_PROCESSES.pop(pid, None)


def process_tree(root: int | None = None) -> set[int]:
    """pid and all descendants, from /proc/<pid>/task/<tid>/children; without `root`, this process's tree
    and that of every process registered with `counted_processes`."""
    if root is None:
        return set().union(*(process_tree(pid) for pid in (os.getpid(), *COUNTED_PROCESSES)))
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


NVML_INTERVAL_S = 0.02
NVML_TREE_REFRESH_S = 1.0


def nvml_handle(cuda_index: int):
    """The NVML handle of CUDA device `cuda_index` *as this process sees it*.

    NVML numbers GPUs physically and ignores CUDA_VISIBLE_DEVICES: with `CUDA_VISIBLE_DEVICES=1`,
    CUDA's device 0 is NVML's device 1. A campaign worker pinned to the second GPU that sampled NVML
    device 0 would measure the other worker's GPU and call its process foreign. Matched by UUID
    (torch reports it without creating a context); else through CUDA_VISIBLE_DEVICES.
    """
    import pynvml

    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if cuda_index < len(visible):
            entry = visible[cuda_index]
            if entry.isdigit():
                return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            return pynvml.nvmlDeviceGetHandleByUUID(entry)
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)


def nvml_index_of(cuda_index: int) -> int:
    """NVML's (physical) index of CUDA device `cuda_index`: a check for the mapping above."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetIndex(nvml_handle(cuda_index)))
    finally:
        pynvml.nvmlShutdown()


class NVMLSampler:
    """Background sampler of process-tree GPU memory; use as a context manager around a cell.

    The sampler shares the GIL with the decode loop it observes, so it must stay cheap: seen on the
    H200 (2026-11-29), two samplers at 5 ms that walked /proc on every sample slowed a CPU-bound HF
    decode step by roughly 1.5-2x. Defaults: one sampler per cell, 20 ms, process tree refreshed once a
    second (a child process lives far longer than that). `start_window()`/`window_json()` give the peak
    and foreign processes of one repetition without a second thread.
    """

    def __init__(self, device_index: int = 0, interval_s: float = NVML_INTERVAL_S,
                 tree_refresh_s: float = NVML_TREE_REFRESH_S):
        self.device_index = device_index
        self.interval_s = interval_s
        self.tree_refresh_s = tree_refresh_s
        self._tree: set[int] = set()
        self._tree_at = -1e9
        self._window_peak: int | None = None
        self._window_foreign: set[int] = set()
        self.peak_tree_bytes: int | None = None
        self.peak_device_used_bytes: int | None = None
        self.foreign_pids: set[int] = set()
        self.samples = 0
        self.status = "not_measured"
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        self.nvml_index: int | None = None

    def __enter__(self) -> NVMLSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = nvml_handle(self.device_index)
            self.nvml_index = int(pynvml.nvmlDeviceGetIndex(self._handle))
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

        now = time.perf_counter()
        if now - self._tree_at >= self.tree_refresh_s:
            self._tree, self._tree_at = process_tree(), now
        tree = self._tree
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
                self._window_foreign.add(int(proc.pid))
        if attributed:
            self.peak_tree_bytes = max(self.peak_tree_bytes or 0, total)
            self._window_peak = max(self._window_peak or 0, total)
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

    def start_window(self) -> None:
        """Begin a repetition: its peak and foreign processes are tracked separately."""
        self._window_peak, self._window_foreign = None, set()
        if self.status == "measured":
            self._tree_at = -1e9  # refresh the tree at the boundary
            self._sample()

    def window_json(self) -> dict[str, Any]:
        if self.status != "measured":
            return {"status": self.status, "reason": self.reason, "foreign_pids": []}
        self._sample()
        out: dict[str, Any] = {"status": "measured", "foreign_pids": sorted(self._window_foreign)}
        if self._window_peak is None:
            out["peak_process_tree_bytes_status"] = "not_measured"
        else:
            out["peak_process_tree_bytes"] = self._window_peak
        return out

    def to_json(self) -> dict[str, Any]:
        if self.status != "measured":
            return {"status": self.status, "reason": self.reason}
        out: dict[str, Any] = {"status": "measured", "samples": self.samples, "nvml_device_index": self.nvml_index,
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
