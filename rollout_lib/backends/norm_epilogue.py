"""O_EPILOGUE "triton" (issue 43 candidate): everything between the o GEMM and the gate_up GEMM of a layer as one
hand-written Triton kernel, with the LoRA shrink in the base GEMM (LORA_SHRINK "in_base_gemm").

Why (lease 33's trace of the picked engine, one layer at 4 rows on the H200): between the o GEMM and the gate_up
GEMM inductor launches two kernels, the o expand reduction (1.2 us, 0.9 us of gap before it) and the residual add
with the post-attention norm (1.3 us, 0.5 us of gap): two reductions of different shapes (the rank's terms per
feature, the norm's sum per row), which inductor does not merge. Between two opaque cuBLAS GEMMs one kernel in
their place takes no fusion from inductor. The second of the epilogues between GEMMs (GATE_UP_EPILOGUE is the
first; docs/perf-notes.md, "Open candidates").

The kernel reads the o GEMM's float32 output `both` [rows, H + 3 r] (W_o's H features, then A's three bf16 parts,
as `_write_shrink_rows` appends them), B [H, r], the residual stream h [rows, H] (bf16) and the norm's weight [H].
Per row m and feature n, as `_fused_linear`, `_after_attention` and `_rms` compute them:
    base = bf16(both[m, n])                                        (the base GEMM rounded as `linear` rounds it)
    xa[m, k] = (part0 + part1) + part2                             (the shrink's three parts, in order, float32)
    low = sum_k xa[m, k] B[n, k]                                   (float32, in Triton's order over k)
    o = bf16(float32(base) + scaling low)                          (lora_add "float32_once"; or the oracle's
                                                                    rounding: bf16(base + bf16(scaling low)))
    h' = bf16(h + o)                                               (the residual, as torch adds two bf16 tensors)
    x = bf16(w * bf16(h' rsqrt(mean_n h'^2 + eps)))                (Qwen3's RMSNorm: float32 statistics)
It returns h' and x stacked, [2, rows, H]. With GEMM_SPLIT_K, `both` is the GEMM's S float32 partial sums [S, rows,
H + 3 r] (one batched GEMM over S slices of K, `_split_k_partials`), added here in the engine's order ((P0 + P1) +
P2) + ... before anything else: no sum kernel of inductor's, no split-K reduction kernel of cuBLAS's. The same
float32 products and sums as the engine's in another order (the rank's and the norm's reductions are inductor's
there), rsqrt by Triton: within a rounding of the default engine's values, its greedy tokens parting only at
near-ties (the GPU test). One program per row (the norm reads
the whole row), one launch configuration, nothing drawn. CUDA, or a CPU in Triton's interpreter (tests).

NORM_EPILOGUE_ROW "slices" (issue 43 candidate, `launch(..., slices=True)`): each row split over SLICE_FEATURES-wide
slices, one program per (row, slice). Why (lease 38's bench, H100): with the L2 flushed before each call, as a
decode step's ~43 MB of weights per layer flush it, the one-program kernel takes 4.65 / 4.73 us a call at 4 / 16
rows against 2.52 / 2.59 with B in the L2 (the engine's call: 3.9): each row's program reads all of B (64 KB,
float32) alone, on one SM, at one SM's share of the bandwidth. A slice's program reads its slice of B (8 KB), writes
its slice of h' and its float32 sum of h'^2; the last of a row's programs to arrive (an atomic counter per row, as
`skinny_gemm` adds its split-K partials) adds the slices' sums in slice order, reads the whole row of h' back and
writes the row's norm, then zeroes the counter. h' is the one-program kernel's, value for value (the same
operations per feature); the norm's sum is taken in another order (slices, then their sums), so x may differ from
the one-program kernel's by a rounding where the scale lands at a bf16 boundary. The counters live in one buffer
per device (`prepare(device)`, before any capture); every launch leaves them zero. Rows above SLICE_MAX_ROWS (a
prefill, which has programs enough) run the one-program kernel."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from rollout_lib.backends.triton_ops import device_key, zeroed_counters

if TYPE_CHECKING:
    import torch

WARPS = 8  # lease 36 bench (H100): 2.5-2.7 us a call at 4-8 warps, 4.9 at 32, where the norm's row sum crosses 32 warps

SLICE_FEATURES = 128  # "slices": features per program (8 KB of B at rank 16), 8 programs a row at 1,024 features
SLICE_WARPS = 4
SLICE_MAX_ROWS = 256  # "slices": counters per device (one per row); more rows run the one-program kernel

_OP = None  # the op, read by the compiled pieces as a global (dynamo does not trace into a functools.cache)
_LOCKS: dict[str, Any] = {}  # "slices": one int32 counter per row, per device, zero between launches


lora_add = None  # the LoRA add's two roundings, a Triton function (triton_jit.lora_add), set by _residual()
residual_after = None  # h' for some features of a row, a Triton function both kernels call, set by _residual()
rank_terms = None  # B's rank terms for some features, one load, a Triton function, set by _residual()


@functools.cache
def _residual():
    """The Triton function both kernels share (h' for the features `n` of row `m`), defined once per process."""
    import triton
    import triton.language as tl

    from rollout_lib.backends import triton_jit

    global lora_add, residual_after, rank_terms  # globals: Triton's interpreter reads a kernel's globals
    lora_add = triton_jit.lora_add

    @triton.jit
    def b_rank_terms(b_ptr, n, keep, b_row, b_col, RANK: tl.constexpr, RANK_BLOCK: tl.constexpr):
        """B's rank terms for the features `n` [RANK_BLOCK, len(n)], float32, in one load: all of them in flight at
        once (loaded term by term in a loop, ptxas kept two terms' loads in flight, and the kernel waited out ~8
        memory round trips: lease 35, 5.0 us a call; the SASS load counts in docs/perf-notes.md, lease 36)."""
        r = tl.arange(0, RANK_BLOCK)
        return tl.load(b_ptr + r[:, None] * b_col + n[None, :] * b_row, mask=(r < RANK)[:, None] & keep[None, :],
                       other=0.0)

    rank_terms = b_rank_terms

    @triton.jit
    def after_projection(both_ptr, b_ptr, h_ptr, m, n, keep, hidden, split_stride, both_row, b_row, b_col, h_row,
                         scaling, RANK: tl.constexpr, SPLITS: tl.constexpr, ORACLE_ROUNDING: tl.constexpr,
                         RANK_BLOCK: tl.constexpr, b_loaded=0.0, B_LOADED: tl.constexpr = False):
        row = both_ptr + m * both_row
        total = tl.load(row + n, mask=keep, other=0.0)
        for s in tl.static_range(1, SPLITS):  # the split-K partials, in order
            total += tl.load(row + s * split_stride + n, mask=keep, other=0.0)
        base = total.to(tl.bfloat16)
        shrink = row + hidden  # A's parts after the base features: part p, rank column j at p * RANK + j
        r = tl.arange(0, RANK_BLOCK)
        has = r < RANK
        part0 = tl.load(shrink + r, mask=has, other=0.0)
        part1 = tl.load(shrink + RANK + r, mask=has, other=0.0)
        part2 = tl.load(shrink + 2 * RANK + r, mask=has, other=0.0)
        for s in tl.static_range(1, SPLITS):
            part0 += tl.load(shrink + s * split_stride + r, mask=has, other=0.0)
            part1 += tl.load(shrink + s * split_stride + RANK + r, mask=has, other=0.0)
            part2 += tl.load(shrink + s * split_stride + 2 * RANK + r, mask=has, other=0.0)
        xa = (part0 + part1) + part2
        # DEPENDENT_LAUNCH: the caller loaded B before waiting for the GEMM
        b = b_loaded if B_LOADED else rank_terms(b_ptr, n, keep, b_row, b_col, RANK, RANK_BLOCK)
        low = tl.sum(xa[:, None] * b, axis=0)
        o = lora_add(base, low, scaling, ORACLE_ROUNDING)
        h = tl.load(h_ptr + m * h_row + n, mask=keep, other=0.0)
        return (h.to(tl.float32) + o.to(tl.float32)).to(tl.bfloat16)

    residual_after = after_projection


@functools.cache
def _kernel():
    """The Triton kernel, defined once per process."""
    import triton
    import triton.language as tl

    _residual()

    @triton.jit
    def residual_norm_epilogue_kernel(both_ptr, b_ptr, h_ptr, w_ptr, out_ptr, hidden, split_stride, both_row, b_row,
                                      b_col, h_row, out_rows, out_row, scaling, eps, RANK: tl.constexpr,
                                      SPLITS: tl.constexpr, ORACLE_ROUNDING: tl.constexpr, BLOCK_H: tl.constexpr,
                                      RANK_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        m = tl.program_id(0)
        n = tl.arange(0, BLOCK_H)
        keep = n < hidden
        if PDL:  # DEPENDENT_LAUNCH "epilogues": B and the norm's weight (no kernel of the step writes them) first
            b = rank_terms(b_ptr, n, keep, b_row, b_col, RANK, RANK_BLOCK)
            weight = tl.load(w_ptr + n, mask=keep, other=0.0)
            tl.extra.cuda.gdc_wait()  # then what the GEMM and the kernels before it wrote
            after = residual_after(both_ptr, b_ptr, h_ptr, m, n, keep, hidden, split_stride, both_row, b_row, b_col,
                                   h_row, scaling, RANK, SPLITS, ORACLE_ROUNDING, RANK_BLOCK, b, True)
        else:
            after = residual_after(both_ptr, b_ptr, h_ptr, m, n, keep, hidden, split_stride, both_row, b_row, b_col,
                                   h_row, scaling, RANK, SPLITS, ORACLE_ROUNDING, RANK_BLOCK)
        tl.store(out_ptr + m * out_row + n, after, mask=keep)
        stream = after.to(tl.float32)
        scale = tl.rsqrt(tl.sum(stream * stream, axis=0) / hidden + eps)
        normed = (stream * scale).to(tl.bfloat16)
        if not PDL:
            weight = tl.load(w_ptr + n, mask=keep, other=0.0)
        x = (weight.to(tl.float32) * normed.to(tl.float32)).to(tl.bfloat16)
        tl.store(out_ptr + out_rows * out_row + m * out_row + n, x, mask=keep)

    return residual_norm_epilogue_kernel


@functools.cache
def _slices_kernel():
    """The "slices" kernel (see the module), defined once per process."""
    import triton
    import triton.language as tl

    _residual()

    @triton.jit(do_not_specialize=["out_rows"])
    def residual_norm_slices_kernel(both_ptr, b_ptr, h_ptr, w_ptr, out_ptr, sums_ptr, lock_ptr, hidden, split_stride,
                                    both_row, b_row, b_col, h_row, out_rows, out_row, scaling, eps, RANK: tl.constexpr,
                                    SPLITS: tl.constexpr, ORACLE_ROUNDING: tl.constexpr, BLOCK_N: tl.constexpr,
                                    SLICES: tl.constexpr, SLICES_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                                    RANK_BLOCK: tl.constexpr):
        m = tl.program_id(0)
        piece = tl.program_id(1)
        n = piece * BLOCK_N + tl.arange(0, BLOCK_N)
        keep = n < hidden
        after = residual_after(both_ptr, b_ptr, h_ptr, m, n, keep, hidden, split_stride, both_row, b_row, b_col,
                               h_row, scaling, RANK, SPLITS, ORACLE_ROUNDING, RANK_BLOCK)
        tl.store(out_ptr + m * out_row + n, after, mask=keep)
        stream = after.to(tl.float32)
        tl.store(sums_ptr + m * SLICES + piece, tl.sum(stream * stream, axis=0))
        # every thread's h' and the slice's sum stored before the count (the barrier), the count released at GPU
        # scope, acquired by the row's last program (it sees every slice's h' and sum): skinny_gemm's pattern
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + m, 1, sem="acq_rel", scope="gpu")
        if arrived == SLICES - 1:
            index = tl.arange(0, SLICES_BLOCK)
            sums = tl.load(sums_ptr + m * SLICES + index, mask=index < SLICES, other=0.0, cache_modifier=".cg")
            scale = tl.rsqrt(tl.sum(sums, axis=0) / hidden + eps)
            everything = tl.arange(0, BLOCK_H)
            whole = everything < hidden
            row_stream = tl.load(out_ptr + m * out_row + everything, mask=whole, other=0.0,
                                 cache_modifier=".cg").to(tl.float32)
            normed = (row_stream * scale).to(tl.bfloat16)
            weight = tl.load(w_ptr + everything, mask=whole, other=0.0)
            x = (weight.to(tl.float32) * normed.to(tl.float32)).to(tl.bfloat16)
            tl.store(out_ptr + out_rows * out_row + m * out_row + everything, x, mask=whole)
            tl.atomic_xchg(lock_ptr + m, 0)  # zero again for the next launch (or graph replay)

    return residual_norm_slices_kernel


def launch(both: torch.Tensor, lora_b: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, scaling: float,
           eps: float, oracle_rounding: bool = False, warps: int | None = None, slices: bool = False,
           slice_features: int | None = None, pdl: bool = False) -> torch.Tensor:
    """The kernel on `both` [rows, H + 3 rank] float32 (or its split-K partials [S, rows, H + 3 rank]), B [H, rank]
    float32 (any strides), h [rows, H] bf16 and the norm's weight [H] bf16 (last dimensions contiguous): bf16 [2,
    rows, H], the residual stream after the projection and its norm. `warps`: the program's warps (default WARPS,
    or SLICE_WARPS with `slices`; tools/lab/epilogue_bench.py times others). `slices`: the "slices" kernel (see the
    module; `prepare(device)` first), `slice_features` features a program (default SLICE_FEATURES). `pdl`
    (DEPENDENT_LAUNCH "epilogues", sm_90): launched with programmatic dependent launch, B and the norm's weight
    loaded before the kernel waits for the GEMM before it (`griddepcontrol.wait`); the one-program kernel only."""
    import torch
    import triton

    partials = both if both.dim() == 3 else both.unsqueeze(0)
    splits, rows, width = partials.shape
    hidden, rank = lora_b.shape
    if width != hidden + 3 * rank or tuple(h.shape) != (rows, hidden) or tuple(weight.shape) != (hidden,):
        raise ValueError(f"O_EPILOGUE triton: the GEMM output {tuple(both.shape)}, B {tuple(lora_b.shape)}, the "
                         f"residual {tuple(h.shape)} and the norm's weight {tuple(weight.shape)} are not one "
                         f"projection of {hidden} features with its shrink's rows")
    if pdl and slices:
        raise ValueError("DEPENDENT_LAUNCH epilogues: the one-program kernel only; NORM_EPILOGUE_ROW slices "
                         "(allowed with it: one_program)")
    out = torch.empty((2, rows, hidden), dtype=torch.bfloat16, device=both.device)
    if slices and 0 < rows <= SLICE_MAX_ROWS:
        key = device_key(both.device)
        if key not in _LOCKS:
            raise RuntimeError(f"NORM_EPILOGUE_ROW slices: norm_epilogue.prepare({both.device}) was not called "
                               "before use")
        block_n = slice_features or SLICE_FEATURES
        count = -(-hidden // block_n)
        sums = torch.empty((rows, count), dtype=torch.float32, device=both.device)
        _slices_kernel()[(rows, count)](
            partials, lora_b, h, weight, out, sums, _LOCKS[key], hidden, partials.stride(0), partials.stride(1),
            lora_b.stride(0), lora_b.stride(1), h.stride(0), rows, out.stride(1), float(scaling), float(eps),
            RANK=rank, SPLITS=splits, ORACLE_ROUNDING=oracle_rounding, BLOCK_N=block_n, SLICES=count,
            SLICES_BLOCK=triton.next_power_of_2(count), BLOCK_H=triton.next_power_of_2(hidden),
            RANK_BLOCK=triton.next_power_of_2(rank), num_warps=warps or SLICE_WARPS)
    elif rows:
        _kernel()[(rows,)](partials, lora_b, h, weight, out, hidden, partials.stride(0), partials.stride(1),
                           lora_b.stride(0), lora_b.stride(1), h.stride(0), rows, out.stride(1), float(scaling),
                           float(eps), RANK=rank, SPLITS=splits, ORACLE_ROUNDING=oracle_rounding,
                           BLOCK_H=triton.next_power_of_2(hidden), RANK_BLOCK=triton.next_power_of_2(rank),
                           PDL=pdl, num_warps=warps or WARPS, launch_pdl=pdl)
    return out


def _op():
    """The custom op `rollout::residual_norm_epilogue`, registered once per process: the kernel behind an opaque op
    with a shape-only fake, so a compiled piece calls it as it calls a cuBLAS GEMM and inductor chooses nothing."""
    global _OP
    if _OP is None:
        import torch

        from rollout_lib.backends.triton_ops import opaque_op, pdl_for_rows

        _OP = opaque_op("rollout::residual_norm_epilogue",
                        lambda both, lora_b, h, weight, scaling, eps, oracle_rounding, slices, pdl_from_rows: launch(
                            both, lora_b, h, weight, scaling, eps, oracle_rounding, slices=slices,
                            pdl=pdl_for_rows(pdl_from_rows, both.shape[-2])),
                        lambda both, lora_b, h, weight, scaling, eps, oracle_rounding, slices, pdl_from_rows:
                            both.new_empty((2, both.shape[-2], lora_b.shape[0]), dtype=torch.bfloat16),
                        {"both": torch.Tensor, "lora_b": torch.Tensor, "h": torch.Tensor, "weight": torch.Tensor,
                         "scaling": float, "eps": float, "oracle_rounding": bool, "slices": bool,
                         "pdl_from_rows": int})
    return _OP


def prepare(device: Any = None) -> None:
    """The op registered and the kernel defined now, outside any compiled trace or capture (engine construction);
    with `device`, the "slices" kernel too and its counters on that device, zeroed now (a buffer first allocated
    inside a capture would be zeroed only when the graph first replays)."""
    _op()
    _kernel()
    if device is not None:
        key = device_key(device)
        if key not in _LOCKS:
            _LOCKS[key] = zeroed_counters(device, SLICE_MAX_ROWS)[0]
        _slices_kernel()


def residual_and_norm(both: torch.Tensor, lora_b: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                      scaling: float, eps: float, oracle_rounding: bool = False,
                      split_partials: bool = False, slices: bool = False,
                      pdl_from_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(h', x) from the o (or down) GEMM's float32 output (see the module): `both` [..., H + 3 rank] with h's
    leading dimensions, or (`split_partials`) its split-K partials [S, rows, H + 3 rank], h [..., H] -> two bf16
    [..., H], through the op. `pdl_from_rows`: launched with PDL (`launch`'s `pdl`) when the call has at least
    that many rows, 0 never (the op sees each call's rows, so one graph bucket may have it and another not)."""
    shape = h.shape
    stream = h.reshape(-1, shape[-1])
    rows = both if split_partials else both.reshape(-1, both.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if stream.stride(-1) != 1:
        stream = stream.contiguous()
    out = (_OP or _op())(rows, lora_b, stream, weight.contiguous(), float(scaling), float(eps), bool(oracle_rounding),
                         bool(slices), int(pdl_from_rows))
    return out[0].reshape(shape), out[1].reshape(shape)
