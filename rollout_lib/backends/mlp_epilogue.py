"""GATE_UP_EPILOGUE "triton" (issue 43 candidate): everything between the gate_up GEMM and the down GEMM of a layer
as one hand-written Triton kernel, with the LoRA shrink in the base GEMM (LORA_SHRINK "in_base_gemm").

Why (lease 33's trace of the picked engine, one layer at 4 rows on the H200): between the gate_up GEMM and the
down GEMM inductor launches two kernels, the gate_up expand reduction (1.9 us) and the SiLU product (1.2 us), each
with ~0.5 us of gap before it. Both sit between two opaque cuBLAS GEMMs, so one kernel in their place takes no
fusion from inductor (the Triton expand of lease 32 did: it sat between inductor's kernels). This is the first of
the four epilogues the step's gaps between GEMMs could each be (docs/perf-notes.md, "Open candidates").

The kernel reads the gate_up GEMM's float32 output `both` [rows, 2 I + 3 x 2 r] (W_gate; W_up; then A's three bf16
parts for gate's and up's ranks, as `_write_shrink_rows` appends them) and B [2 I, 2 r] (block-diagonal: gate's
rows use columns 0..r-1, up's r..2r-1). Per output feature n of the intermediate (I) and row m, as `_fused_linear`
and `_after_attention` compute it:
    base_g = bf16(both[m, n]), base_u = bf16(both[m, I + n])        (the base GEMM rounded as `linear` rounds it)
    xa[m, k] = (part0 + part1) + part2                              (the shrink's three parts, in order, float32)
    low_g = sum_k xa[m, k] B[n, k]        (k < r: gate's own terms; float32, an IEEE product, no TF32)
    low_u = sum_k xa[m, r + k] B[I + n, r + k]
    gate = bf16(float32(base_g) + scaling low_g), up likewise      (lora_add "float32_once"; or the oracle's
                                                                     rounding: bf16(base + bf16(scaling low)))
    out = bf16(bf16(silu(gate)) * up)                               (torch's bf16 SiLU, then the bf16 product)
The same float32 products as the engine's, summed in another order (the reduction's order is inductor's; the
other part's exact zeros are skipped, which adds nothing), and SiLU's float32 sigmoid computed by Triton: the
values are within a rounding or two of the default engine's, and its greedy tokens part only at near-ties (the
GPU test). One program per BLOCK_N features of BLOCK_M rows (any row count: a prefill's too), one launch
configuration, nothing drawn. CUDA, or a CPU in Triton's interpreter (tests)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BLOCK_M = 16  # rows per program
BLOCK_N = 32  # intermediate features per program (lease 36 bench, H100: 2.1-2.3 us at 32 x 8 warps, 2.3-2.5 at 64 x 4)
WARPS = 8

_OP = None  # the op, read by the compiled pieces as a global (dynamo does not trace into a functools.cache)


lora_add = None  # the LoRA add's two roundings, a Triton function (triton_jit.lora_add), set by _kernel()
gate_up_b = None  # gate's and up's B tiles, a Triton function, set by _kernel()


@functools.cache
def _kernel():
    """The Triton kernel, defined once per process."""
    import triton
    import triton.language as tl

    from rollout_lib.backends import triton_jit

    global lora_add, gate_up_b  # globals: Triton's interpreter reads a kernel's globals, not its closure
    lora_add = triton_jit.lora_add

    @triton.jit
    def b_tiles(b_ptr, n, keep_n, inter, b_row, b_col, RANK: tl.constexpr, RANK_BLOCK: tl.constexpr):
        """Gate's and up's B tiles for the features `n` [RANK_BLOCK, len(n)] each, float32: every rank term of a
        part in one load, all in flight at once (lease 35: loaded term by term, the kernel waited out one memory
        round trip after another, 7.6 us a call); each part's own terms (the other part's are zeros, skipped)."""
        k = tl.arange(0, RANK_BLOCK)
        keep_kn = (k < RANK)[:, None] & keep_n[None, :]
        b_g = tl.load(b_ptr + n[None, :] * b_row + k[:, None] * b_col, mask=keep_kn, other=0.0)
        b_u = tl.load(b_ptr + (inter + n)[None, :] * b_row + (RANK + k)[:, None] * b_col, mask=keep_kn, other=0.0)
        return b_g, b_u

    gate_up_b = b_tiles

    @triton.jit(do_not_specialize=["rows"])
    def gate_up_epilogue_kernel(both_ptr, b_ptr, out_ptr, rows, inter, both_row, b_row, b_col, out_row, scaling,
                                RANK: tl.constexpr, LOW: tl.constexpr, ACTIVATION: tl.constexpr,
                                ORACLE_ROUNDING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                RANK_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        keep_n, keep_m = n < inter, m < rows
        keep = keep_m[:, None] & keep_n[None, :]
        if PDL:  # DEPENDENT_LAUNCH "epilogues": B (no kernel of the step writes it) before waiting for the GEMM
            b_g, b_u = gate_up_b(b_ptr, n, keep_n, inter, b_row, b_col, RANK, RANK_BLOCK)
            tl.extra.cuda.gdc_wait()  # then what the GEMM and the kernels before it wrote
        row = both_ptr + m * both_row
        base_g = tl.load(row[:, None] + n[None, :], mask=keep, other=0.0).to(tl.bfloat16)
        base_u = tl.load(row[:, None] + (inter + n)[None, :], mask=keep, other=0.0).to(tl.bfloat16)
        shrink = row + 2 * inter  # A's parts after the base rows: part p, rank column j at p * LOW + j
        k = tl.arange(0, RANK_BLOCK)
        has_k = k < RANK
        at = shrink[:, None] + k[None, :]
        keep_mk = keep_m[:, None] & has_k[None, :]
        xa_g = (tl.load(at, mask=keep_mk, other=0.0) + tl.load(at + LOW, mask=keep_mk, other=0.0)) \
            + tl.load(at + 2 * LOW, mask=keep_mk, other=0.0)
        xa_u = (tl.load(at + RANK, mask=keep_mk, other=0.0) + tl.load(at + LOW + RANK, mask=keep_mk, other=0.0)) \
            + tl.load(at + 2 * LOW + RANK, mask=keep_mk, other=0.0)
        if not PDL:
            b_g, b_u = gate_up_b(b_ptr, n, keep_n, inter, b_row, b_col, RANK, RANK_BLOCK)
        # the rank's sum as an exact float32 product (no TF32): gate's own terms, then up's
        low_g = tl.dot(xa_g, b_g, input_precision="ieee")
        low_u = tl.dot(xa_u, b_u, input_precision="ieee")
        gate = lora_add(base_g, low_g, scaling, ORACLE_ROUNDING)
        up = lora_add(base_u, low_u, scaling, ORACLE_ROUNDING)
        if ACTIVATION:
            g = gate.to(tl.float32)
            silu = (g * tl.sigmoid(g)).to(tl.bfloat16)
            out = (silu.to(tl.float32) * up.to(tl.float32)).to(tl.bfloat16)
            tl.store(out_ptr + m[:, None] * out_row + n[None, :], out, mask=keep)
        else:  # gate and up as `_fused_linear` returns them (tests: the roundings before SiLU)
            tl.store(out_ptr + m[:, None] * out_row + n[None, :], gate, mask=keep)
            tl.store(out_ptr + m[:, None] * out_row + (inter + n)[None, :], up, mask=keep)

    return gate_up_epilogue_kernel


def launch(both: torch.Tensor, lora_b: torch.Tensor, scaling: float, inter: int, oracle_rounding: bool = False,
           activation: bool = True, block_n: int | None = None, warps: int | None = None,
           pdl: bool = False) -> torch.Tensor:
    """The kernel on `both` [rows, 2 inter + 3 x 2 rank] float32 (last dimension contiguous) and B [2 inter,
    2 rank] float32 (any strides): bf16 [rows, inter] (the SiLU product), or [rows, 2 inter] (gate and up, with
    `activation` False). `block_n`, `warps`: features per program and warps (default BLOCK_N, WARPS;
    tools/lab/epilogue_bench.py times others). `pdl` (DEPENDENT_LAUNCH "epilogues", sm_90): launched with
    programmatic dependent launch, B loaded before the kernel waits for the GEMM before it."""
    import torch
    import triton

    rows, width = both.shape
    low = lora_b.shape[1]  # both parts' ranks: 2 r
    if lora_b.shape[0] != 2 * inter or low % 2 or width != 2 * inter + 3 * low:
        raise ValueError(f"GATE_UP_EPILOGUE triton: the GEMM output {tuple(both.shape)} and B {tuple(lora_b.shape)} "
                         f"are not a gate_up projection of {inter} features with its shrink's rows")
    out = torch.empty((rows, inter if activation else 2 * inter), dtype=torch.bfloat16, device=both.device)
    block_n = block_n or BLOCK_N
    _kernel()[(triton.cdiv(inter, block_n), triton.cdiv(rows, BLOCK_M))](
        both, lora_b, out, rows, inter, both.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        float(scaling), RANK=low // 2, LOW=low, ACTIVATION=activation, ORACLE_ROUNDING=oracle_rounding,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        RANK_BLOCK=max(16, triton.next_power_of_2(low // 2)), PDL=pdl, num_warps=warps or WARPS, launch_pdl=pdl)
    return out


def _op():
    """The custom op `rollout::gate_up_epilogue`, registered once per process: the kernel behind an opaque op with
    a shape-only fake, so a compiled piece calls it as it calls a cuBLAS GEMM and inductor chooses nothing for it."""
    global _OP
    if _OP is None:
        import torch

        from rollout_lib.backends.triton_ops import opaque_op, pdl_for_rows

        _OP = opaque_op("rollout::gate_up_epilogue",
                        lambda both, lora_b, scaling, inter, oracle_rounding, pdl_from_rows: launch(
                            both, lora_b, scaling, inter, oracle_rounding,
                            pdl=pdl_for_rows(pdl_from_rows, both.shape[0])),
                        lambda both, lora_b, scaling, inter, oracle_rounding, pdl_from_rows: both.new_empty(
                            (both.shape[0], inter), dtype=torch.bfloat16),
                        {"both": torch.Tensor, "lora_b": torch.Tensor, "scaling": float, "inter": int,
                         "oracle_rounding": bool, "pdl_from_rows": int})
    return _OP


def prepare() -> None:
    """The op registered and the kernel defined now, outside any compiled trace or capture (engine construction)."""
    _op()
    _kernel()


def gate_up_activation(both: torch.Tensor, lora_b: torch.Tensor, scaling: float, inter: int,
                       oracle_rounding: bool = False, pdl_from_rows: int = 0) -> torch.Tensor:
    """The SiLU product of the gate_up projection from its GEMM's float32 output (see the module): `both` [...,
    2 inter + 3 x 2 rank] -> bf16 [..., inter], through the op. `pdl_from_rows`: launched with PDL (`launch`'s
    `pdl`) when the call has at least that many rows, 0 never."""
    rows = both.reshape(-1, both.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = (_OP or _op())(rows, lora_b, float(scaling), int(inter), bool(oracle_rounding), int(pdl_from_rows))
    return out.reshape(*both.shape[:-1], inter)
