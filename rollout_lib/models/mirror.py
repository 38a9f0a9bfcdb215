"""A float32 serving mirror of the NF4 actor, for the precision ladder's float32 rung (issue 13).

The preregistered mirror (`actor.write_mirror_snapshot`) holds the dequantized NF4 projections
rounded to bf16. A float32 engine serving that file would still carry bf16 weight rounding against
the float32 actor, so rung (c) "both sides in float32" serves the float32 dequantization instead.
(A separate function, not a dtype argument of the original: actor.py is part of the frozen oracle
measurement code until campaign h200-v2's oracle cells are complete.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rollout_lib.core import build_directory_once
from rollout_lib.models.actor import dequantized_linear_weights, load_nf4_base
from rollout_lib.study.prereg import QuantizationSpec


def write_float32_mirror(snapshot_dir: str, quant: QuantizationSpec, out_dir: str | Path, device: str) -> str:
    """An HF snapshot whose projections are the float32 dequantized NF4 weights and whose other
    tensors are the actor snapshot's, upcast to float32 (exact). Returns its payload digest."""
    import torch
    from safetensors.torch import save_file

    from rollout_lib.models.synthetic import payload_digest_of_tensors, read_snapshot_tensors

    out = Path(out_dir)
    tensors = {k: v.to(torch.float32) for k, v in read_snapshot_tensors(snapshot_dir).items()}
    nf4 = load_nf4_base(snapshot_dir, quant, torch.float32, device)
    for name, weight in dequantized_linear_weights(nf4).items():
        key = f"{name}.weight"
        if key not in tensors or tuple(tensors[key].shape) != tuple(weight.shape):
            raise RuntimeError(f"{key}: no matching tensor in {snapshot_dir}")
        tensors[key] = weight.to("cpu", torch.float32).contiguous()
    del nf4
    digest = payload_digest_of_tensors(tensors)

    def build(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(snapshot_dir) / name, tmp / name)
        (tmp / "rollout_mirror.json").write_text(f'{{"mirror_payload_digest": "{digest}", "dtype": "float32", '
                                                 f'"source": "{snapshot_dir}"}}\n')

    build_directory_once(out, build)
    return digest
