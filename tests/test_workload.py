"""The preregistered workload: 24 cells with stable ids, deterministic prompts and seeds."""

from __future__ import annotations

import pytest

from rollout_lib.study.workload import UnknownCellError, Workload


def test_full_grid_has_24_stable_cells(prereg_study):
    ids = Workload(prereg_study).cell_ids()
    assert len(ids) == 24 == len(set(ids))
    assert "p512-r256-n4-stochastic" in ids and "p128-r64-n1-greedy" in ids
    assert ids == Workload(prereg_study).cell_ids()


def test_prompts_deterministic_and_never_special(prereg_study):
    a, b = Workload(prereg_study), Workload(prereg_study)
    for i in range(4):
        for length in (128, 512):
            prompt = a.prompt(i, length)
            assert prompt == b.prompt(i, length) and len(prompt) == length
            assert max(prompt) < 151643 and min(prompt) >= 0
    assert len({a.prompt(i, 512) for i in range(4)}) == 4


def test_requests_carry_per_prompt_per_sample_seeds(prereg_study):
    work = Workload(prereg_study)
    requests = work.requests(work.cell("p128-r64-n4-stochastic"))
    assert len(requests) == 16
    assert [r.seed for r in requests[:4]] == [1101, 1102, 1103, 1104]
    assert len({r.seed for r in requests}) == 16
    assert all(r.max_new_tokens == 64 and r.eos_token_ids == (151645, 151643) for r in requests)
    greedy = work.requests(work.cell("p128-r64-n4-greedy"))
    assert all(r.seed is None and r.greedy for r in greedy)


def test_partitions_split_by_logical_prompt(prereg_study):
    work = Workload(prereg_study)
    cell = work.cell("p128-r64-n4-stochastic")
    batches = work.partition_batches(cell, (2, 2))
    assert [len(b) for b in batches] == [8, 8]
    assert {r.prompt_index for r in batches[1]} == {2, 3}
    flat = [r for batch in work.partition_batches(cell, (1, 1, 1, 1)) for r in batch]
    assert flat == work.requests(cell)


def test_unknown_cell_lists_valid_ids(prereg_study):
    with pytest.raises(UnknownCellError, match="valid cell ids: p128-r64-n1-greedy"):
        Workload(prereg_study).select(["p128-r64-n1-greedy", "p999-r1-n1-greedy"])
