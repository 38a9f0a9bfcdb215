"""The memory-bandwidth floor of one decode step, to say how far a measured step is from the hardware.

A decode step must read every weight once (the tied head included: it is the embedding matrix, read in
full for the logits), the live LoRA tensors (float32), and each row's filled KV cache. At a few rows the
step's FLOPs are far below the GPU's (2 x 0.6 G multiply-adds x 16 rows is ~20 GFLOP: ~20 us on an
H200), so bytes over bandwidth is the floor; launch overhead is not counted (it is what the fast path
fights, not a property of the work). Bandwidth is the vendor's nominal HBM figure, named with its
source; a GPU without one gets `not_applicable`, never a guessed number.

    decode_step_floor(get_architecture("qwen3-0.6b"), "NVIDIA H200", rows=16, mean_cache_columns=768,
                      lora_rank=16, lora_targets=("q_proj", ...))
"""

from __future__ import annotations

from typing import Any

from rollout_lib.study.arch import Qwen3Arch
from rollout_lib.study.prereg import Preregistration
from rollout_lib.study.workload import Workload

# nominal HBM bandwidth (bytes/s), from each vendor datasheet; keyed by torch.cuda.get_device_name()
HBM_BYTES_PER_S = {
    "NVIDIA H200": 4.8e12,  # H200 SXM datasheet: 4.8 TB/s
    "NVIDIA H100 80GB HBM3": 3.35e12,  # H100 SXM datasheet: 3.35 TB/s
    "NVIDIA H100 PCIe": 2.0e12,  # H100 PCIe datasheet: 2.0 TB/s
    "NVIDIA A100-SXM4-80GB": 2.039e12,  # A100 datasheet: 2,039 GB/s
    "NVIDIA A100-SXM4-40GB": 1.555e12,  # A100 datasheet: 1,555 GB/s
    "NVIDIA GeForce RTX 4080": 7.168e11,  # RTX 4080 specifications: 716.8 GB/s
}
BANDWIDTH_SOURCE = "nominal HBM bandwidth from the vendor's datasheet"


def kv_bytes_per_column(arch: Qwen3Arch, dtype_bytes: int = 2) -> int:
    """Bytes of k and v that one row's one cache column holds over all layers."""
    return arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * dtype_bytes


def lora_bytes(arch: Qwen3Arch, rank: int, targets: tuple[str, ...], dtype_bytes: int = 4) -> int:
    """Bytes of the LoRA A [rank, in] and B [out, rank] tensors of every targeted projection (float32)."""
    shapes = {name.rsplit(".", 1)[-1]: shape for name, shape in arch.linear_shapes().items()}
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"lora targets {unknown}: not projections of {arch.name}; allowed: {sorted(shapes)}")
    per_layer = sum((shapes[t][0] + shapes[t][1]) * rank for t in targets)
    return arch.num_hidden_layers * per_layer * dtype_bytes


def decode_step_floor(arch: Qwen3Arch, gpu_name: str, rows: int, mean_cache_columns: float, lora_rank: int = 0,
                      lora_targets: tuple[str, ...] = (), weight_bytes_per_param: int = 2) -> dict[str, Any]:
    """The step's bytes and their time at the GPU's nominal bandwidth: weights alone (the issue's 0.25 ms
    for the 0.6B in bf16 on an H200) and weights + LoRA + the rows' filled KV cache (`mean_cache_columns`:
    the mean over the cell's decode steps of the columns a row has written)."""
    if rows < 1 or mean_cache_columns < 0:
        raise ValueError(f"rows {rows}, mean_cache_columns {mean_cache_columns}: rows >= 1 and columns >= 0")
    weights = arch.parameter_count() * weight_bytes_per_param
    lora = lora_bytes(arch, lora_rank, lora_targets) if lora_rank else 0
    cache = rows * mean_cache_columns * kv_bytes_per_column(arch)
    out: dict[str, Any] = {"weight_bytes": weights, "lora_bytes": lora, "kv_cache_bytes": int(cache),
                           "gpu": gpu_name}
    bandwidth = HBM_BYTES_PER_S.get(gpu_name)
    if bandwidth is None:
        return out | {"status": "not_applicable",
                      "reason": f"no nominal bandwidth for {gpu_name!r}; known: {', '.join(sorted(HBM_BYTES_PER_S))}"}
    return out | {"status": "measured", "hbm_bytes_per_s": bandwidth, "bandwidth_source": BANDWIDTH_SOURCE,
                  "weights_floor_s": weights / bandwidth,
                  "step_floor_s": (weights + lora + cache) / bandwidth}


def mean_decode_columns(prompt_tokens: int, response_tokens: int) -> float:
    """Mean filled cache columns over a cell's decode steps: step k (k = 1 .. response - 1) reads the
    prompt and the k tokens before it (the first token comes from the prefill)."""
    steps = max(response_tokens - 1, 1)
    return prompt_tokens + (steps + 1) / 2


def cell_floor(study: Preregistration, gpu_name: str, rows: int, prompt_tokens: int,
               response_tokens: int) -> dict[str, Any]:
    """`decode_step_floor` of the study's actor (its shape and live LoRA) for one cell's rows and lengths."""
    lora = study.actor.lora
    return decode_step_floor(Workload(study).arch, gpu_name, rows, mean_decode_columns(prompt_tokens, response_tokens),
                             lora.rank, tuple(lora.target_modules))


def over_floor(step_s: Any, floor: dict[str, Any]) -> float | str:
    """A measured step's multiple of its floor; `not_applicable` without a floor or a measured step."""
    if floor["status"] != "measured" or not isinstance(step_s, float):
        return "not_applicable"
    return step_s / floor["step_floor_s"]
