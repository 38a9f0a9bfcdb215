"""`rollout cycle --placement ray`: the cycle's rollout backend and its trainer as two Ray actors (issue 44).

RL frameworks on Ray (verl, OpenRLHF, NeMo-RL) run rollout workers and trainers as separate actors. Placed
that way, one cycle here is:
- a **rollout actor** (`RolloutServer`, its own process and CUDA context) that constructs the backend
  exactly as a single-process run would and serves `cold_start`, `generate`, `sync_policy`, `teardown`;
- a **trainer task** that runs the same measured loop as a single-process run (`measure.cycle.run_cycles`)
  with a proxy (`RemoteBackend`) in place of the backend. It loads the teacher and its own NF4 + LoRA actor
  (as the vllm rows always do), so rollouts come back and policy versions go out through Ray's object
  store as CPU tensors: that transfer is what this placement costs, and it lands in the `rollout` and
  `policy_sync` phases it belongs to.
One GPU: both take `num_gpus=0.5`, so Ray puts them on the same GPU, and the memory gate counts both
processes (`measure.memory.counted_processes`: NVML's process-tree peak includes the rollout actor's tree).
Two GPUs (one each) is refused for now: the rollout GPU's memory would go unmeasured (issue 45's machine).

The driver (this command) holds no GPU. The trainer writes the raw file under `--output-dir`, which the
actors must see at the same path: one machine, or storage the cluster shares. Both actors run torch on the
driver's number of CPU threads (Ray starts its workers on one): a CPU's float32 sums follow the thread count, and a
trainer on other threads than a one-process run's measured another grad_norm (session 44, 2 cores: 0.26985067
against 0.26984844).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rollout_lib.campaign.executors import import_ray

GPU_SHARE_ONE_GPU = 0.5


def _where() -> dict[str, Any]:
    import socket

    import ray

    context = ray.get_runtime_context()
    return {"pid": os.getpid(), "host": socket.gethostname(), "node_id": context.get_node_id(),
            "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


class RolloutServer:
    """The Ray actor body: one backend, constructed from the cycle study as `run_cycles` would."""

    def __init__(self, cycle_params: str, backend_name: str, options: dict[str, Any], threads: int):
        import torch

        from rollout_lib.backends import create_backend
        from rollout_lib.study.cycle import load

        torch.set_num_threads(threads)  # the driver's (see the module)
        self.backend = create_backend(backend_name, load(cycle_params).rollout, **options)

    def where(self) -> dict[str, Any]:
        return _where()

    def device(self) -> str:
        return str(self.backend.device)

    def call(self, method: str, *args: Any) -> Any:
        if method not in RemoteBackend.FORWARDED:
            raise ValueError(f"rollout actor: {method!r} is not served; allowed: {', '.join(RemoteBackend.FORWARDED)}")
        return getattr(self.backend, method)(*args)


class RemoteBackend:
    """What `run_cycles` sees of a backend served by a `RolloutServer` actor: the same calls, through Ray."""

    FORWARDED = ("cold_start", "generate", "sync_policy", "environment", "teardown", "teardown_report",
                 "sleep", "wake_up")
    remote = True

    def __init__(self, handle: Any, name: str, rollout_where: dict[str, Any], gpus: float):
        self.handle, self.name, self.rollout_where, self.gpus = handle, name, rollout_where, gpus
        self._device = None

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(self.handle.call.remote(method, *args))

    @property
    def device(self) -> Any:
        """The trainer's device for the work the backend's would do: the same GPU (index 0 of what Ray
        made visible to both actors), or the CPU."""
        import ray
        import torch

        if self._device is None:
            served = ray.get(self.handle.device.remote())
            self._device = torch.device("cuda", 0) if served.startswith("cuda") else torch.device(served)
        return self._device

    def placement(self) -> dict[str, Any]:
        return {"kind": "ray", "gpus_per_cycle": 1, "gpu_share_each": self.gpus,
                "rollout_actor": self.rollout_where, "trainer": _where()}

    def cold_start(self):
        return self._call("cold_start")

    def generate(self, requests):
        return self._call("generate", requests)

    def sync_policy(self, policy):
        return self._call("sync_policy", policy)

    def environment(self):
        return self._call("environment")

    def teardown(self):
        return self._call("teardown")

    def teardown_report(self):
        return self._call("teardown_report")

    def sleep(self, level):
        return self._call("sleep", level)

    def wake_up(self):
        return self._call("wake_up")


def _train(cycle_params: str, handle: Any, backend_name: str, rollout_where: dict[str, Any], gpus: float,
           run: dict[str, Any], threads: int) -> str:
    """The trainer task: the measured cycle loop with the remote backend, on the driver's CPU threads; both
    processes counted."""
    import torch

    from rollout_lib.measure.cycle import run_cycles
    from rollout_lib.measure.memory import counted_processes
    from rollout_lib.study.cycle import load

    torch.set_num_threads(threads)
    backend = RemoteBackend(handle, backend_name, rollout_where, gpus)
    with counted_processes({int(rollout_where["pid"]): "rollout actor"}):
        return str(run_cycles(load(cycle_params), backend_name, backend=backend, **run))


def run_cycles_on_ray(cycle_params: str, backend_name: str, algorithm: str, cell_id: str, campaign: str, *,
                      address: str | None = None, gpus: int = 1, run_id: str | None = None,
                      output_dir: Path, device: str | None = None, cache_dir: str | None = None,
                      backend_options: dict[str, Any] | None = None, cycles: int | None = None,
                      vllm_memory_mode: str | None = None) -> Path:
    """One cycle run with the backend and the trainer as two Ray actors (see the module docstring); returns
    the sealed raw file, as `run_cycles` does."""
    import torch

    from rollout_lib.measure.cycle import cycle_backend_options
    from rollout_lib.study.cycle import load

    if gpus != 1:
        raise ValueError(f"gpus: {gpus} is not allowed with --placement ray; allowed: 1 (two GPUs per cycle would "
                         "leave the rollout GPU's memory unmeasured)")
    cycle_params = str(Path(cycle_params).resolve())  # the actors' working directory is Ray's, not ours
    cache_dir = str(Path(cache_dir).resolve()) if cache_dir else None
    study = load(cycle_params)
    if backend_name not in study.backends:  # refused before Ray starts anything
        raise ValueError(f"backend {backend_name!r} is not in the cycle study; allowed: {', '.join(study.backends)}")
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}})
    options = cycle_backend_options(study, backend_name, cache_dir, device, vllm_memory_mode, backend_options)
    threads = torch.get_num_threads()  # what a one-process run here would use
    server = ray.remote(num_gpus=GPU_SHARE_ONE_GPU, max_restarts=0)(RolloutServer).remote(
        cycle_params, backend_name, options, threads)
    try:
        rollout_where = ray.get(server.where.remote())
        run = {"algorithm": algorithm, "cell_id": cell_id, "campaign": campaign, "run_id": run_id,
               "output_dir": Path(output_dir).resolve(), "device": device, "cache_dir": cache_dir,
               "backend_options": backend_options, "cycles": cycles, "vllm_memory_mode": vllm_memory_mode}
        trainer = ray.remote(num_gpus=GPU_SHARE_ONE_GPU, max_retries=0)(_train)
        return Path(ray.get(trainer.remote(cycle_params, server, backend_name, rollout_where,
                                           GPU_SHARE_ONE_GPU, run, threads)))
    finally:
        ray.kill(server)
        if started:
            ray.shutdown()
