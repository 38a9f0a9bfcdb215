"""GEMM_KERNEL "triton_skinny" (issue 43 candidate): a decode step's projection GEMMs, x [rows, K] @ W^T for W
[N, K] in bf16 with a float32 output, for the 4-16 rows of a decode step, as one hand-written Triton kernel.

Why (lease 32's traces, H100, 4 rows): cuBLAS runs every projection with one kernel shape (`nvjet ... 64x8`: 64
output features per thread block), ~6 us whatever the weight's size: the o projection (4.2 MB) gets 17 thread
blocks on 132 SMs and reads its weight at 0.78 TB/s, down_proj 0.9 TB/s with cuBLAS's own split-K reduction kernel
after it; a layer's four GEMMs take ~25 us for 31.6 MB, 2.6x the weights' floor. GEMM_SPLIT_K (cuBLAS over slices
of K, the partial sums added in the next compiled kernel) cut them to 18.4 us a layer on the H200, but the adds
stayed kernels of their own.

The kernel: one program per (64 output features, slice of K). It computes the tile's [64, rows] products with
`tl.dot` over bf16 operands (x's rows padded to 16 inside the program: the MMA's smallest width), float32
accumulation; slices are chosen so that tiles x slices fill the GPU's SMs (`splits_for`). With one slice the
program stores its tile; with several, each stores its partial tile, and the last of a tile's programs to arrive
(an atomic counter per tile) adds the partials in slice order, 0, 1, ..., and stores the sum, then resets the
counter: the same float32 sums in the same order whichever program arrives last, so the result does not depend
on scheduling, with no reduction kernel after it. The counters live in one buffer per device, zeroed once before
any capture (`prepare`); every launch leaves them zero, so a CUDA graph replays it as often as it likes.

Arithmetic: float32 sums of the exact products of bf16 operands (bf16 x bf16 products are exact in float32), in
the kernel's order: the contract of `mm_float32` (cuBLAS's bf16 GEMM with a float32 output) and of GEMM_SPLIT_K,
in another order. Rows above MAX_ROWS (a prefill) and non-bf16 operands go to `mm_float32`. CUDA only, or a CPU
in Triton's interpreter (TRITON_INTERPRET=1, tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_lib.backends.triton_ops import check_launch, device_key, zeroed_counters

MAX_ROWS = 16  # the rows one program holds (the MMA's width); more rows: cuBLAS
BLOCK_N = 64   # output features per program
BLOCK_K = 128  # inner elements per loop iteration
MAX_SPLITS = 8
WARPS = 4
STAGES = 4     # loads in flight per program (Triton's software pipeline over the K loop)
LOCK_SLOTS = 4096  # counters per device: one per tile of the widest projection (4096 x 64 outputs)

_OP = None
_KERNEL = None
_LOCKS: dict[str, Any] = {}
_SMS: dict[str, int] = {}


@dataclass(frozen=True)
class Launch:
    """One launch configuration of the kernel: output features per program, inner elements per loop iteration,
    warps, software-pipeline stages, and slices of K (None: `splits_for`'s). The engine uses DEFAULT; the GEMM
    bench (`tools/lab/gemm_bench.py --sweep`) times others."""

    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    warps: int = WARPS
    stages: int = STAGES
    splits: int | None = None

    def __post_init__(self) -> None:
        check_launch({"block_n": self.block_n, "block_k": self.block_k}, self.warps, self.stages, self.splits,
                     MAX_SPLITS)

DEFAULT = Launch()


def splits_for(features: int, inner: int, multiprocessors: int, block_n: int = BLOCK_N,
               block_k: int = BLOCK_K) -> int:
    """Slices of K for a GEMM of `features` outputs over `inner`: doubled (up to MAX_SPLITS) while the tiles times
    the slices leave SMs idle and each slice keeps at least one `block_k` iteration per program; 1 when the tiles
    alone fill the GPU."""
    tiles = -(-features // block_n)
    iterations = -(-inner // block_k)
    splits = 1
    while splits < MAX_SPLITS and tiles * splits < multiprocessors and iterations >= 2 * splits:
        splits *= 2
    return splits


def prepare(device) -> None:
    """The device's counter buffer, zeroed now: before any CUDA graph capture (the engine's construction), since a
    buffer first allocated inside a capture would be zeroed only when the graph first replays."""

    key = device_key(device)
    if key not in _LOCKS:
        _LOCKS[key], _SMS[key] = zeroed_counters(device, LOCK_SLOTS)
    _op()
    _kernel()  # defined now, outside any compiled trace or capture


def _kernel():
    """The Triton kernel, defined once per process (Triton imported only where the kernel runs)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    # one compilation per projection (its K_PER_SPLIT), whatever the rows: not specialized on the row count (Triton
    # would compile 16 rows apart from 4, at the first step of that many rows, maybe inside a graph's capture)
    @triton.jit(do_not_specialize=["rows"])
    def skinny_gemm_kernel(x_ptr, w_ptr, part_ptr, out_ptr, lock_ptr, rows, features, inner, x_row, w_row,
                           out_row, K_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
        tile = tl.program_id(0)
        split = tl.program_id(1)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        keep_n, keep_m = n < features, m < rows
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        start = split * K_PER_SPLIT
        for offset in range(0, K_PER_SPLIT, BLOCK_K):  # a constant per projection (its K and slices are static)
            k = start + offset + tl.arange(0, BLOCK_K)
            keep_k = k < inner
            w = tl.load(w_ptr + n[:, None] * w_row + k[None, :], mask=keep_n[:, None] & keep_k[None, :], other=0.0)
            x = tl.load(x_ptr + m[None, :] * x_row + k[:, None], mask=keep_m[None, :] & keep_k[:, None], other=0.0)
            if INTERPRETED:  # Triton 3.5's CPU interpreter multiplies bf16 tiles as raw bits: their exact upcasts
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(w, x, acc)  # [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]: bf16 operands, float32 sums
        out = out_ptr + m[None, :] * out_row + n[:, None]
        keep = keep_n[:, None] & keep_m[None, :]
        if SPLITS == 1:
            tl.store(out, acc, mask=keep)
        else:
            within = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + m[None, :]
            tiles = tl.num_programs(0)
            tl.store(part_ptr + (split * tiles + tile) * BLOCK_N * BLOCK_M + within, acc)
            # every thread's part of the partial stored before the count (the barrier), the count released at GPU
            # scope (the partial visible to the others before it), acquired by the last (it sees every partial)
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                total = tl.load(part_ptr + tile * BLOCK_N * BLOCK_M + within, cache_modifier=".cg")
                for index in tl.static_range(1, SPLITS):
                    total += tl.load(part_ptr + (index * tiles + tile) * BLOCK_N * BLOCK_M + within,
                                     cache_modifier=".cg")
                tl.store(out, total, mask=keep)
                tl.atomic_xchg(lock_ptr + tile, 0)  # zero again for the next launch (or graph replay)

    _KERNEL = skinny_gemm_kernel
    return _KERNEL


def launch(x, weight, config: Launch = DEFAULT):
    """The kernel on x [rows <= MAX_ROWS, K] and weight [N, K] (bf16, last dimension contiguous) under `config`:
    float32 [rows, N]. `prepare(device)` first. The engine calls it through the op (`skinny_mm_float32`)."""
    import torch

    rows, inner = x.shape
    features = weight.shape[0]
    key = device_key(x.device)
    if key not in _LOCKS:
        raise RuntimeError(f"GEMM_KERNEL triton_skinny: skinny_gemm.prepare({x.device}) was not called before use")
    splits = config.splits or splits_for(features, inner, _SMS[key], config.block_n, config.block_k)
    slice_k = -(-inner // splits)
    per_split = -(-slice_k // config.block_k) * config.block_k  # whole block_k iterations per slice
    tiles = -(-features // config.block_n)
    if tiles > LOCK_SLOTS:
        raise ValueError(f"GEMM_KERNEL triton_skinny: {features} output features need {tiles} counters, more "
                         f"than {LOCK_SLOTS}")
    out = torch.empty((rows, features), dtype=torch.float32, device=x.device)
    parts = (torch.empty(splits * tiles * config.block_n * MAX_ROWS, dtype=torch.float32, device=x.device)
             if splits > 1 else out)
    _kernel()[(tiles, splits)](
        x, weight, parts, out, _LOCKS[key], rows, features, inner, x.stride(0), weight.stride(0), out.stride(0),
        K_PER_SPLIT=per_split, SPLITS=splits, BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        INTERPRETED=x.device.type == "cpu", num_warps=config.warps, num_stages=config.stages)
    return out


def _op():
    """The custom op `rollout::skinny_mm_float32`, registered once per process: the kernel (DEFAULT launch) behind
    an opaque op with a shape-only fake, so a compiled piece calls it as it calls cuBLAS and inductor chooses nothing
    for it. The op changes no input: the counters it uses are zero before and after every launch."""
    global _OP
    if _OP is None:
        import torch

        from rollout_lib.backends.triton_ops import opaque_op

        _OP = opaque_op("rollout::skinny_mm_float32", lambda x, weight: launch(x, weight),
                        lambda x, weight: x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32),
                        {"x": torch.Tensor, "weight": torch.Tensor})
    return _OP


def skinny_mm_float32(x, weight):
    """x [rows, K] @ weight[N, K]^T as float32 [rows, N] (the arithmetic of `mm_float32(x, weight.t())`, see the
    module's docstring): the Triton kernel for at most MAX_ROWS rows of bf16 operands, `mm_float32` otherwise.
    `prepare(device)` first."""
    import torch

    from rollout_lib.models.actor import mm_float32

    if x.shape[0] > MAX_ROWS or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return mm_float32(x, weight.t())
    if device_key(x.device) not in _LOCKS:
        raise RuntimeError(f"GEMM_KERNEL triton_skinny: skinny_gemm.prepare({x.device}) was not called before use")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return (_OP or _op())(x, weight)
