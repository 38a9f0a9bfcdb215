"""GPU-marked: the memory tracker against a known allocation (+-10%)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_part1]  # docs/reliability.md: GPU suite parts


def test_cell_memory_sees_a_known_allocation():
    import torch

    from rollout_lib.measure.memory import CellMemory

    device = torch.device("cuda", torch.cuda.current_device())
    size = 2 * 2**30
    torch.cuda.empty_cache()
    baseline_reserved = torch.cuda.memory_reserved(device)
    with CellMemory(device) as memory:
        block = torch.empty(size, dtype=torch.uint8, device=device)
        block.fill_(1)
        torch.cuda.synchronize(device)
        import time

        time.sleep(0.1)  # let the NVML sampler see it
        snap = memory.snapshot()
        del block
    torch_peak = snap["torch"]["peak_reserved_bytes"] - baseline_reserved
    assert torch_peak == pytest.approx(size, rel=0.10)
    assert snap["torch"]["peak_allocated_bytes"] >= size
    nvml = memory.nvml.to_json()
    assert nvml["status"] == "measured"
    if "peak_process_tree_bytes" in nvml:  # the whole process: context + allocator pool
        assert nvml["peak_process_tree_bytes"] >= size * 0.9
        assert nvml["peak_process_tree_bytes"] <= snap["torch"]["peak_reserved_bytes"] + 2**30
    else:
        assert nvml["peak_process_tree_bytes_status"] == "not_measured" and nvml["reason"]
