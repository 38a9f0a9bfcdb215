"""Triton functions the hand-written kernels share. This module imports Triton when it is imported: only a kernel's
definition imports it (`_kernel()` of mlp_epilogue, norm_epilogue, qkv_epilogue, decode_attention, weight_prefetch,
triton_sampler), where Triton is required anyway.
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


@triton.jit
def bulk_prefetch_l2(address, length):
    """Per element, one bulk L2 prefetch (`cp.async.bulk.prefetch.L2.global`, sm_90) of `length` bytes (int32, a
    multiple of 16) from `address` (a 64-bit address or pointer, 16-byte aligned); a zero length issues nothing (it
    is not a valid prefetch). A hint that completes on its own and writes nothing. Compiled only: Triton's
    interpreter has no inline PTX."""
    tl.inline_asm_elementwise(
        "{ .reg .pred has; setp.ne.s32 has, $2, 0; @has cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }", "=r,l,r", [address, length], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def bulk_prefetch_share(address, size, lane, lanes, ALIGN: tl.constexpr):
    """`size` bytes from `address` (ALIGN-aligned, a multiple of ALIGN) asked of the L2, split into `lanes` equal
    ALIGN-aligned chunks: each element of `lane` (int64 lane indices below `lanes`) issues one bulk prefetch of its
    chunk (a lane with nothing left issues nothing)."""
    chunk = tl.cdiv(tl.cdiv(size, lanes), ALIGN) * ALIGN
    start = lane * chunk
    length = tl.minimum(tl.maximum(size - start, 0), chunk).to(tl.int32)
    bulk_prefetch_l2(address + start, length)


@triton.jit
def bulk_prefetch_regions(table_ptr, REGIONS: tl.constexpr, lane, lanes, ALIGN: tl.constexpr):
    """The regions of `table_ptr` ([REGIONS, 2] int64: device address, bytes) asked of the L2 in the table's order,
    each shared among the lanes as `bulk_prefetch_share` shares it."""
    for index in tl.static_range(REGIONS):
        bulk_prefetch_share(tl.load(table_ptr + 2 * index), tl.load(table_ptr + 2 * index + 1), lane, lanes, ALIGN)


@triton.jit
def mix32(x, MULT_1: tl.constexpr, MULT_2: tl.constexpr):
    """`counter_noise.mix32` on uint32 values (`triton_sampler`): each product wraps modulo 2**32, the bits the masked
    int64 product keeps."""
    x = x ^ (x >> 16)
    x = x * MULT_1
    x = x ^ (x >> 15)
    x = x * MULT_2
    return x ^ (x >> 16)
