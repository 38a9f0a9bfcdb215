"""QKV_EPILOGUE "triton" (issue 43 candidate): everything between the qkv GEMM and attention as one hand-written
Triton kernel, with the LoRA shrink in the base GEMM (LORA_SHRINK "in_base_gemm") and k/v written into the caches
inside the compiled piece (CACHE_WRITE "inside").

Why (lease 33's trace of the picked engine, one layer at 4 rows on the H200): after the qkv GEMM inductor launches
four kernels, the qkv expand reduction (2.6 us), then the q and k norms with the rotary embedding and the k/v cache
writes (1.3 + 1.9 + 1.7 us), each with ~0.4 us of gap: the largest of the gaps between GEMMs (docs/perf-notes.md,
"Open candidates"; GATE_UP_EPILOGUE, O_EPILOGUE and DOWN_EPILOGUE are the others).

The kernel reads the qkv GEMM's float32 output `both` [rows, (H + 2 KV) D + 3 x 3 r] (q's H heads, k's and v's KV
heads of D features, then A's three bf16 parts, each [q's r | k's r | v's r], as `_write_shrink_rows` appends
them) and B [(H + 2 KV) D, 3 r] (block-diagonal). One program per row and head; per feature n of that head, as
`_fused_linear` and `_before_attention` compute it under inductor:
    base = bf16(both[m, n]); xa[m, k] = (part0 + part1) + part2       (the shrink's parts of the head's projection)
    x = bf16(float32(base) + scaling sum_k xa[m, k] B[n, k])          (lora_add "float32_once"; or the oracle's
                                                                       rounding: bf16(base + bf16(scaling low)))
    v: x, written into cache_v at the row's column
    q, k: y = w * bf16(x rsqrt(mean_head x^2 + eps))                  (Qwen3's q/k norm; the product in float32:
                                                                       inductor keeps no rounding between it and
                                                                       the rotary, which it fuses)
          out = bf16(y cos + rotate_half(y) sin)                      (the rotary embedding, rounded once)
          q into the grouped query rows [B, KV, G T, D] it returns; k into cache_k at the row's column
The same float32 products and sums as the engine's in another order: within a rounding of the default engine's
values, its greedy tokens parting only at near-ties (the GPU test). Its launch configuration is fixed, nothing
drawn. CUDA, or a CPU in Triton's interpreter (tests)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WARPS = 1  # lease 37 bench (H100): 2.15 / 2.39 us a call at 4 / 16 rows on 1 warp, 2.41 / 3.58 on 4, the same bits

_OP = None  # the op, read by the compiled pieces as a global (dynamo does not trace into a functools.cache)


lora_add = None  # the LoRA add's two roundings, a Triton function (triton_jit.lora_add), set by _kernel()
head_b = None  # the head's B tiles, a Triton function set by _kernel()


@functools.cache
def _kernel():
    """The Triton kernel, defined once per process."""
    import triton
    import triton.language as tl

    from rollout_lib.backends import triton_jit

    global lora_add, head_b  # globals: Triton's interpreter reads a kernel's globals, not its closure
    lora_add = triton_jit.lora_add

    @triton.jit
    def b_halves(b_ptr, first, second, column, has, b_row, b_col):
        """B's tiles for the head's two halves of features, [RANK_BLOCK, D / 2] float32 each: the head's projection's
        own rank terms (`column`, where `has`) as one load per half, all in flight at once (lease 35: loaded term by
        term in a loop, 5.4 us a call)."""
        b1 = tl.load(b_ptr + first[None, :] * b_row + column[:, None] * b_col, mask=has[:, None], other=0.0)
        b2 = tl.load(b_ptr + second[None, :] * b_row + column[:, None] * b_col, mask=has[:, None], other=0.0)
        return b1, b2

    head_b = b_halves

    @triton.jit(do_not_specialize=["length"])
    def qkv_epilogue_kernel(both_ptr, b_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, write_ptr, q_ptr, cache_k_ptr,
                            cache_v_ptr, length, both_row, b_row, b_col, cos_row, sin_row, cache_batch, cache_head,
                            cache_column, scaling, eps, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, RANK: tl.constexpr, ORACLE_ROUNDING: tl.constexpr,
                            RANK_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        m = tl.program_id(0)  # the row: batch b, position t
        slot = tl.program_id(1)  # q heads, then k's, then v's
        b, t = m // length, m % length
        part = (slot >= HEADS).to(tl.int32) + (slot >= HEADS + KV_HEADS).to(tl.int32)  # 0 q, 1 k, 2 v
        half = tl.arange(0, HEAD_DIM // 2)
        first = slot * HEAD_DIM + half  # the head's features, in two halves (the rotary pairs d and d + D / 2)
        second = first + HEAD_DIM // 2
        r = tl.arange(0, RANK_BLOCK)
        has = r < RANK
        if PDL:  # DEPENDENT_LAUNCH: B (no kernel of the step writes it) before waiting for the GEMM
            b1, b2 = head_b(b_ptr, first, second, part * RANK + r, has, b_row, b_col)
            tl.extra.cuda.gdc_wait()  # then what the GEMM and the kernels before it wrote
        row = both_ptr + m * both_row
        base1 = tl.load(row + first).to(tl.bfloat16)
        base2 = tl.load(row + second).to(tl.bfloat16)
        shrink = row + (HEADS + 2 * KV_HEADS) * HEAD_DIM  # part p, rank column j at p * 3 RANK + j
        column = part * RANK + r  # the head's projection's own rank terms
        xa = (tl.load(shrink + column, mask=has, other=0.0)
              + tl.load(shrink + 3 * RANK + column, mask=has, other=0.0)) \
            + tl.load(shrink + 6 * RANK + column, mask=has, other=0.0)
        if not PDL:
            b1, b2 = head_b(b_ptr, first, second, column, has, b_row, b_col)
        low1 = tl.sum(xa[:, None] * b1, axis=0)
        low2 = tl.sum(xa[:, None] * b2, axis=0)
        x1 = lora_add(base1, low1, scaling, ORACLE_ROUNDING)
        x2 = lora_add(base2, low2, scaling, ORACLE_ROUNDING)
        column_t = tl.load(write_ptr + t)
        if part == 2:  # v: into its cache as it is
            v_at = cache_v_ptr + b * cache_batch + (slot - HEADS - KV_HEADS) * cache_head + column_t * cache_column
            tl.store(v_at + half, x1)
            tl.store(v_at + HEAD_DIM // 2 + half, x2)
        else:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            scale = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / HEAD_DIM + eps)
            n1 = (f1 * scale).to(tl.bfloat16).to(tl.float32)
            n2 = (f2 * scale).to(tl.bfloat16).to(tl.float32)
            if part == 0:
                w1 = tl.load(q_norm_ptr + half).to(tl.float32)
                w2 = tl.load(q_norm_ptr + HEAD_DIM // 2 + half).to(tl.float32)
            else:
                w1 = tl.load(k_norm_ptr + half).to(tl.float32)
                w2 = tl.load(k_norm_ptr + HEAD_DIM // 2 + half).to(tl.float32)
            y1, y2 = w1 * n1, w2 * n2
            c1 = tl.load(cos_ptr + m * cos_row + half).to(tl.float32)
            c2 = tl.load(cos_ptr + m * cos_row + HEAD_DIM // 2 + half).to(tl.float32)
            s1 = tl.load(sin_ptr + m * sin_row + half).to(tl.float32)
            s2 = tl.load(sin_ptr + m * sin_row + HEAD_DIM // 2 + half).to(tl.float32)
            out1 = (y1 * c1 + (-y2) * s1).to(tl.bfloat16)
            out2 = (y2 * c2 + y1 * s2).to(tl.bfloat16)
            if part == 0:  # q head h of row (b, t): [B, H, T, D], viewed by the caller as [B, KV, G T, D]
                q_at = q_ptr + ((b * HEADS + slot) * length + t) * HEAD_DIM
                tl.store(q_at + half, out1)
                tl.store(q_at + HEAD_DIM // 2 + half, out2)
            else:
                k_at = cache_k_ptr + b * cache_batch + (slot - HEADS) * cache_head + column_t * cache_column
                tl.store(k_at + half, out1)
                tl.store(k_at + HEAD_DIM // 2 + half, out2)

    return qkv_epilogue_kernel


def launch(both: torch.Tensor, lora_b: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, write: torch.Tensor, heads: int,
           length: int, scaling: float, eps: float, oracle_rounding: bool = False,
           warps: int | None = None, pdl: bool = False) -> torch.Tensor:
    """The kernel on `both` [B T, (H + 2 KV) D + 9 rank] float32, B [(H + 2 KV) D, 3 rank] float32 (any strides),
    the q/k norms' weights [D], cos and sin [B T, D] bf16, the caches [B, KV, L, D] (written in place at columns
    `write` [T]; last dimension contiguous): the queries bf16 [B, KV, G T, D], as `_before_attention` returns q.
    `warps`: each program's warps (default WARPS; tools/lab/epilogue_bench.py times others). `pdl`
    (DEPENDENT_LAUNCH "epilogues_and_qkv_from_16_rows", sm_90): launched with programmatic dependent launch, B
    loaded before the kernel waits for the GEMM before it (`griddepcontrol.wait`)."""
    import torch
    import triton

    rows, width = both.shape
    kv_heads, head_dim = cache_k.shape[1], cache_k.shape[3]
    features, low = lora_b.shape
    batch = rows // length if length else 0
    if (features != (heads + 2 * kv_heads) * head_dim or low % 3 or width != features + 3 * low
            or rows != batch * length or tuple(write.shape) != (length,) or cache_k.shape != cache_v.shape
            or cache_k.shape[0] != batch or tuple(cos.shape) != (rows, head_dim) or cos.shape != sin.shape
            or head_dim % 2 or heads % kv_heads or cache_k.stride(3) != 1 or cache_v.stride() != cache_k.stride()):
        raise ValueError(f"QKV_EPILOGUE triton: the GEMM output {tuple(both.shape)}, B {tuple(lora_b.shape)}, the "
                         f"caches {tuple(cache_k.shape)}, cos {tuple(cos.shape)} and the columns "
                         f"{tuple(write.shape)} are not one qkv projection of {heads} query heads over {length} "
                         f"positions with its shrink's rows")
    q = torch.empty((batch, heads, length, head_dim), dtype=torch.bfloat16, device=both.device)
    if rows:
        _kernel()[(rows, heads + 2 * kv_heads)](
            both, lora_b, q_norm, k_norm, cos, sin, write, q, cache_k, cache_v, length, both.stride(0),
            lora_b.stride(0), lora_b.stride(1), cos.stride(0), sin.stride(0), cache_k.stride(0), cache_k.stride(1),
            cache_k.stride(2), float(scaling), float(eps), HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            RANK=low // 3, ORACLE_ROUNDING=oracle_rounding,
            RANK_BLOCK=triton.next_power_of_2(low // 3), PDL=pdl, num_warps=warps or WARPS, launch_pdl=pdl)
    return q.view(batch, kv_heads, heads // kv_heads * length, head_dim)


def _op():
    """The custom op `rollout::qkv_epilogue`, registered once per process: the kernel behind an opaque op with a
    shape-only fake that writes the two caches in place, so a compiled piece calls it as it calls a cuBLAS GEMM and
    inductor chooses nothing for it."""
    global _OP
    if _OP is None:
        import torch

        from rollout_lib.backends.triton_ops import opaque_op, pdl_for_rows

        def run(both, lora_b, q_norm, k_norm, cos, sin, cache_k, cache_v, write, heads, length, scaling, eps,
                oracle_rounding, pdl_from_rows):
            return launch(both, lora_b, q_norm, k_norm, cos, sin, cache_k, cache_v, write, heads, length, scaling,
                          eps, oracle_rounding, pdl=pdl_for_rows(pdl_from_rows, both.shape[0]))

        def shape_only(both, lora_b, q_norm, k_norm, cos, sin, cache_k, cache_v, write, heads, length, scaling, eps,
                       oracle_rounding, pdl_from_rows):
            batch, kv_heads, _, head_dim = cache_k.shape
            return both.new_empty((batch, kv_heads, heads // kv_heads * length, head_dim), dtype=torch.bfloat16)

        _OP = opaque_op("rollout::qkv_epilogue", run, shape_only,
                        {"both": torch.Tensor, "lora_b": torch.Tensor, "q_norm": torch.Tensor,
                         "k_norm": torch.Tensor, "cos": torch.Tensor, "sin": torch.Tensor, "cache_k": torch.Tensor,
                         "cache_v": torch.Tensor, "write": torch.Tensor, "heads": int, "length": int,
                         "scaling": float, "eps": float, "oracle_rounding": bool, "pdl_from_rows": int},
                        mutates=("cache_k", "cache_v"))
    return _OP


def prepare() -> None:
    """The op registered and the kernel defined now, outside any compiled trace or capture (engine construction)."""
    _op()
    _kernel()


def queries_and_cache_write(both: torch.Tensor, lora_b: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                            write: torch.Tensor, heads: int, scaling: float, eps: float,
                            oracle_rounding: bool = False, pdl_from_rows: int = 0) -> torch.Tensor:
    """q [B, KV, G T, D] from the qkv GEMM's float32 output (see the module), k and v written into the caches at
    columns `write`, through the op. cos, sin [B, T, D]. `pdl_from_rows`: launched with PDL (`launch`'s `pdl`)
    when the call has at least that many rows, 0 never."""
    length = write.shape[0]  # not int(): a prefill's length stays symbolic in a compiled piece
    rows = both.reshape(-1, both.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    cos, sin = cos.reshape(-1, cos.shape[-1]).contiguous(), sin.reshape(-1, sin.shape[-1]).contiguous()
    return (_OP or _op())(rows, lora_b, q_norm.contiguous(), k_norm.contiguous(), cos, sin, cache_k, cache_v, write,
                          int(heads), length, float(scaling), float(eps), bool(oracle_rounding),
                          int(pdl_from_rows))
