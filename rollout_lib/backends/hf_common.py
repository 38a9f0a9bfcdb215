"""Shared plumbing of the two Hugging Face backends: device, dtype, snapshot, budget, identity."""

from __future__ import annotations

from typing import Any

from rollout_lib.backends.base import Backend
from rollout_lib.backends.decode import synchronize
from rollout_lib.models.actor import DTYPES, torch_dtype
from rollout_lib.models.local_snapshot import check_prompt_ids, resolve_model_snapshot
from rollout_lib.models.policy import PolicyIdentityMismatch, PolicyVersion, policy_identity, read_policy_from_peft
from rollout_lib.study.arch import get_architecture
from rollout_lib.study.workload import Workload


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class HFBackendBase(Backend):
    """Options: device ('cuda'/'cpu', default: cuda when present), compute_dtype ('bfloat16' or
    'float32'; default: the preregistered NF4 compute dtype), cache_dir (snapshot cache)."""

    allowed_options = ("device", "compute_dtype", "cache_dir")

    def __init__(self, study, **options: Any):
        unknown = sorted(set(options) - set(self.allowed_options))
        if unknown:
            raise ValueError(f"{self.name}: unknown option {unknown[0]!r}; allowed: {', '.join(self.allowed_options)}")
        super().__init__(study, **options)
        import torch

        device = torch.device(options.get("device") or default_device())
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # memory APIs need an index
        self.device = device
        dtype_name = options.get("compute_dtype") or study.actor.quantization.compute_dtype
        if dtype_name not in DTYPES:
            raise ValueError(f"{self.name}: compute_dtype {dtype_name!r} is not allowed; allowed: {', '.join(DTYPES)}")
        self.compute_dtype_name = dtype_name
        self.compute_dtype = torch_dtype(dtype_name)
        self.arch = get_architecture(study.actor.architecture.name)
        self.pad_id = self.arch.bos_token_id
        self.snapshot = None
        self.budget_fraction: float | None = None

    def _load_snapshot(self) -> str:
        self.snapshot = resolve_model_snapshot(self.study.actor, cache_dir=self.options.get("cache_dir"),
                                               study_path=self.study.source_path)
        if self.study.actor.source == "snapshot":  # a real vocabulary: every prompt id must be inside it
            check_prompt_ids(Workload(self.study), self.snapshot)
        return self.snapshot.path

    def _apply_memory_budget(self) -> None:
        """Emulate the study's 16 GiB card on a larger GPU (per-process fraction for torch)."""
        import torch

        if self.device.type != "cuda" or not self.study.memory.enforce_budget_on_larger_gpus:
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        if total > self.study.memory.budget_bytes:
            self.budget_fraction = self.study.memory.budget_bytes / total
            torch.cuda.set_per_process_memory_fraction(self.budget_fraction, self.device)

    def _synchronize(self) -> None:
        synchronize(self.device)

    def _served_identity(self, model, requested: PolicyVersion) -> str:
        identity = policy_identity(requested.base_digest, read_policy_from_peft(model))
        if identity != requested.identity:
            raise PolicyIdentityMismatch(f"{self.name} serves identity {identity}, policy version "
                                         f"{requested.version} is {requested.identity}")
        return identity

    def _require_policy(self) -> str:
        if self.served_identity is None:
            raise RuntimeError(f"{self.name}: generate() before sync_policy(): no policy version is being served")
        return self.served_identity

    def _stop(self) -> None:
        import gc

        import torch

        for attribute in ("model", "actor", "mirror"):
            if hasattr(self, attribute):
                setattr(self, attribute, None)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def environment(self) -> dict[str, Any]:
        return {"device": str(self.device), "compute_dtype": self.compute_dtype_name,
                "attn_implementation": "sdpa", "memory_budget_fraction": self.budget_fraction,
                "snapshot_digest": self.snapshot.payload_digest if self.snapshot else None}
