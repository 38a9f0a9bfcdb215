"""Merged policy weights: W + s * B @ A for every LoRA target, in the serving dtype.

The alternative to serving the live LoRA tensors as an adapter (issue 13): an engine that serves
merged weights pays no LoRA cost per token, but what it holds is no longer the actor's tensors. The
merge adds the float32 low-rank product to the mirror's exact dequantized projection in float32
and rounds once to the mirror's dtype; the merged tensors get their own identity (never the
policy's), so a raw file can never mistake them for the exact policy.

Written as a safetensors file holding only the merged projections (canonical HF names), which an
engine reloads in place (vLLM 0.26: `reload_weights(weights_path=...)`); every other tensor stays
as the engine loaded it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_lib.core import build_directory_once

if TYPE_CHECKING:
    import torch

    from rollout_lib.models.policy import PolicyVersion

MERGED_FILE = "model.safetensors"
MARKER = "rollout_merged.json"


def read_projection_weights(model_dir: str | Path, targets: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The LoRA-targeted projection weights of a snapshot (canonical `<module>.weight` names)."""
    from safetensors import safe_open

    out = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key.endswith(".weight") and key.rsplit(".", 2)[-2] in targets:
                    out[key] = handle.get_tensor(key)
    if not out:
        raise ValueError(f"{model_dir}: no weights of the LoRA targets {', '.join(targets)}")
    return out


def merge_policy(base: dict[str, torch.Tensor], policy: PolicyVersion, device: str = "cpu") -> dict[str, torch.Tensor]:
    """{`<module>.weight`: (W.float() + scaling * B @ A).to(W.dtype)} for every module the policy adapts."""
    import torch

    tensors = policy.tensors
    out = {}
    for key_a in sorted(k for k in tensors if k.endswith(".lora_A")):
        module = key_a[: -len(".lora_A")]
        weight_key = f"{module}.weight"
        if weight_key not in base:
            raise ValueError(f"{weight_key}: the policy adapts a module the base weights do not hold")
        weight = base[weight_key]
        a = tensors[key_a].to(device, torch.float32)
        b = tensors[f"{module}.lora_B"].to(device, torch.float32)
        merged = weight.to(device, torch.float32) + policy.scaling * (b @ a)
        out[weight_key] = merged.to(weight.dtype).to("cpu").contiguous()
    return out


def merged_identity(base_digest: str, merged: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the merged tensors (names, dtypes, shapes, bytes) over the base snapshot digest."""
    from rollout_lib.models.synthetic import update_with_tensor

    digest = hashlib.sha256(b"rollout-runtime-v2/merged-weights/v1\n")
    digest.update(base_digest.encode())
    for name in sorted(merged):
        update_with_tensor(digest, name, merged[name])
    return digest.hexdigest()


def write_merged(merged: dict[str, torch.Tensor], folder: str | Path, identity: str, policy_identity: str) -> Path:
    """The merged projections as one safetensors file (written once: a folder per identity)."""
    from safetensors.torch import save_file

    out = Path(folder)

    def build(tmp: Path) -> None:
        save_file(merged, str(tmp / MERGED_FILE), metadata={"format": "pt"})
        (tmp / MARKER).write_text(json.dumps({"merged_identity": identity, "policy_identity": policy_identity,
                                              "tensors": len(merged)}, sort_keys=True) + "\n")

    build_directory_once(out, build)
    return out
