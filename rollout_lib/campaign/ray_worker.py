"""What runs inside a Ray task of the Ray executor (`executors.RayExecutor`): refuse a worker that does not
share the driver's filesystem or whose measurement identity differs from the plan's, then run the same
measuring process as the local executor and wait for it. Imported by Ray on the worker node, never by the
rest of the product.

The measuring process gets PR_SET_PDEATHSIG: if the Ray worker dies (node lost, worker killed), the
measuring process dies with it instead of writing on as an orphan; its raw file's lock is released by
the kernel and the driver seals it and continues its cut cell elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from rollout_lib.core import REPO_ROOT, write_json_atomic

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _where() -> dict[str, Any]:
    """This worker's node and GPU as Ray and the OS name them."""
    import ray

    context = ray.get_runtime_context()
    return {"executor": "ray", "hostname": socket.gethostname(), "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(), "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "worker_pid": os.getpid()}


def _nvml_gpu_count() -> int:
    """GPUs NVML sees on this node (0 on a CPU node, or where Ray's GPU resources are declared, not real)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def probe_identity(params_path: str, backend: str) -> dict[str, Any]:
    from rollout_lib.campaign.identity_probe import probe

    return probe(params_path, backend) | {"where": _where()}


def measure_slot(job: dict[str, Any], token_path: str, token: str, expected: dict[str, Any] | None,
                 params_path: str, backend: str) -> dict[str, Any]:
    """Check, measure, record; returns {"returncode", "where", ...} or {"refused": reason}."""
    from rollout_lib.campaign.identity_probe import identity_differences, probe

    where = _where()
    record_path = Path(job["record"])
    record: dict[str, Any] = {"run_id": job["run_id"], "slot": job["slot"], "cells": job["cells"],
                              "raw_file": Path(job["raw_file"]).name, **where, "started_unix": time.time()}
    try:
        seen = (Path(token_path).read_text() if Path(token_path).is_file() else "")
    except OSError:
        seen = ""
    if token not in seen:  # the record cannot be written either: the driver reports the refusal
        return {"refused": f"output-dir: {Path(token_path).parents[3]} is not visible from node {where['hostname']} "
                           f"({where['node_ip']}); the Ray executor needs the output directory on storage every "
                           "node mounts at the same path (results are not returned to the driver)",
                "where": where}
    if expected and expected.get("sha256"):
        mine = probe(params_path, backend)
        if mine.get("sha256") != expected["sha256"]:
            differs = identity_differences(expected.get("key") or {}, mine.get("key") or {})
            reason = (f"measurement identity {str(mine.get('sha256'))[:10]} differs from the plan's "
                      f"{expected['sha256'][:10]} ({mine.get('source')}): "
                      + ("; ".join(differs[:4]) or "identity unknown"))
            write_json_atomic(record_path, record | {"refused": reason, "ended_unix": time.time()}, overwrite=True)
            return {"refused": reason, "where": where}
    command = list(job["command"])
    if _nvml_gpu_count() == 0:
        command += ["--device", "cpu"]
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", **job.get("env", {}))
    Path(job["log"]).parent.mkdir(parents=True, exist_ok=True)
    with open(job["log"], "ab") as handle:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
    record["measuring_pid"] = proc.pid
    write_json_atomic(record_path, record, overwrite=True)
    ended = "exited"
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # ray.cancel: stop like the local executor does (teardown recorded, file sealed)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
        ended = "stopped by the driver"
    record.update(returncode=code, ended=ended, ended_unix=time.time())
    write_json_atomic(record_path, record, overwrite=True)
    return {"returncode": code, "ended": ended, "where": where, "measuring_pid": proc.pid}
