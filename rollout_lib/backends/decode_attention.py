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
scheduling. Its launch configuration is fixed, nothing drawn: DEFAULT, or with ATTENTION_LAUNCH "by_columns" one
chosen by the cache's length (`launch_for`). bf16 only; CUDA, or a CPU in Triton's interpreter (tests).

ATTENTION_BACKEND "triton_qkv" (`attend_from_projection`): the same kernel with QKV_EPILOGUE's work inside it, one
kernel a layer fewer (lease 39: qkv's epilogue 2.6 us a call and a ~0.55 us gap before attention). Each program
computes its G query heads from the qkv GEMM's float32 output as `qkv_epilogue` does (the LoRA term over the
shrink's parts, Qwen3's q norm, the rotary embedding, each rounding where that kernel rounds: the same q bits), and
the program of a row's last slice also computes the kv head's new k and v and writes them into the caches at
column `write`. No program reads that column from the cache: the last slice's loop stops before it and takes the
new column from its registers as the first step of its online softmax, so nothing reads what the same launch
writes. Lease 40 (H100): +0.11 to +0.17 ms a step against "triton" (13.4 us a call against 6.8 + 2.8: every slice
computes its query heads before its first k/v load), so it stays off (docs/perf-notes.md, "Decode step").

DECODE_PREFIX "shared" with ATTENTION_BACKEND "triton" (`attend_shared`; issue 43 item 5): the rows come in blocks of
n consecutive rows sharing one prompt (a GRPO group), whose k/v columns [pad, prefix_end) the block's first row holds;
each row's own columns are [prefix_end, write]. One program per (block, kv head, slice) keeps the block's n rows' G
query heads as the rows of one MMA tile (n G padded to 16 or more) and walks one list of columns: the prompt's once,
then each row's own, split into equal slices. A prompt column's k/v is loaded once for the n rows (n times in
`attend`): at p512-r512 with n 4, about half the bytes a 16-row step's attention reads. A tile row's score counts
where the column is the prompt's or its own row's; the others are -inf, and a tile row that has seen no column yet
keeps a zero sum (its base 0, not -inf, so no NaN: the operations on every counted score are `attend`'s). The slices
merge as `attend`'s do. FA3's cascade (two calls and a merge kernel per layer) lost at 16 rows (lease 31); this
is one launch a layer, like `attend`.

ATTENTION_DEPENDENT_LAUNCH "prefetch_kv" (issue 43 candidate, sm_90; `attend(..., pdl=True)`): `attend`'s kernel
launched with programmatic dependent launch, so it starts while the kernel before it (the qkv epilogue, which writes
q and this step's k/v column) ends. Before it waits for that kernel (`griddepcontrol.wait`), each program reads its
slice's bounds (pad and write, which the step's earlier kernels wrote) and asks the L2 for its slice's k and v
(`cp.async.bulk.prefetch.L2`, PREFETCH_LANES bulk prefetches per cache): a hint that writes nothing, so every load
after the wait reads the same bytes, this step's column included. At 4 rows over a 768-column cache a layer's
k/v is 12.6 MB, ~3.8 us at an H100's 3.35 TB/s, against ~2.2 us of qkv epilogue in which the memory is idle. The
same operations on the same values: the same bits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_lib.backends.triton_ops import check_launch, device_key, zeroed_counters

if TYPE_CHECKING:
    import torch

BLOCK_G = 16  # query heads per program, padded: the MMA's smallest width
BLOCK_N = 64  # columns per loop iteration
WARPS = 2  # lease 40 bench (H100): 0.1-0.6 us a call under 4 warps at 4 and 16 rows, 192 and 768 columns
STAGES = 2
MAX_SPLITS = 16
LOCK_SLOTS = 4096  # counters per device: one per (row, kv head), or per (block, kv head) in `attend_shared`
MAX_TILE_ROWS = 64  # `attend_shared`: a block's rows x query heads per kv head, at most (the MMA tile's height)
PREFETCH_LANES = 64  # ATTENTION_DEPENDENT_LAUNCH prefetch_kv: bulk L2 prefetches per program and cache
WEIGHT_LANES = 64  # WEIGHT_PREFETCH_BY attention: bulk L2 prefetches per program and region of the layer's weights
LOG2_E = 1.4426950408889634

_KERNEL = None
softmax_update = None  # one block of columns into the online softmax, a Triton function set by _kernel()
columns_block = None  # the kernel's loop body, a Triton function set by _kernel()
columns = None  # its loop over a slice's columns; set by _kernel()
finish = None  # its end: the slice's output or partial, and the merge; set by _kernel()
row_slice = None  # a program's share of its row's columns; set by _kernel()
bulk_prefetch_share = None  # ATTENTION_DEPENDENT_LAUNCH's L2 hints (triton_jit.bulk_prefetch_share), set by _kernel()
bulk_prefetch_regions = None  # WEIGHT_PREFETCH_BY attention's (triton_jit.bulk_prefetch_regions), set by _kernel()
lora_add = None  # the LoRA add's two roundings (triton_jit.lora_add), set by _fused_kernel()
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

# ATTENTION_LAUNCH "by_columns" (lease 41's bench, H100, `outputs/perf/decode-h200/epilogue-bench.json`; us a call,
# DEFAULT -> the launch below): a cache under SHORT_CACHE_COLUMNS in one slice of 128 columns an iteration on 4
# warps, 3 stages (192 columns: 7.47 -> 5.77 at 4 rows, 9.58 -> 8.14 at 16: no merge, two loop iterations). A
# longer cache keeps DEFAULT (session 43): 3 stages there took 768 columns from 10.75 to 9.78 us at 4 rows and
# 21.27 to 20.25 at 16 in the bench, but lease 42's step moved only -0.010 ms at p512 (within the draw), and with
# DEFAULT there the setting changes nothing in a long cache's cells, so the picker judges it where it runs.
SHORT_CACHE_COLUMNS = 256
SHORT_CACHE = Launch(block_n=128, warps=4, stages=3)


# ATTENTION_LAUNCH "by_columns_shared" (candidate after lease 43's bench, H200, `outputs/perf/decode-q/attention-
# bench.json`, kernel attention_shared_long: 768 columns, the prompt's 512 read once per block of 4 rows): the shared
# kernel (`attend_shared`) over a cache of SHORT_CACHE_COLUMNS or more at 128 columns an iteration on 4 warps, one
# stage (us a call, warm / L2 flushed: 12.58 / 14.06 -> 11.13 / 12.40 at 16 rows, 9.21 / 10.14 -> 8.34 / 9.40 at 4;
# the best of 48 launches at 16 rows). The plain kernel keeps by_columns' choice (session 43: a long cache's bench
# gain did not reach the step).
SHARED_LONG_CACHE = Launch(block_n=128, warps=4, stages=1)


def launch_for(columns: int) -> Launch:
    """ATTENTION_LAUNCH "by_columns": the launch configuration for a static cache of `columns` (fixed for the
    engine's graphs, since the cache's length is): SHORT_CACHE under SHORT_CACHE_COLUMNS, DEFAULT from there."""
    return SHORT_CACHE if columns < SHORT_CACHE_COLUMNS else DEFAULT


def shared_launch_for(columns: int) -> Launch:
    """ATTENTION_LAUNCH "by_columns_shared": `attend_shared`'s launch configuration for a static cache of `columns`:
    `launch_for`'s under SHORT_CACHE_COLUMNS, SHARED_LONG_CACHE from there."""
    return SHORT_CACHE if columns < SHORT_CACHE_COLUMNS else SHARED_LONG_CACHE


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

    from rollout_lib.backends import triton_jit

    # globals: Triton's interpreter reads a kernel's globals, not its closure
    global softmax_update, columns_block, columns, finish, row_slice, bulk_prefetch_share, bulk_prefetch_regions
    bulk_prefetch_share = triton_jit.bulk_prefetch_share
    bulk_prefetch_regions = triton_jit.bulk_prefetch_regions

    @triton.jit
    def softmax_update(q, k, v, counted, scale_log2, maximum, total, acc, GUARDED: tl.constexpr,
                       INTERPRETED: tl.constexpr):
        """A block of columns (k, v [BLOCK_N, HEAD_DIM]) into the running (maximum, sum, output) of the online
        softmax, in base 2: the scores q k^T where `counted` (broadcast to [rows, BLOCK_N]), -inf elsewhere.
        GUARDED: a row may have nothing counted yet, whose base is then 0, not -inf (no NaN); the operations on
        every counted score are the same."""
        if INTERPRETED:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # [rows, BLOCK_N]: log2 of the unnormalized weights
        scores = tl.where(counted, scores, float("-inf"))
        new_maximum = tl.maximum(maximum, tl.max(scores, axis=1))
        base = tl.where(new_maximum == float("-inf"), 0.0, new_maximum) if GUARDED else new_maximum
        rescale = tl.exp2(maximum - base)
        weights = tl.exp2(scores - base[:, None])
        total = total * rescale + tl.sum(weights, axis=1)
        weights = weights.to(tl.bfloat16)  # as FlashAttention multiplies them with v
        if INTERPRETED:
            weights = weights.to(tl.float32)
        acc = tl.dot(weights, v, acc * rescale[:, None])
        return new_maximum, total, acc

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
        return softmax_update(q, k, v, keep_n[None, :], scale_log2, maximum, total, acc, False, INTERPRETED)

    @triton.jit
    def columns(q, k_ptr, v_ptr, cache, low, high, cache_column, scale_log2, maximum, total, acc, HEAD_DIM, BLOCK_N,
                INTERPRETED):
        """Columns [low, high) BLOCK_N at a time (`columns_block`) into the running (maximum, sum, output); the last
        three are the caller's constexprs (not annotated: `tl` is not in this body's closure)."""
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
        return maximum, total, acc


    @triton.jit
    def row_slice(pad_ptr, write_ptr, b, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """(first column, end of the share, the column this step writes) of slice `split` of row b's columns
        min(pad[b], write) <= j <= write: an equal share of whole BLOCK_N iterations per slice (the end is not
        capped at write + 1: the caller caps it)."""
        one = tl.arange(0, 1)  # scalars loaded as one-element vectors and summed (Triton's interpreter loads a
        # pointer's scalar as a one-element array, which a loop bound cannot take)
        write = tl.sum(tl.load(write_ptr + one), axis=0).to(tl.int32)
        begin = tl.minimum(tl.sum(tl.load(pad_ptr + b + one), axis=0).to(tl.int32), write)
        share = tl.cdiv(tl.cdiv(write + 1 - begin, SPLITS), BLOCK_N) * BLOCK_N
        low = begin + split * share
        return low, low + share, write

    @triton.jit
    def finish(acc, maximum, total, out_at, part_ptr, stat_ptr, lock_ptr, pair, split, g, d, keep_g,
               HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, SPLITS: tl.constexpr):
        """A slice's running (output, maximum, sum) to the output: divided and stored with one slice; with several,
        stored as the (row, kv head) `pair`'s partial, and the last program of the pair to arrive merges them."""
        if SPLITS == 1:
            tl.store(out_at, (acc / total[:, None]).to(tl.bfloat16), mask=keep_g[:, None])
        else:
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

    @triton.jit
    def decode_attention_kernel(q_ptr, k_ptr, v_ptr, pad_ptr, write_ptr, out_ptr, part_ptr, stat_ptr, lock_ptr,
                                weights_ptr, q_batch, q_head, cache_batch, cache_head, cache_column, scale_log2,
                                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                                BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, INTERPRETED: tl.constexpr,
                                PDL: tl.constexpr = False, LANES: tl.constexpr = 64,
                                WEIGHT_REGIONS: tl.constexpr = 0, WEIGHT_LANES: tl.constexpr = 64):
        b = tl.program_id(0)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        if WEIGHT_REGIONS > 0:  # WEIGHT_PREFETCH_BY attention: what the layer reads after attention, asked first
            programs = tl.num_programs(0) * kv_heads * tl.num_programs(2)
            program = (b * kv_heads + kv) * tl.num_programs(2) + split
            lane = (program * WEIGHT_LANES + tl.arange(0, WEIGHT_LANES)).to(tl.int64)
            bulk_prefetch_regions(weights_ptr, WEIGHT_REGIONS, lane, programs * WEIGHT_LANES, 16)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        keep_g = g < GROUP
        # q's rows, out's rows: [B, KV, G, D] with G D contiguous
        q_at = b * q_batch + kv * q_head + g[:, None] * HEAD_DIM + d[None, :]
        if PDL:  # ATTENTION_DEPENDENT_LAUNCH: the slice's k and v asked of the L2, then the wait for q
            low, high, write = row_slice(pad_ptr, write_ptr, b, split, SPLITS, BLOCK_N)
            high = tl.minimum(high, write + 1)
            cache = b * cache_batch + kv * cache_head
            size = (tl.maximum(high - low, 0) * cache_column * 2).to(tl.int64)  # bf16: 2 bytes an element
            lanes = tl.arange(0, LANES).to(tl.int64)  # LANES bulk prefetches a cache, sharing the slice's bytes
            bulk_prefetch_share((k_ptr + cache + low * cache_column).to(tl.pointer_type(tl.int8)), size, lanes,
                                LANES, 16)
            bulk_prefetch_share((v_ptr + cache + low * cache_column).to(tl.pointer_type(tl.int8)), size, lanes,
                                LANES, 16)
            tl.extra.cuda.gdc_wait()  # then what the qkv epilogue wrote: q, and this step's k/v column
        q = tl.load(q_ptr + q_at, mask=keep_g[:, None], other=0.0)
        if INTERPRETED:  # Triton 3.5's CPU interpreter multiplies bf16 tiles as raw bits: their exact upcasts
            q = q.to(tl.float32)
        if not PDL:
            low, high, write = row_slice(pad_ptr, write_ptr, b, split, SPLITS, BLOCK_N)
            high = tl.minimum(high, write + 1)
            cache = b * cache_batch + kv * cache_head
        maximum = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
        maximum, total, acc = columns(q, k_ptr, v_ptr, cache, low, high, cache_column, scale_log2, maximum, total,
                                      acc, HEAD_DIM, BLOCK_N, INTERPRETED)
        finish(acc, maximum, total, out_ptr + q_at, part_ptr, stat_ptr, lock_ptr, b * kv_heads + kv, split, g, d,
               keep_g, HEAD_DIM, BLOCK_G, SPLITS)

    _KERNEL = decode_attention_kernel
    return _KERNEL


_SHARED_KERNEL = None
shared_block = None  # the shared-prefix kernel's loop body, a Triton function set by _shared_kernel()
shared_columns = None  # its loop over a slice of the block's column list; set by _shared_kernel()


def _shared_kernel():
    """The kernel of DECODE_PREFIX "shared" with ATTENTION_BACKEND "triton", defined once per process."""
    global _SHARED_KERNEL, shared_block, shared_columns
    if _SHARED_KERNEL is not None:
        return _SHARED_KERNEL
    import triton
    import triton.language as tl

    _kernel()  # finish

    @triton.jit
    def shared_block(q, k_ptr, v_ptr, first_row, head_at, start, high, begin, shared, own_start, own, row_of_t,
                     cache_batch, cache_column, scale_log2, maximum, total, acc, HEAD_DIM: tl.constexpr,
                     BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
        """Entries [start, start + BLOCK_N) below `high` of the block's column list (the prompt's `shared` columns
        from `begin`, in the block's first row; then row r's `own` columns from `own_start`, for r = 0, 1, ...)
        into the running (maximum, sum, output) of each tile row, which counts the prompt's and its own row's."""
        d = tl.arange(0, HEAD_DIM)
        n = start + tl.arange(0, BLOCK_N)
        keep_n = n < high
        prompt = n < shared
        after = tl.maximum(n - shared, 0)
        owner = tl.where(prompt, 0, after // own)  # the block's row whose cache holds the entry
        column = tl.where(prompt, begin + n, own_start + after % own)
        at = ((first_row + owner) * cache_batch + column * cache_column)[:, None] + head_at + d[None, :]
        k = tl.load(k_ptr + at, mask=keep_n[:, None], other=0.0)
        v = tl.load(v_ptr + at, mask=keep_n[:, None], other=0.0)
        counted = keep_n[None, :] & (prompt[None, :] | (owner[None, :] == row_of_t[:, None]))
        # a tile row may have seen only other rows' columns so far: guarded
        return softmax_update(q, k, v, counted, scale_log2, maximum, total, acc, True, INTERPRETED)

    @triton.jit
    def shared_columns(q, k_ptr, v_ptr, first_row, head_at, low, high, begin, shared, own_start, own, row_of_t,
                       cache_batch, cache_column, scale_log2, maximum, total, acc, HEAD_DIM, BLOCK_N, INTERPRETED):
        """Entries [low, high) of the block's column list BLOCK_N at a time (`shared_block`), as `columns` walks
        a row's columns."""
        if INTERPRETED:
            start = low
            while start < high:
                maximum, total, acc = shared_block(q, k_ptr, v_ptr, first_row, head_at, start, high, begin, shared,
                                                   own_start, own, row_of_t, cache_batch, cache_column, scale_log2,
                                                   maximum, total, acc, HEAD_DIM, BLOCK_N, INTERPRETED)
                start += BLOCK_N
        else:
            for start in range(low, high, BLOCK_N):
                maximum, total, acc = shared_block(q, k_ptr, v_ptr, first_row, head_at, start, high, begin, shared,
                                                   own_start, own, row_of_t, cache_batch, cache_column, scale_log2,
                                                   maximum, total, acc, HEAD_DIM, BLOCK_N, INTERPRETED)
        return maximum, total, acc

    @triton.jit
    def shared_prefix_attention_kernel(q_ptr, k_ptr, v_ptr, pad_ptr, write_ptr, prefix_ptr, out_ptr, part_ptr,
                                       stat_ptr, lock_ptr, q_batch, q_head, cache_batch, cache_head, cache_column,
                                       scale_log2, ROWS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                                       INTERPRETED: tl.constexpr):
        block = tl.program_id(0)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        t = tl.arange(0, BLOCK_T)  # tile row t: the block's row t // GROUP, its query head t % GROUP of kv head kv
        d = tl.arange(0, HEAD_DIM)
        keep_t = t < ROWS * GROUP
        row_of_t = t // GROUP
        first_row = block * ROWS
        q_at = ((first_row + row_of_t) * q_batch + kv * q_head + (t % GROUP) * HEAD_DIM)[:, None] + d[None, :]
        q = tl.load(q_ptr + q_at, mask=keep_t[:, None], other=0.0)
        if INTERPRETED:  # Triton 3.5's CPU interpreter multiplies bf16 tiles as raw bits: their exact upcasts
            q = q.to(tl.float32)
        one = tl.arange(0, 1)  # scalars as one-element vectors, summed (as `row_slice` reads them)
        write = tl.sum(tl.load(write_ptr + one), axis=0).to(tl.int32)
        begin = tl.minimum(tl.sum(tl.load(pad_ptr + first_row + one), axis=0).to(tl.int32), write)
        own_start = tl.minimum(tl.maximum(tl.sum(tl.load(prefix_ptr + one), axis=0).to(tl.int32), begin), write)
        shared = own_start - begin  # the prompt's columns [begin, own_start), read once for the block
        own = write + 1 - own_start  # each row's own columns [own_start, write]: at least one
        entries = shared + ROWS * own
        share = tl.cdiv(tl.cdiv(entries, SPLITS), BLOCK_N) * BLOCK_N
        low = split * share
        high = tl.minimum(low + share, entries)
        maximum = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_T, HEAD_DIM), dtype=tl.float32)
        maximum, total, acc = shared_columns(q, k_ptr, v_ptr, first_row, kv * cache_head, low, high, begin, shared,
                                             own_start, own, row_of_t, cache_batch, cache_column, scale_log2,
                                             maximum, total, acc, HEAD_DIM, BLOCK_N, INTERPRETED)
        finish(acc, maximum, total, out_ptr + q_at, part_ptr, stat_ptr, lock_ptr, block * kv_heads + kv, split, t, d,
               keep_t, HEAD_DIM, BLOCK_T, SPLITS)

    _SHARED_KERNEL = shared_prefix_attention_kernel
    return _SHARED_KERNEL


_FUSED_KERNEL = None
projected_head = None  # one head's rows from the qkv GEMM's output, a Triton function set by _fused_kernel()


def _fused_kernel():
    """The kernel of ATTENTION_BACKEND "triton_qkv", defined once per process."""
    global _FUSED_KERNEL, projected_head
    if _FUSED_KERNEL is not None:
        return _FUSED_KERNEL
    import triton
    import triton.language as tl

    from rollout_lib.backends import triton_jit

    _kernel()  # columns, finish
    global lora_add
    lora_add = triton_jit.lora_add

    @triton.jit
    def projected_head(row, b_ptr, norm_ptr, cos_row, sin_row, slot, part, b_row, b_col, scaling, eps,
                       FEATURES: tl.constexpr, HEAD_DIM: tl.constexpr, RANK: tl.constexpr,
                       RANK_BLOCK: tl.constexpr, ORACLE_ROUNDING: tl.constexpr, NORMED: tl.constexpr):
        """Head `slot` of one row of the qkv GEMM's float32 output (`row`: its first feature): the projection with
        its LoRA term, rounded to bf16 (v: that, as bf16); with NORMED (q, k) the head's norm with weights
        `norm_ptr` and the rotary embedding, as `qkv_epilogue` computes them: bf16 [HEAD_DIM]. The rotary's
        partner of feature d (d + D / 2 below the half, d - D / 2 above) is computed alongside, from the same
        loads, so the head is one vector."""
        d = tl.arange(0, HEAD_DIM)
        partner = (d + HEAD_DIM // 2) % HEAD_DIM
        first = slot * HEAD_DIM + d
        second = slot * HEAD_DIM + partner
        r = tl.arange(0, RANK_BLOCK)
        has = r < RANK
        column = part * RANK + r
        shrink = row + FEATURES
        xa = (tl.load(shrink + column, mask=has, other=0.0) + tl.load(shrink + 3 * RANK + column, mask=has,
                                                                      other=0.0)) \
            + tl.load(shrink + 6 * RANK + column, mask=has, other=0.0)
        b1 = tl.load(b_ptr + first[None, :] * b_row + column[:, None] * b_col, mask=has[:, None], other=0.0)
        x1 = lora_add(tl.load(row + first).to(tl.bfloat16), tl.sum(xa[:, None] * b1, axis=0), scaling,
                      ORACLE_ROUNDING)
        if NORMED:
            b2 = tl.load(b_ptr + second[None, :] * b_row + column[:, None] * b_col, mask=has[:, None], other=0.0)
            x2 = lora_add(tl.load(row + second).to(tl.bfloat16), tl.sum(xa[:, None] * b2, axis=0), scaling,
                          ORACLE_ROUNDING)
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            scale = tl.rsqrt(tl.sum(f1 * f1, axis=0) / HEAD_DIM + eps)
            y1 = tl.load(norm_ptr + d).to(tl.float32) * (f1 * scale).to(tl.bfloat16).to(tl.float32)
            y2 = tl.load(norm_ptr + partner).to(tl.float32) * (f2 * scale).to(tl.bfloat16).to(tl.float32)
            sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
            out = (y1 * tl.load(cos_row + d).to(tl.float32)
                   + (sign * y2) * tl.load(sin_row + d).to(tl.float32)).to(tl.bfloat16)
        else:
            out = x1
        return out

    @triton.jit
    def projected_attention_kernel(both_ptr, b_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, cache_k_ptr,
                                   cache_v_ptr, pad_ptr, write_ptr, out_ptr, part_ptr, stat_ptr, lock_ptr,
                                   both_row, b_row, b_col, cos_row, sin_row, cache_batch, cache_head, cache_column,
                                   scaling, eps, scale_log2, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, RANK: tl.constexpr,
                                   RANK_BLOCK: tl.constexpr, ORACLE_ROUNDING: tl.constexpr, BLOCK_G: tl.constexpr,
                                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, INTERPRETED: tl.constexpr):
        b = tl.program_id(0)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        keep_g = g < GROUP
        features = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        row = both_ptr + b * both_row
        cos_at, sin_at = cos_ptr + b * cos_row, sin_ptr + b * sin_row
        q = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
        for index in tl.static_range(GROUP):  # the G query heads of kv head kv: rows of the MMA tile
            head = projected_head(row, b_ptr, q_norm_ptr, cos_at, sin_at, kv * GROUP + index, 0, b_row, b_col,
                                  scaling, eps, features, HEAD_DIM, RANK, RANK_BLOCK, ORACLE_ROUNDING, True)
            q = tl.where(g[:, None] == index, head.to(tl.float32)[None, :], q)
        q = q.to(tl.bfloat16)
        if INTERPRETED:  # Triton 3.5's CPU interpreter multiplies bf16 tiles as raw bits: their exact upcasts
            q = q.to(tl.float32)
        low, high, write = row_slice(pad_ptr, write_ptr, b, split, SPLITS, BLOCK_N)
        high = tl.minimum(high, write)  # the new column, `write`, from registers below, not the cache
        cache = b * cache_batch + kv * cache_head
        maximum = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
        if split == SPLITS - 1:  # the row's new k and v: into the caches, and into this slice's softmax as its
            # first column (weight exp2(0) = 1, exact in bf16)
            k_new = projected_head(row, b_ptr, k_norm_ptr, cos_at, sin_at, HEADS + kv, 1, b_row, b_col, scaling,
                                   eps, features, HEAD_DIM, RANK, RANK_BLOCK, ORACLE_ROUNDING, True)
            v_new = projected_head(row, b_ptr, k_norm_ptr, cos_at, sin_at, HEADS + KV_HEADS + kv, 2, b_row, b_col,
                                   scaling, eps, features, HEAD_DIM, RANK, RANK_BLOCK, ORACLE_ROUNDING, False)
            tl.store(cache_k_ptr + cache + write * cache_column + d, k_new)
            tl.store(cache_v_ptr + cache + write * cache_column + d, v_new)
            maximum = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale_log2
            total = tl.full((BLOCK_G,), 1.0, dtype=tl.float32)
            acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32) + v_new.to(tl.float32)[None, :]
        maximum, total, acc = columns(q, cache_k_ptr, cache_v_ptr, cache, low, high, cache_column, scale_log2,
                                      maximum, total, acc, HEAD_DIM, BLOCK_N, INTERPRETED)
        q_at = ((b * KV_HEADS + kv) * GROUP + g[:, None]) * HEAD_DIM + d[None, :]
        finish(acc, maximum, total, out_ptr + q_at, part_ptr, stat_ptr, lock_ptr, b * KV_HEADS + kv, split, g, d,
               keep_g, HEAD_DIM, BLOCK_G, SPLITS)

    _FUSED_KERNEL = projected_attention_kernel
    return _FUSED_KERNEL


def _launch_buffers(setting: str, out_shape: tuple[int, ...], units: int, unit: str, columns: int, tile: int, device,
                    config: Launch) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slices, the output `out_shape` [B, KV, G, D] bf16, the slices' partial outputs and (maximum, sum) pairs) of
    one launch whose programs are `units` (rows, or `attend_shared`'s blocks) x kv heads x slices, each with `tile`
    query rows, the slices chosen for `columns` (each unit's columns, at most); with one slice the partials are not
    read (the output stands in). More (unit, kv head) pairs than counters are refused by name."""
    import torch

    kv_heads, head_dim = out_shape[1], out_shape[3]
    if units * kv_heads > LOCK_SLOTS:
        raise ValueError(f"{setting}: {units} {unit} x {kv_heads} kv heads need more than {LOCK_SLOTS} counters")
    splits = config.splits or splits_for(units * kv_heads, columns, _SMS[device_key(device)], config.block_n)
    out = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
    if splits == 1:
        return splits, out, out, out
    slots = units * kv_heads * splits * tile
    return (splits, out, torch.empty(slots * head_dim, dtype=torch.float32, device=device),
            torch.empty(slots * 2, dtype=torch.float32, device=device))


def attend(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, pad: torch.Tensor, write: torch.Tensor,
           scale: float, config: Launch = DEFAULT, pdl: bool = False,
           weights: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the grouped query rows q [B, KV, G, D] (bf16) over the caches [B, KV, L, D] (bf16, last
    dimension contiguous), row b over columns min(pad[b], write) <= j <= write (`pad` [B], `write` [1]: integer
    tensors on the device): bf16 [B, KV, G, D], as SDPA returns it for the default path's mask. `prepare(device)`
    first (the engine calls it when it is built). `pdl` (ATTENTION_DEPENDENT_LAUNCH "prefetch_kv", sm_90, CUDA
    only): launched with programmatic dependent launch, each program's k/v slice asked of the L2 before it waits
    for the kernel before it (see the module). `weights` (WEIGHT_PREFETCH_BY attention, sm_90, CUDA only): a
    `weight_prefetch.Plan`'s table [regions, 2] (int64 address, bytes), asked of the L2 by the kernel's programs
    before their attention, instead of by a prefetch kernel on a side stream."""
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
    if pdl and (q.device.type != "cuda" or cache_k.stride(2) != head_dim):
        raise ValueError(f"ATTENTION_DEPENDENT_LAUNCH prefetch_kv: a CUDA device and caches whose columns are "
                         f"contiguous (a column {head_dim} elements); here {q.device.type}, a column "
                         f"{cache_k.stride(2)} elements apart")
    if weights is not None and (q.device.type != "cuda" or weights.device != q.device
                                or weights.dtype != torch.int64 or weights.dim() != 2 or weights.shape[1] != 2
                                or not weights.shape[0] or not weights.is_contiguous()):
        raise ValueError(f"WEIGHT_PREFETCH_BY attention: a CUDA device and a prefetch table on it (int64 [regions, "
                         f"2], at least one region); here {q.device.type}, a table {tuple(weights.shape)} "
                         f"{weights.dtype} on {weights.device}")
    if not q.is_contiguous():  # the output is contiguous and stored at q's offsets
        q = q.contiguous()
    splits, out, parts, stats = _launch_buffers("ATTENTION_BACKEND triton", q.shape, batch, "rows", cache_k.shape[2],
                                                BLOCK_G, q.device, config)
    if batch:
        with torch.profiler.record_function("rollout::decode_attention"):  # the CPU tests count its calls by this
            _kernel()[(batch, kv_heads, splits)](
                q, cache_k, cache_v, pad, write, out, parts, stats, _LOCKS[key],
                weights if weights is not None else pad, q.stride(0), q.stride(1),
                cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), float(scale) * LOG2_E, GROUP=group,
                HEAD_DIM=head_dim, BLOCK_G=BLOCK_G, BLOCK_N=config.block_n, SPLITS=splits,
                INTERPRETED=q.device.type == "cpu", PDL=pdl, LANES=PREFETCH_LANES,
                WEIGHT_REGIONS=0 if weights is None else weights.shape[0], WEIGHT_LANES=WEIGHT_LANES,
                num_warps=config.warps, num_stages=config.stages, launch_pdl=pdl)
    return out


def shared_tile(rows_per_block: int, group: int) -> int:
    """`attend_shared`'s MMA tile height: a block's rows x query heads per kv head, padded to a power of two and to
    at least BLOCK_G (the MMA's smallest width)."""
    return max(BLOCK_G, 1 << max(rows_per_block * group - 1, 0).bit_length())


def attend_shared(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, pad: torch.Tensor,
                  write: torch.Tensor, prefix_end: torch.Tensor, rows_per_block: int, scale: float,
                  config: Launch = DEFAULT) -> torch.Tensor:
    """DECODE_PREFIX "shared": what `attend` returns when the rows come in blocks of `rows_per_block` consecutive rows
    sharing one prompt (equal `pad`), whose k/v columns [pad, prefix_end) are read from the block's first row only
    (the other rows' copies are never read); each row's own columns [prefix_end, write] from its own cache.
    `prefix_end` [1]: an integer tensor on the device (the first decode column). `prepare(device)` first."""
    import torch

    batch, kv_heads, group, head_dim = q.shape
    key = device_key(q.device)
    if key not in _LOCKS:
        raise RuntimeError(f"DECODE_PREFIX shared: decode_attention.prepare({q.device}) was not called before use")
    if (q.dtype != torch.bfloat16 or cache_k.dtype != torch.bfloat16 or cache_k.shape != cache_v.shape
            or cache_k.shape[:2] != (batch, kv_heads) or cache_k.shape[3] != head_dim
            or head_dim & (head_dim - 1) or head_dim < 16 or cache_k.stride(3) != 1
            or cache_v.stride() != cache_k.stride() or tuple(pad.shape) != (batch,) or write.numel() != 1
            or prefix_end.numel() != 1 or rows_per_block < 1 or batch % rows_per_block
            or rows_per_block * group > MAX_TILE_ROWS):
        raise ValueError(f"DECODE_PREFIX shared: q {tuple(q.shape)} {q.dtype}, the caches {tuple(cache_k.shape)} "
                         f"{cache_k.dtype}, pad {tuple(pad.shape)}, write {tuple(write.shape)} and prefix_end "
                         f"{tuple(prefix_end.shape)} are not one decode step's grouped query rows in blocks of "
                         f"{rows_per_block} (bf16, blocks x query heads per kv head at most {MAX_TILE_ROWS}, a "
                         f"power-of-two head size) over its caches")
    blocks = batch // rows_per_block
    if not q.is_contiguous():  # the output is contiguous and stored at q's offsets
        q = q.contiguous()
    tile = shared_tile(rows_per_block, group)
    # a block's column list is at most n cache lengths long (the prompt once, each row's own columns): the slices
    # are chosen for that bound, as `attend`'s for one row's columns (p128-r64-n4: 8 slices of ~1 iteration each,
    # where the cache's length alone gives 2 slices of ~3)
    splits, out, parts, stats = _launch_buffers("DECODE_PREFIX shared", q.shape, blocks, "blocks",
                                                cache_k.shape[2] * rows_per_block, tile, q.device, config)
    if batch:
        with torch.profiler.record_function("rollout::decode_attention_shared"):  # the CPU tests count its calls
            _shared_kernel()[(blocks, kv_heads, splits)](
                q, cache_k, cache_v, pad, write, prefix_end, out, parts, stats, _LOCKS[key], q.stride(0), q.stride(1),
                cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), float(scale) * LOG2_E, ROWS=rows_per_block,
                GROUP=group, HEAD_DIM=head_dim, BLOCK_T=tile, BLOCK_N=config.block_n, SPLITS=splits,
                INTERPRETED=q.device.type == "cpu", num_warps=config.warps, num_stages=config.stages)
    return out


def attend_from_projection(both: torch.Tensor, lora_b: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           pad: torch.Tensor, write: torch.Tensor, heads: int, scaling: float, eps: float,
                           scale: float, oracle_rounding: bool = False, config: Launch = DEFAULT) -> torch.Tensor:
    """ATTENTION_BACKEND "triton_qkv": one decode step's attention from the qkv GEMM's float32 output `both` [B,
    (H + 2 KV) D + 9 rank] (with the shrink's parts, as QKV_EPILOGUE reads it), B [(H + 2 KV) D, 3 rank] float32,
    the q/k norms' weights [D], cos and sin [B, D] bf16: k and v written into the caches [B, KV, L, D] at column
    `write` [1], and the attention of the B rows' query heads over columns min(pad[b], write) <= j <= write: bf16
    [B, KV, G, D] (the grouped query rows' layout, as `attend` returns it). `prepare(device)` first."""
    import torch
    import triton

    rows, width = both.shape
    batch, kv_heads, columns, head_dim = cache_k.shape
    features, low = lora_b.shape
    key = device_key(both.device)
    if key not in _LOCKS:
        raise RuntimeError(f"ATTENTION_BACKEND triton_qkv: decode_attention.prepare({both.device}) was not called "
                           "before use")
    if (features != (heads + 2 * kv_heads) * head_dim or low % 3 or width != features + 3 * low or rows != batch
            or heads % kv_heads or heads // kv_heads > BLOCK_G or head_dim & (head_dim - 1) or head_dim < 16
            or cache_k.dtype != torch.bfloat16 or cache_k.shape != cache_v.shape or cache_k.stride(3) != 1
            or cache_v.stride() != cache_k.stride() or tuple(cos.shape) != (rows, head_dim) or cos.shape != sin.shape
            or tuple(pad.shape) != (batch,) or write.numel() != 1 or both.stride(1) != 1):
        raise ValueError(f"ATTENTION_BACKEND triton_qkv: the GEMM output {tuple(both.shape)}, B "
                         f"{tuple(lora_b.shape)}, the caches {tuple(cache_k.shape)} {cache_k.dtype}, cos "
                         f"{tuple(cos.shape)}, pad {tuple(pad.shape)} and write {tuple(write.shape)} are not one "
                         f"decode step's qkv projection of {heads} query heads with its shrink's rows over its caches")
    group = heads // kv_heads
    splits, out, parts, stats = _launch_buffers("ATTENTION_BACKEND triton_qkv", (batch, kv_heads, group, head_dim),
                                                batch, "rows", columns, BLOCK_G, both.device, config)
    if batch:
        with torch.profiler.record_function("rollout::decode_attention_qkv"):  # the CPU tests count its calls
            _fused_kernel()[(batch, kv_heads, splits)](
                both, lora_b, q_norm, k_norm, cos, sin, cache_k, cache_v, pad, write, out, parts, stats,
                _LOCKS[key], both.stride(0), lora_b.stride(0), lora_b.stride(1), cos.stride(0), sin.stride(0),
                cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), float(scaling), float(eps),
                float(scale) * LOG2_E, HEADS=heads, KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim,
                RANK=low // 3, RANK_BLOCK=triton.next_power_of_2(low // 3), ORACLE_ROUNDING=oracle_rounding,
                BLOCK_G=BLOCK_G, BLOCK_N=config.block_n, SPLITS=splits, INTERPRETED=both.device.type == "cpu",
                num_warps=config.warps, num_stages=config.stages)
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
