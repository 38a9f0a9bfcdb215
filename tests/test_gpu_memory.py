"""GPU-marked: the memory tracker against a known allocation (+-10%)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_part1]  # docs/reliability.md: GPU suite parts


def test_cell_memory_sees_a_known_allocation():
    import gc

    import torch

    from rollout_lib.measure.memory import CellMemory

    device = torch.device("cuda", torch.cuda.current_device())
    size = 2 * 2**30
    gc.collect()  # tensors an earlier test's traceback still holds
    torch.cuda.empty_cache()
    baseline_reserved = torch.cuda.memory_reserved(device)
    baseline_allocated = torch.cuda.memory_allocated(device)
    # After a suite, the allocator can keep free blocks that empty_cache cannot release (a CUDA graph's private
    # pool, a partly used segment); the block may land in them, so the reservation grows by at least what the
    # free cache could not hold (lease 45's suite: 0 bytes of growth, the test alone: 2 GiB).
    free_cached = baseline_reserved - baseline_allocated
    with CellMemory(device) as memory:
        block = torch.empty(size, dtype=torch.uint8, device=device)
        block.fill_(1)
        torch.cuda.synchronize(device)
        import time

        time.sleep(0.1)  # let the NVML sampler see it
        snap = memory.snapshot()
        del block
    reserved_growth = snap["torch"]["peak_reserved_bytes"] - baseline_reserved
    assert size - free_cached - 0.10 * size <= reserved_growth <= 1.10 * size
    assert snap["torch"]["peak_allocated_bytes"] - baseline_allocated == pytest.approx(size, rel=0.10)
    assert snap["torch"]["peak_reserved_bytes"] >= baseline_allocated + size
    nvml = memory.nvml.to_json()
    assert nvml["status"] == "measured"
    if "peak_process_tree_bytes" in nvml:  # the whole process: context + allocator pool
        assert nvml["peak_process_tree_bytes"] >= size * 0.9
        assert nvml["peak_process_tree_bytes"] <= snap["torch"]["peak_reserved_bytes"] + 2**30
    else:
        assert nvml["peak_process_tree_bytes_status"] == "not_measured" and nvml["reason"]
