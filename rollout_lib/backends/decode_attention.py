"""ATTENTION_BACKEND "triton" (issue 43 candidate): a decode step's attention over the static k/v cache as one
hand-written Triton kernel, split over the cache's columns, the slices merged by the last program to finish.

Why (lease 39's traces of the picked engine, H100, 4 rows): FA3's decode attention is 6.6 us a layer plus its 1.8
us planning kernel, 0.24 ms of a 1.62 ms step, to read 0.3-1.5 MB of k/v a layer (under 0.5 us at the memory's
pace): the work is latency, not bytes. This kernel needs no plan, no combine kernel and no bias: one launch a layer.

Regime: one query position per row (a decode step), q as the grouped query rows [B, KV, G, D] (query head h =
kv G + g reads kv head kv, as SDPA and FA3 read them here), the caches [B, KV, L, D] (last dimension contiguous),
row b attending to columns min(pad[b], write) <= j <= write (the default path's mask, `_valid_columns`: the row's
padding to the column this step writes). Prefill keeps SDPA.

The kernel: one program per (row, kv head, slice of the row's columns); `splits_for` chooses the slices from the
static shapes so that the programs fill the GPU, and each program takes an equal share of the row's columns at run
time (a share of zero columns leaves an empty slice). A program keeps its G query heads as the rows of one MMA tile
(padded to 16, the MMA's smallest width) and walks its columns BLOCK_N at a time: scores q k^T as float32 sums of
the exact products of bf16 operands, scaled into base 2, the running maximum and sum (online softmax), and the
probabilities rounded to bf16 for the product with v (float32 sums), as FlashAttention does. With one slice it
divides and stores; with several, each stores its float32 partial (output, maximum, sum), and the last program of a
(row, kv head) to arrive (an atomic counter, as `skinny_gemm`'s) merges the slices in slice order 0, 1, ...: the
same float32 operations in the same order whichever program arrives last, so the result does not depend on
scheduling. Its launch configuration is fixed, nothing drawn. bf16 only; CUDA, or a CPU in Triton's interpreter
(tests)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_lib.backends.triton_ops import check_launch, device_key, zeroed_counters

if TYPE_CHECKING:
    import torch

BLOCK_G = 16  # query heads per program, padded: the MMA's smallest width
BLOCK_N = 64  # columns per loop iteration
WARPS = 4
STAGES = 2
MAX_SPLITS = 16
LOCK_SLOTS = 4096  # counters per device: one per (row, kv head)
LOG2_E = 1.4426950408889634

_KERNEL = None
columns_block = None  # the kernel's loop body, a Triton function set by _kernel()
_LOCKS: dict[str, torch.Tensor] = {}
_SMS: dict[str, int] = {}


@dataclass(frozen=True)
class Launch:
    """One launch configuration: columns per loop iteration, warps, software-pipeline stages, and slices of the
    columns (None: `splits_for`'s). The engine uses DEFAULT; a bench times others."""

    block_n: int = BLOCK_N
    warps: int = WARPS
    stages: int = STAGES
    splits: int | None = None

    def __post_init__(self) -> None:
        check_launch({"block_n": self.block_n}, self.warps, self.stages, self.splits, MAX_SPLITS)

DEFAULT = Launch()


def splits_for(programs: int, columns: int, multiprocessors: int, block_n: int = BLOCK_N) -> int:
    """Slices of the columns for `programs` (rows x kv heads) over a cache of `columns`: doubled (up to MAX_SPLITS)
    while the programs times the slices leave SMs idle and each slice keeps at least one `block_n` of the cache's
    columns; 1 when the (row, kv head) programs alone fill the GPU."""
    splits = 1
    while splits < MAX_SPLITS and programs * splits < multiprocessors and columns >= 2 * splits * block_n:
        splits *= 2
    return splits


def prepare(device) -> None:
    """The device's counters, zeroed now (before any CUDA graph capture: a buffer first allocated inside a capture
    is zeroed only when the graph first replays), and the kernel defined now, outside any capture."""

    key = device_key(device)
    if key not in _LOCKS:
        _LOCKS[key], _SMS[key] = zeroed_counters(device, LOCK_SLOTS)
    _kernel()


def _kernel():
    """The Triton kernel, defined once per process (Triton imported only where the kernel runs)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    global columns_block  # a global: Triton's interpreter reads a kernel's globals, not its closure

    @triton.jit
    def columns_block(q, k_ptr, v_ptr, cache, start, high, cache_column, scale_log2, maximum, total, acc,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
        """Columns [start, start + BLOCK_N) below `high` into the running (maximum, sum, output) of the online
        softmax, in base 2."""
        d = tl.arange(0, HEAD_DIM)
        n = start + tl.arange(0, BLOCK_N)
        keep_n = n < high
        at = cache + n[:, None] * cache_column + d[None, :]
        k = tl.load(k_ptr + at, mask=keep_n[:, None], other=0.0)
        v = tl.load(v_ptr + at, mask=keep_n[:, None], other=0.0)
        if INTERPRETED:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_G, BLOCK_N]: log2 of the unnormalized weights
        scores = tl.where(keep_n[None, :], scores, float("-inf"))
        new_maximum = tl.maximum(maximum, tl.max(scores, axis=1))
        rescale = tl.exp2(maximum - new_maximum)
        weights = tl.exp2(scores - new_maximum[:, None])
        total = total * rescale + tl.sum(weights, axis=1)
        weights = weights.to(tl.bfloat16)  # as FlashAttention multiplies them with v
        if INTERPRETED:
            weights = weights.to(tl.float32)
        acc = tl.dot(weights, v, acc * rescale[:, None])
        return new_maximum, total, acc


    @triton.jit
    def decode_attention_kernel(q_ptr, k_ptr, v_ptr, pad_ptr, write_ptr, out_ptr, part_ptr, stat_ptr, lock_ptr,
                                q_batch, q_head, cache_batch, cache_head, cache_column, scale_log2,
                                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                                BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, INTERPRETED: tl.constexpr):
        b = tl.program_id(0)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        keep_g = g < GROUP
        # q's rows, out's rows: [B, KV, G, D] with G D contiguous
        q_at = b * q_batch + kv * q_head + g[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_at, mask=keep_g[:, None], other=0.0)
        if INTERPRETED:  # Triton 3.5's CPU interpreter multiplies bf16 tiles as raw bits: their exact upcasts
            q = q.to(tl.float32)
        one = tl.arange(0, 1)  # scalars loaded as one-element vectors and summed (Triton's interpreter loads a
        # pointer's scalar as a one-element array, which a loop bound cannot take)
        write = tl.sum(tl.load(write_ptr + one), axis=0).to(tl.int32)
        begin = tl.minimum(tl.sum(tl.load(pad_ptr + b + one), axis=0).to(tl.int32), write)
        end = write + 1
        share = tl.cdiv(tl.cdiv(end - begin, SPLITS), BLOCK_N) * BLOCK_N  # whole iterations per slice
        low = begin + split * share
        high = tl.minimum(low + share, end)
        cache = b * cache_batch + kv * cache_head
        maximum = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
        if INTERPRETED:  # the interpreter's scalars are one-element arrays, which range() cannot take as bounds
            start = low
            while start < high:
                maximum, total, acc = columns_block(q, k_ptr, v_ptr, cache, start, high, cache_column, scale_log2,
                                                    maximum, total, acc, HEAD_DIM, BLOCK_N, INTERPRETED)
                start += BLOCK_N
        else:
            for start in range(low, high, BLOCK_N):
                maximum, total, acc = columns_block(q, k_ptr, v_ptr, cache, start, high, cache_column, scale_log2,
                                                    maximum, total, acc, HEAD_DIM, BLOCK_N, INTERPRETED)
        out_at = out_ptr + q_at
        if SPLITS == 1:
            tl.store(out_at, (acc / total[:, None]).to(tl.bfloat16), mask=keep_g[:, None])
        else:
            pair = b * kv_heads + kv  # the (row, kv head): its counter and its slices' partials
            slot = (pair * SPLITS + split) * BLOCK_G
            tl.store(part_ptr + (slot + g[:, None]) * HEAD_DIM + d[None, :], acc)
            tl.store(stat_ptr + (slot + g) * 2, maximum)
            tl.store(stat_ptr + (slot + g) * 2 + 1, total)
            # the partial stored by every thread before the count (the barrier), the count released at GPU scope,
            # acquired by the last program (it then sees every slice's partial)
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                first = pair * SPLITS * BLOCK_G
                overall = tl.load(stat_ptr + (first + g) * 2, cache_modifier=".cg")
                for index in tl.static_range(1, SPLITS):
                    overall = tl.maximum(overall, tl.load(stat_ptr + (first + index * BLOCK_G + g) * 2,
                                                          cache_modifier=".cg"))
                merged_total = tl.zeros((BLOCK_G,), dtype=tl.float32)
                merged = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
                for index in tl.static_range(0, SPLITS):
                    slot = first + index * BLOCK_G
                    weight = tl.exp2(tl.load(stat_ptr + (slot + g) * 2, cache_modifier=".cg") - overall)
                    merged_total += weight * tl.load(stat_ptr + (slot + g) * 2 + 1, cache_modifier=".cg")
                    merged += weight[:, None] * tl.load(part_ptr + (slot + g[:, None]) * HEAD_DIM + d[None, :],
                                                        cache_modifier=".cg")
                tl.store(out_at, (merged / merged_total[:, None]).to(tl.bfloat16), mask=keep_g[:, None])
                tl.atomic_xchg(lock_ptr + pair, 0)  # zero again for the next launch (or graph replay)

    _KERNEL = decode_attention_kernel
    return _KERNEL


def attend(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, pad: torch.Tensor, write: torch.Tensor,
           scale: float, config: Launch = DEFAULT) -> torch.Tensor:
    """Attention of the grouped query rows q [B, KV, G, D] (bf16) over the caches [B, KV, L, D] (bf16, last
    dimension contiguous), row b over columns min(pad[b], write) <= j <= write (`pad` [B], `write` [1]: integer
    tensors on the device): bf16 [B, KV, G, D], as SDPA returns it for the default path's mask. `prepare(device)`
    first (the engine calls it when it is built)."""
    import torch

    batch, kv_heads, group, head_dim = q.shape
    key = device_key(q.device)
    if key not in _LOCKS:
        raise RuntimeError(f"ATTENTION_BACKEND triton: decode_attention.prepare({q.device}) was not called before use")
    if (q.dtype != torch.bfloat16 or cache_k.dtype != torch.bfloat16 or cache_k.shape != cache_v.shape
            or cache_k.shape[:2] != (batch, kv_heads) or cache_k.shape[3] != head_dim or group > BLOCK_G
            or head_dim & (head_dim - 1) or head_dim < 16 or cache_k.stride(3) != 1
            or cache_v.stride() != cache_k.stride() or tuple(pad.shape) != (batch,) or write.numel() != 1):
        raise ValueError(f"ATTENTION_BACKEND triton: q {tuple(q.shape)} {q.dtype} and the caches "
                         f"{tuple(cache_k.shape)} {cache_k.dtype} with pad {tuple(pad.shape)} and write "
                         f"{tuple(write.shape)} are not one decode step's grouped query rows (bf16, at most "
                         f"{BLOCK_G} query heads per kv head, a power-of-two head size) over its caches")
    if batch * kv_heads > LOCK_SLOTS:
        raise ValueError(f"ATTENTION_BACKEND triton: {batch} rows x {kv_heads} kv heads need more than "
                         f"{LOCK_SLOTS} counters")
    if q.stride(3) != 1 or q.stride(2) != head_dim:
        q = q.contiguous()
    splits = config.splits or splits_for(batch * kv_heads, cache_k.shape[2], _SMS[key], config.block_n)
    out = torch.empty((batch, kv_heads, group, head_dim), dtype=torch.bfloat16, device=q.device)
    if splits > 1:
        parts = torch.empty(batch * kv_heads * splits * BLOCK_G * head_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(batch * kv_heads * splits * BLOCK_G * 2, dtype=torch.float32, device=q.device)
    else:
        parts = stats = out  # not read with one slice
    if batch:
        with torch.profiler.record_function("rollout::decode_attention"):  # the CPU tests count its calls by this
            _kernel()[(batch, kv_heads, splits)](
                q, cache_k, cache_v, pad, write, out, parts, stats, _LOCKS[key], q.stride(0), q.stride(1),
                cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), float(scale) * LOG2_E, GROUP=group,
                HEAD_DIM=head_dim, BLOCK_G=BLOCK_G, BLOCK_N=config.block_n, SPLITS=splits,
                INTERPRETED=q.device.type == "cpu", num_warps=config.warps, num_stages=config.stages)
    return out


def reference(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, pad: torch.Tensor,
              write: torch.Tensor, scale: float) -> torch.Tensor:
    """What `attend` computes, in float32 on the same operands (tests, the bench's check): softmax over each row's
    columns, then the weighted sum of v, rounded to bf16 once."""
    import torch

    columns = torch.arange(cache_k.shape[2], device=q.device)
    column = int(write.reshape(-1)[0])
    begin = torch.minimum(pad.to(torch.long), torch.tensor(column, device=q.device))
    valid = (columns[None, :] >= begin[:, None]) & (columns[None, :] <= column)
    scores = torch.einsum("bkgd,bkld->bkgl", q.float(), cache_k.float()) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    return torch.einsum("bkgl,bkld->bkgd", scores.softmax(-1), cache_v.float()).to(torch.bfloat16)
