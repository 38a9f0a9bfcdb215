"""Where a campaign's measuring workers run: the local executor (one GPU, or the CPU; the embedded
default, no Ray) or the Ray executor (one worker per GPU, anywhere on a Ray cluster: DESIGN decision 14).

Both start the same measuring process per worker, `rollout measure --direct ...` (`driver._worker_command`),
so the evidence rules do not depend on the executor: one raw file per worker, single writer, lock, sealed
at its end, measurement identity in its header. The frozen runner's header is not extended (its bytes are
the h200-v2 campaign's measurement identity): a Ray worker writes its node, GPU and executor into a
*worker record* beside the driver state instead (`<output-dir>/campaigns/<campaign>/workers/<backend>-
<run-id>.json`, `ray_worker.py`), which `campaign status` reads.

Ray is imported only here, inside `RayExecutor`, and in `ray_worker.py`: the local executor and the rest of
the product run without Ray installed.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_lib.core import REPO_ROOT, write_json_atomic

EXECUTORS = ("local", "ray")
RAY_VERSION = "2.60.0"  # the pinned version (requirements/*.txt); others are not refused, only named in errors


class ExecutorError(ValueError):
    """An executor cannot run this campaign (no Ray, no GPUs in the cluster, no shared filesystem)."""


@dataclass
class WorkerJob:
    """One measuring worker: a slot of the plan (a GPU), its run id, cells and measuring command."""

    slot: int
    run_id: str
    cells: list[str]
    command: list[str]  # `rollout measure --direct ...`, without --device (the worker's machine decides)
    raw_file: str
    log: str
    record: str = ""  # the worker record (Ray: node, GPU, executor), written by the worker
    env: dict[str, str] = field(default_factory=dict)


def worker_record_path(campaign_folder: Path, backend: str, run_id: str) -> Path:
    return Path(campaign_folder) / "workers" / f"{backend}-{run_id}.json"


# ------------------------------------------------------------------------------------------
# Local: one subprocess per GPU on this machine (today's behaviour, unchanged)
# ------------------------------------------------------------------------------------------

class LocalExecutor:
    """A `rollout measure --direct` subprocess on this machine (`CUDA_VISIBLE_DEVICES=<gpu>`, or the CPU)."""

    name = "local"
    replaces_lost_workers = False  # a lost local worker is the lost machine: the next job continues its cell

    def __init__(self, visible: list[int]):
        self.visible = visible

    def describe(self) -> dict[str, Any]:
        return {"executor": "local"}

    def start(self, job: WorkerJob) -> dict[str, Any]:
        env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", **job.env)
        command = list(job.command)
        if self.visible:
            env["CUDA_VISIBLE_DEVICES"] = str(self.visible[job.slot])
        else:
            command += ["--device", "cpu"]
        with open(job.log, "ab") as handle:
            proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return {"gpu": job.slot, "pid": proc.pid, "_proc": proc}

    def poll(self, handle: dict[str, Any]) -> dict[str, Any] | None:
        code = handle["_proc"].poll()
        return None if code is None else {"returncode": code}

    def stop(self, handle: dict[str, Any]) -> None:  # the worker stops at a repetition boundary: teardown + seal
        if handle["_proc"].poll() is None:
            os.killpg(handle["_proc"].pid, signal.SIGTERM)

    def wait(self, handle: dict[str, Any]) -> dict[str, Any]:
        return {"returncode": handle["_proc"].wait()}

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------
# Ray: one task with num_gpus=1 per worker, placed by Ray on any node of the cluster
# ------------------------------------------------------------------------------------------

def import_ray():
    """Ray, or a one-line ExecutorError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ExecutorError(f"executor: ray is not installed here; `pip install ray=={RAY_VERSION}` "
                            "(or use --executor local with one GPU)") from None
    return ray


def shared_fs_token(campaign_folder: Path) -> tuple[Path, str]:
    """A random token the driver writes under the output directory; a worker that cannot read it back at
    the same path does not share the driver's filesystem and is refused before it measures."""
    token = secrets.token_hex(16)
    path = Path(campaign_folder) / "workers" / f".shared-fs-token-{token[:8]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"token": token}, overwrite=True)
    return path, token


