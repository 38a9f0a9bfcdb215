"""The NF4 + LoRA actor (training source of truth) and its BF16 inference mirror.

- `load_nf4_actor`: the synthetic snapshot loaded with bitsandbytes NF4 (preregistered settings),
  wrapped with a peft LoRA adapter whose weights are float32.
- `build_mirror`: a plain (unquantized) model whose every projection holds the *exact* dequantized
  NF4 weight (`bitsandbytes.functional.dequantize_4bit`, the same values the NF4 matmul uses), with
  the same peft LoRA adapter on top. LoRA stays as separate low-rank terms rather than merged:
  merging would round W + s*B@A into bf16 at every policy version, so the mirror would no longer
  hold the exact live tensors and the rounding would differ from the actor's (which adds the
  float32 low-rank term to the NF4 matmul output). Separate terms keep identity checkable by
  reading the tensors back, and make a policy sync a 10M-parameter copy instead of a re-merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_lib.core import build_directory_once
from rollout_lib.models.synthetic import load_causal_lm

if TYPE_CHECKING:
    import torch

    from rollout_lib.study.prereg import LoraSpec, QuantizationSpec

DTYPES = ("bfloat16", "float32")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ValueError(f"compute dtype {name!r} is not allowed; allowed: {', '.join(DTYPES)}")
    return getattr(torch, name)


def _bnb_config(quant: QuantizationSpec, compute_dtype: torch.dtype):
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant.quant_type,
                              bnb_4bit_use_double_quant=quant.double_quant, bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_quant_storage=torch.uint8, llm_int8_skip_modules=list(quant.skip_modules))


def add_lora(model, lora: LoraSpec):
    """Wrap with a peft LoRA adapter; its weights are float32 (the preregistered LoRA dtype)."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    for name, param in peft_model.named_parameters():
        if "lora_" in name and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
    peft_model.eval()
    return peft_model


def load_nf4_base(snapshot_dir: str, quant: QuantizationSpec, compute_dtype: torch.dtype, device: str,
                  float32_head: bool = True):
    """The snapshot quantized to NF4 at load time. Non-quantized parts (embeddings, norms) are held in
    the compute dtype, so a float32-compute actor is float32 end to end. The head is the float32 copy
    (`use_float32_lm_head`), or with `float32_head=False` the tied bf16 embedding itself
    (`use_bf16_operand_head`: bf16 compute only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        snapshot_dir, dtype=compute_dtype, device_map={"": device}, trust_remote_code=False,
        quantization_config=_bnb_config(quant, compute_dtype), attn_implementation="sdpa")
    model.eval()
    if str(device).startswith("cpu"):
        _disable_cpu_fused_4bit(model)
    if float32_head:
        use_float32_lm_head(model)
    else:
        use_bf16_operand_head(model)
    return model


def _disable_cpu_fused_4bit(model) -> None:
    """bitsandbytes 0.50 on an AVX512-BF16 CPU repacks NF4 weights at the first eval forward and runs
    a fused kernel that casts inputs to bf16 *even with a float32 compute dtype* (seen: 1e-3 output
    differences from dequantize + linear). That would break float32 algorithmic exactness on CPU, so
    CPU runs use the portable dequantize + linear path, which is what the CUDA path does for batches."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def dequantized_linear_weights(nf4_model) -> dict[str, torch.Tensor]:
    """Module name -> exact dequantized weight of every bitsandbytes 4-bit linear layer."""
    import bitsandbytes as bnb

    out = {}
    for name, module in nf4_model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = module.weight
            out[name] = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    if not out:
        raise RuntimeError("no bitsandbytes Linear4bit layers found: the model is not NF4-quantized")
    return out


def build_mirror_base(snapshot_dir: str, nf4_model, dtype: torch.dtype, device: str):
    """A plain model from the same snapshot with every quantized projection replaced by the exact
    dequantized NF4 weight (cast to `dtype`: exact for float32; the NF4 path itself dequantizes to
    the snapshot dtype's values, so bf16 is exact too when the actor was quantized from bf16)."""
    import torch

    mirror = load_causal_lm(snapshot_dir, dtype, device)
    weights = dequantized_linear_weights(nf4_model)
    modules = dict(mirror.named_modules())
    with torch.no_grad():
        for name, weight in weights.items():
            target = modules[name].weight
            if tuple(target.shape) != tuple(weight.shape):
                raise RuntimeError(f"{name}: mirror shape {tuple(target.shape)} != NF4 {tuple(weight.shape)}")
            target.copy_(weight.to(device=target.device, dtype=dtype))
    use_float32_lm_head(mirror)
    return mirror


def use_float32_lm_head(model) -> None:
    """Compute the LM head in float32 (float32 copy of the tied weight, hidden states upcast).

    bf16 logits of this model reach 20-30, where one bf16 ulp is 0.125: rounding alone would move a
    sampled token's log-probability by up to ~0.06, six times the preregistered 0.01 tolerance. The
    preregistration (`tolerances.lm_head_compute_dtype: float32`) therefore fixes float32 logits on
    every HF path, oracle scorer included. Breaks the embedding tie: inference only.
    """
    import torch
    from torch import nn

    head = model.get_output_embeddings()
    if getattr(head, "is_float32_lm_head", False):
        return

    class _Head(nn.Module):
        is_float32_lm_head = True

        def __init__(self, weight: torch.Tensor):
            super().__init__()
            self.weight = nn.Parameter(weight.detach().to(torch.float32).clone(), requires_grad=False)

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(hidden.to(torch.float32), self.weight)

    model.config.tie_word_embeddings = False
    model.set_output_embeddings(_Head(head.weight))


def mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with float32 products and sums of bf16 operands: cuBLAS's bf16 GEMM with a float32 output on
    CUDA (tensor cores); elsewhere the same arithmetic as a float32 matmul of the exact upcasts."""
    import torch

    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def bmm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`mm_float32` for a batch of matrices [S, M, K] @ [S, K, N]: cuBLAS's strided batched bf16 GEMM with a
    float32 output on CUDA (the operands may be strided views, as `torch.bmm` takes them: no copy); elsewhere,
    or for float32 operands, a float32 batched matmul of the exact upcasts."""
    import torch

    if a.is_cuda and a.dtype == torch.bfloat16:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def use_bf16_operand_head(model) -> None:
    """The float32 head without its float32 copy (issue 41): logits are the float32 sums of the exact
    products of bf16 hidden states and the tied bf16 embedding, the arithmetic `use_float32_lm_head`
    gives a bf16-compute model (its copy holds the embedding's exact upcasts), in another summation
    order. The head module holds the embedding's own Parameter, so the model keeps the tie and adds no
    bytes (a float32 copy is vocab x hidden x 4: 0.62 GB for the actor, 1.24 GB for the 1.7B teacher).
    Refused where the embedding is not bf16 or not tied to the head."""
    import torch
    from torch import nn

    head = model.get_output_embeddings()
    if getattr(head, "is_bf16_operand_head", False):
        return
    embedding = model.get_input_embeddings().weight
    if getattr(head, "is_float32_lm_head", False) or head.weight is not embedding:
        raise ValueError("bf16-operand head: the model's head is not its tied input embedding")
    if embedding.dtype != torch.bfloat16:
        raise ValueError(f"bf16-operand head: the embedding is {embedding.dtype}, not bfloat16")

    class _Head(nn.Module):
        is_bf16_operand_head = True

        def __init__(self, weight: torch.Tensor):
            super().__init__()
            self.weight = weight  # the embedding's Parameter itself: no copy

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            if hidden.dtype != torch.bfloat16:
                raise ValueError(f"bf16-operand head: hidden states are {hidden.dtype}, not bfloat16")
            flat = mm_float32(hidden.reshape(-1, hidden.shape[-1]), self.weight.t())
            return flat.reshape(*hidden.shape[:-1], flat.shape[-1])

    model.set_output_embeddings(_Head(embedding))


@dataclass
class ActorPair:
    actor: object  # peft model on the NF4 base
    mirror: object | None  # peft model on the dequantized mirror (hf_cached only)


def load_actor(snapshot_dir: str, quant: QuantizationSpec, lora: LoraSpec, compute_dtype: torch.dtype,
               device: str, with_mirror: bool = False) -> ActorPair:
    nf4 = load_nf4_base(snapshot_dir, quant, compute_dtype, device)
    mirror = build_mirror_base(snapshot_dir, nf4, compute_dtype, device) if with_mirror else None
    return ActorPair(actor=add_lora(nf4, lora), mirror=add_lora(mirror, lora) if mirror is not None else None)


# copied beside the mirror's weights: the engine reads its config and tokenizer from there (a real
# snapshot's tokenizer may come as tokenizer.json alone or with the slow tokenizer's vocab and merges)
MIRROR_REQUIRED_FILES = ("config.json",)
MIRROR_OPTIONAL_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                         "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")


def write_mirror_snapshot(snapshot_dir: str, quant: QuantizationSpec, out_dir: str | Path, device: str,
                          dtype: str = "bfloat16") -> str:
    """An HF snapshot of the serving mirror, for engines that load weights from disk (vLLM): the exact
    dequantized NF4 projections in `dtype`, the actor snapshot's other tensors (upcast, exactly, for
    float32: a float32 engine serving bf16-rounded projections would keep the rounding that the
    precision ladder's float32 rung removes), and the snapshot's config and tokenizer files.
    Returns its payload digest."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from rollout_lib.models.synthetic import payload_digest_of_tensors, read_snapshot_tensors

    if dtype not in DTYPES:
        raise ValueError(f"mirror dtype {dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
    weights_dtype = torch_dtype(dtype)
    out = Path(out_dir)
    tensors = read_snapshot_tensors(snapshot_dir)
    if dtype == "float32":
        tensors = {k: v.to(torch.float32) for k, v in tensors.items()}
    nf4 = load_nf4_base(snapshot_dir, quant, weights_dtype, device)
    for name, weight in dequantized_linear_weights(nf4).items():
        key = f"{name}.weight"
        if key not in tensors or tuple(tensors[key].shape) != tuple(weight.shape):
            raise RuntimeError(f"{key}: no matching tensor in {snapshot_dir}")
        tensors[key] = weight.to("cpu", weights_dtype).contiguous()
    del nf4
    digest = payload_digest_of_tensors(tensors)
    marker = {"mirror_payload_digest": digest, **({"dtype": dtype} if dtype != "bfloat16" else {}),
              "source": str(snapshot_dir)}

    def build(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        source = Path(snapshot_dir)
        for name in MIRROR_REQUIRED_FILES + tuple(n for n in MIRROR_OPTIONAL_FILES if (source / n).is_file()):
            shutil.copy(source / name, tmp / name)
        (tmp / "rollout_mirror.json").write_text(json.dumps(marker) + "\n")

    build_directory_once(out, build)  # concurrent shards: one atomic rename wins, the other is dropped
    return digest
