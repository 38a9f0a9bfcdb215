"""WEIGHT_PREFETCH (issue 43 candidate): while a decode step's attention runs, the weights the layer's next GEMMs
and epilogues read are pulled into the GPU's L2 cache by a side stream, so those kernels read them from the L2.

Why (lease 42's trace of Q, H100, 4 rows; docs/perf-notes.md, "Decode step"): the GEMMs take 0.80 ms a step for
~0.9 GB of weights (cuBLAS ~5.2-7.0 us a projection against 1.3-3.8 us of bytes at 3.35 TB/s), and between them
the attention, the epilogue kernels and the gaps take ~0.7 ms in which the memory is nearly idle (attention reads
0.3-3 MB a layer at 4 rows). Each small GEMM pays the memory's latency on its first loads and never reaches the
bandwidth; the epilogue kernels' B reads were 2.1 us a call slower with B out of the L2 (lease 38's bench). A
layer's o, gate_up and down weights (with the shrink's rows, 23.7 MB at Qwen3-0.6B) and their B (0.9 MB) fit the
L2 (50 MB on an H100 or H200): fetched while attention runs, off every kernel's critical path, they turn the
GEMMs' memory latency into the L2's. Lease 40's lesson (`+tritonqkv`): work moved into a kernel pays only where
it is off the critical path; a side stream puts it on none.

The kernel: one launch per layer on the engine's prefetch stream, forked from the step's stream after the qkv
epilogue (the layer's attention's inputs) and joined at the end of the step (a CUDA graph captures the fork and
the join). Its programs split each region of the layer's table (device address, bytes) into equal 16-byte-aligned
chunks, one per thread, and each thread issues one `cp.async.bulk.prefetch.L2.global` per region: a hint to the
memory system that completes on its own, with nothing waited for and nothing written. So the step's values are
untouched: every kernel reads the same bytes from wherever they are. The regions, in the order they are issued:
"rest_of_layer": o's weight (and its shrink rows), o's B, gate_up's, gate_up's B, down's, down's B;
"through_next_qkv": then the next layer's qkv weight and B too (8.4 MB more in the L2 while the MLP runs).

Regime: CUDA devices of compute capability 9.0 or later (the bulk prefetch is Hopper's); refused elsewhere, by
name. The tables hold the weights' addresses: the engine allocates its weight and LoRA buffers once and writes
every policy into them in place, so the addresses hold for the engine's life (as its captured graphs need)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WEIGHT_PREFETCH_ALLOWED = ("off", "rest_of_layer", "through_next_qkv")
THREADS = 128  # one program's threads (4 warps), one chunk of each region a thread
CHUNK_BYTES = 32 * 1024  # at most, per thread and region: programs enough that no thread's chunk is larger
WIDE_CHUNK_BYTES = 4 * 1024  # WEIGHT_PREFETCH_BY side_stream_wide's: 8x the programs for the same table
ALIGN = 16  # the bulk prefetch's address and size unit

_KERNEL = None
bulk_prefetch_regions = None  # the L2 hints, a Triton function (triton_jit.bulk_prefetch_regions), set by _kernel()


@dataclass(frozen=True)
class Plan:
    """One prefetch launch: `table` [regions, 2] int64 (device address, bytes) on the device, and the launch's
    programs."""

    table: torch.Tensor
    programs: int

    @property
    def regions(self) -> int:
        return self.table.shape[0]


def region(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a tensor's elements span, widened to whole 16-byte units (the widening stays
    inside the units holding the first and last element, so inside their pages)."""
    span = (sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)) + 1
            if tensor.numel() else 0) * tensor.element_size()
    start = tensor.data_ptr() - tensor.data_ptr() % ALIGN
    end = tensor.data_ptr() + span
    return start, -(-(end - start) // ALIGN) * ALIGN


def plan(tensors: list[torch.Tensor], device, chunk_bytes: int = CHUNK_BYTES) -> Plan:
    """A launch that prefetches `tensors`' memory, in their order: the table on `device`, programs enough that each
    thread's chunk of the largest region is at most `chunk_bytes` (a positive multiple of ALIGN)."""
    import torch

    if not isinstance(chunk_bytes, int) or chunk_bytes < ALIGN or chunk_bytes % ALIGN:
        raise ValueError(f"WEIGHT_PREFETCH: chunk_bytes {chunk_bytes!r}; allowed: a positive multiple of {ALIGN}")
    regions = [region(t) for t in tensors if t is not None and t.numel()]
    if not regions:
        raise ValueError("WEIGHT_PREFETCH: a prefetch plan needs at least one tensor with elements")
    largest = max(size for _, size in regions)
    programs = max(1, -(-largest // (THREADS * chunk_bytes)))
    table = torch.tensor(regions, dtype=torch.int64, device=device)
    return Plan(table, programs)


def _kernel():
    """The Triton kernel, defined once per process (Triton imported only where it runs)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    from rollout_lib.backends import triton_jit

    global bulk_prefetch_regions  # a global: Triton's interpreter reads a kernel's globals, not its closure
    bulk_prefetch_regions = triton_jit.bulk_prefetch_regions

    @triton.jit
    def l2_prefetch_kernel(table_ptr, REGIONS: tl.constexpr, THREADS: tl.constexpr, ALIGN: tl.constexpr):
        program = tl.program_id(0)
        lanes = tl.num_programs(0) * THREADS
        lane = (program * THREADS + tl.arange(0, THREADS)).to(tl.int64)
        bulk_prefetch_regions(table_ptr, REGIONS, lane, lanes, ALIGN)

    _KERNEL = l2_prefetch_kernel
    return _KERNEL


def launch(step_plan: Plan, stream: torch.cuda.Stream) -> None:
    """The plan's prefetch on `stream`, after everything the current stream has enqueued so far (the fork); the
    caller joins `stream` back (`join`) before the step's end."""
    import torch

    current = torch.cuda.current_stream(step_plan.table.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream), torch.profiler.record_function("rollout::weight_prefetch"):
        _kernel()[(step_plan.programs,)](step_plan.table, REGIONS=step_plan.regions, THREADS=THREADS, ALIGN=ALIGN,
                                         num_warps=THREADS // 32)


def join(stream: torch.cuda.Stream) -> None:
    """The current stream waits for every prefetch enqueued on `stream` (a captured graph must end joined)."""
    import torch

    torch.cuda.current_stream(stream.device).wait_stream(stream)
