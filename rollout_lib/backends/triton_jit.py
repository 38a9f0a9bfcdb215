"""Triton functions the epilogue kernels share. This module imports Triton when it is imported: only a kernel's
definition imports it (`_kernel()` of mlp_epilogue, norm_epilogue, qkv_epilogue), where Triton is required anyway.
Module-level functions, so Triton's interpreter (which reads a function's globals, not its closure) finds
`tl` here and a kernel finds them as its module's globals."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lora_add(base, low, scaling, ORACLE_ROUNDING: tl.constexpr):
    """base (bf16) plus the LoRA term scaling x low (float32), as the engine's `lora_add` adds them.
    "float32_once": added in float32, rounded to bf16 once; "bf16_like_nf4_oracle" (ORACLE_ROUNDING): the term
    rounded to bf16 first, then added as torch adds two bf16 tensors (in float32, rounded)."""
    if ORACLE_ROUNDING:
        return (base.to(tl.float32) + (low * scaling).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
    else:
        return (base.to(tl.float32) + low * scaling).to(tl.bfloat16)