class RayExecutor:
    """Every worker a Ray task (`ray_worker.measure_slot`, num_gpus=1): Ray picks the node and the GPU and
    sets CUDA_VISIBLE_DEVICES; the task checks the shared filesystem and its measurement identity, then runs
    the measuring process and waits for it. A task lost with its node (or killed) is reported as lost; the
    driver then seals the dead raw file and continues its unfinished cells in a new worker."""

    name = "ray"
    replaces_lost_workers = True

    def __init__(self, address: str | None, campaign_folder: Path, params_path: str, backend: str):
        self.ray = import_ray()
        self.address = address
        self.campaign_folder = Path(campaign_folder)
        self.params_path = params_path
        self.backend = backend
        self._started_ray = False
        self.context: dict[str, Any] = {}
        self.expected_identity: dict[str, Any] | None = None
        self.token_path, self.token = Path(), ""

    def connect(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            try:
                info = ray.init(address=self.address, log_to_driver=False,
                                runtime_env={"env_vars": {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}})
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ExecutorError(f"address: cannot connect to a Ray cluster at {self.address or 'auto'}: "
                                    f"{' '.join(str(exc).split())[:300]}") from None
            self._started_ray = True
            dashboard = getattr(info, "dashboard_url", None)
        else:
            dashboard = None
        context = ray.get_runtime_context()
        self.context = {"gcs_address": getattr(context, "gcs_address", None),
                        "dashboard_url": f"http://{dashboard}" if dashboard and "://" not in dashboard
                        else dashboard or None,
                        "ray_version": ray.__version__,
                        "nodes": len([n for n in ray.nodes() if n.get("Alive")])}

    def cluster_gpus(self) -> int:
        return int(self.ray.cluster_resources().get("GPU", 0))

    def describe(self) -> dict[str, Any]:
        return {"executor": "ray", "ray": dict(self.context)}

    def probe_identity(self) -> dict[str, Any]:
        """The measurement identity a worker will have, probed in a Ray task on one GPU of the cluster."""
        from rollout_lib.campaign import ray_worker

        task = self.ray.remote(num_gpus=1, max_retries=0)(ray_worker.probe_identity)
        return self.ray.get(task.remote(self.params_path, self.backend))

    def prepare(self, expected_identity: dict[str, Any] | None) -> None:
        self.expected_identity = expected_identity
        self.token_path, self.token = shared_fs_token(self.campaign_folder)

    def start(self, job: WorkerJob) -> dict[str, Any]:
        from rollout_lib.campaign import ray_worker

        task = self.ray.remote(num_gpus=1, max_retries=0)(ray_worker.measure_slot)
        expected = None if self.expected_identity is None else {
            "sha256": self.expected_identity.get("sha256"), "key": self.expected_identity.get("key")}
        ref = task.remote(asdict(job), str(self.token_path), self.token, expected, self.params_path, self.backend)
        return {"gpu": job.slot, "slot": job.slot, "pid": None, "executor": "ray", "_ref": ref}

    def poll(self, handle: dict[str, Any]) -> dict[str, Any] | None:
        done, _ = self.ray.wait([handle["_ref"]], timeout=0)
        return self._result(handle) if done else None

    def _result(self, handle: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.ray.get(handle["_ref"])
        except self.ray.exceptions.TaskCancelledError:
            return {"returncode": -int(signal.SIGTERM), "ended": "stopped by the driver"}
        except self.ray.exceptions.RayError as exc:  # the worker process or its node died
            return {"returncode": None, "lost": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}

    def stop(self, handle: dict[str, Any]) -> None:
        """KeyboardInterrupt in the task: it sends SIGTERM to its measuring process (teardown + seal)."""
        self.ray.cancel(handle["_ref"], force=False)

    def wait(self, handle: dict[str, Any]) -> dict[str, Any]:
        self.ray.wait([handle["_ref"]])
        return self._result(handle)

    def close(self) -> None:
        if self.token:
            self.token_path.unlink(missing_ok=True)
        if self._started_ray:
            self.ray.shutdown()
