"""Policy versions: deterministic LoRA updates and their identities.

An RL loop changes the actor's LoRA tensors at every optimizer step; a rollout backend must serve
exactly the current version. Version k (1..N) is k deterministic "optimizer steps" from the
preregistered seed: A starts at peft's kaiming-uniform bound 1/sqrt(in_features) and B at zero, then
each step adds uniform noise of the preregistered standard deviations to every A and B.

Identity = SHA-256 over the base payload digest and every LoRA tensor in canonical name order
(name, dtype, shape, bytes). A backend computes the identity from the tensors it actually holds
after a sync; serving anything else is an error (`PolicyIdentityMismatch`), never a warning.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from rollout_lib.models.synthetic import update_with_tensor
from rollout_lib.study.arch import Qwen3Arch
from rollout_lib.study.seeds import tensor_stream

if TYPE_CHECKING:
    import torch

    from rollout_lib.study.prereg import LoraSpec

# peft's module path of each target inside a Qwen3 decoder layer
_TARGET_PATHS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                 "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                 "down_proj": "mlp.down_proj"}


class PolicyIdentityMismatch(RuntimeError):
    """A backend serves other LoRA tensors than the policy version it was asked to serve."""


def lora_tensor_names(arch: Qwen3Arch, lora: LoraSpec) -> dict[str, tuple[int, ...]]:
    """Canonical names (`model.layers.3.self_attn.q_proj.lora_A`) and shapes of every LoRA tensor."""
    shapes = arch.linear_shapes()
    out: dict[str, tuple[int, ...]] = {}
    for layer in range(arch.num_hidden_layers):
        for target in lora.target_modules:
            module = _TARGET_PATHS[target]
            out_features, in_features = shapes[module]
            base = f"model.layers.{layer}.{module}"
            out[f"{base}.lora_A"] = (lora.rank, in_features)
            out[f"{base}.lora_B"] = (out_features, lora.rank)
    return out


def policy_identity(base_digest: str, tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(b"rollout-runtime-v2/policy/v1\n")
    digest.update(base_digest.encode())
    for name in sorted(tensors):
        update_with_tensor(digest, name, tensors[name])
    return digest.hexdigest()


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    base_digest: str
    arch: Qwen3Arch
    lora: LoraSpec

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        """float32 CPU tensors, canonical names. Deterministic on any machine (see models.py)."""
        import torch

        out = {}
        for name, shape in lora_tensor_names(self.arch, self.lora).items():
            if name.endswith("lora_A"):
                bound = 1.0 / math.sqrt(shape[1])
                value = tensor_stream(self.lora.seed, f"{name}/init").random(math.prod(shape)) * 2 * bound - bound
                std = self.lora.update_std_a
            else:
                value = np.zeros(math.prod(shape))
                std = self.lora.update_std_b
            for step in range(1, self.version + 1):
                if std > 0:
                    noise = tensor_stream(self.lora.seed, f"{name}/step{step}").random(value.size)
                    value = value + (noise * 2.0 - 1.0) * (std * math.sqrt(3.0))
            out[name] = torch.from_numpy(value.astype(np.float32).reshape(shape))
        return out

    @cached_property
    def identity(self) -> str:
        return policy_identity(self.base_digest, self.tensors)

    @property
    def scaling(self) -> float:
        return self.lora.alpha / self.lora.rank


def policy_versions(arch: Qwen3Arch, lora: LoraSpec, base_digest: str, count: int) -> list[PolicyVersion]:
    return [PolicyVersion(version=k, base_digest=base_digest, arch=arch, lora=lora) for k in range(1, count + 1)]


# --------------------------------------------------------------------------------------------
# Moving tensors in and out of peft models
# --------------------------------------------------------------------------------------------

def _peft_lora_modules(model) -> dict[str, object]:
    """Canonical module path (`model.layers.0.self_attn.q_proj`) -> peft LoRA layer."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            # peft paths look like base_model.model.model.layers.0.self_attn.q_proj
            canonical = name.split("base_model.model.", 1)[-1]
            out[canonical] = module
    return out


def copy_lora_tensors(model, tensors: dict[str, torch.Tensor], scaling: float, adapter: str = "default") -> None:
    """Copy exact tensors (canonical names) into a peft model's live LoRA weights; the module set,
    dtypes and scaling must match (a mismatch is an error, never a cast)."""
    import torch

    modules = _peft_lora_modules(model)
    expected = {name.rsplit(".", 1)[0] for name in tensors}
    if set(modules) != expected:
        missing = sorted(expected - set(modules))[:3]
        extra = sorted(set(modules) - expected)[:3]
        raise PolicyIdentityMismatch(f"LoRA modules differ from the policy: missing {missing}, extra {extra}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            path, which = name.rsplit(".", 1)
            layer = getattr(modules[path], which)[adapter]
            if layer.weight.dtype != tensor.dtype:
                raise PolicyIdentityMismatch(f"{name}: live LoRA dtype {layer.weight.dtype} != policy {tensor.dtype}")
            layer.weight.copy_(tensor.to(layer.weight.device))
        for module in modules.values():
            if module.scaling[adapter] != scaling:
                raise PolicyIdentityMismatch(f"LoRA scaling {module.scaling[adapter]} != {scaling}")


def load_policy_into_peft(model, policy: PolicyVersion, adapter: str = "default") -> None:
    """Make a policy version the model's live LoRA tensors (dtype and values preserved)."""
    copy_lora_tensors(model, policy.tensors, policy.scaling, adapter)


def read_policy_from_peft(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The live LoRA tensors, read back to CPU under canonical names (for identity checks and sync)."""
    out = {}
    for path, module in _peft_lora_modules(model).items():
        out[f"{path}.lora_A"] = module.lora_A[adapter].weight.detach().to("cpu", copy=True)
        out[f"{path}.lora_B"] = module.lora_B[adapter].weight.detach().to("cpu", copy=True)
    return out


def write_peft_adapter(policy: PolicyVersion, out_dir) -> str:
    """A peft-format LoRA adapter of the exact float32 tensors (adapter_config.json +
    adapter_model.safetensors), for engines that load adapters from disk. Returns the identity
    recomputed from the file as written (read back), which must equal the policy's."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    peft_names = {f"base_model.model.{name}.weight": tensor for name, tensor in policy.tensors.items()}
    save_file(peft_names, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"base_model_name_or_path": None, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "lora_alpha": policy.lora.alpha, "lora_dropout": policy.lora.dropout,
              "peft_type": "LORA", "r": policy.lora.rank, "target_modules": sorted(policy.lora.target_modules),
              "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    back = {name.removeprefix("base_model.model.").removesuffix(".weight"): tensor
            for name, tensor in load_file(str(out / "adapter_model.safetensors")).items()}
    identity = policy_identity(policy.base_digest, back)
    if identity != policy.identity:
        raise PolicyIdentityMismatch(f"adapter written to {out} has identity {identity}, policy {policy.identity}")
    return identity
