"""GPU-marked: the HF backends on the full-size synthetic Qwen3-0.6B actor with real NF4 (bitsandbytes CUDA).

Run on the H200: `python3 -m pytest -q -m gpu`. Skipped on CPU-only machines with a visible reason.
"""

from __future__ import annotations

import dataclasses

import pytest

from rollout_lib.checks.conformance import compare_free_running
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.workload import Workload

from .conftest import started_backends

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_part1]  # docs/reliability.md: GPU suite parts


@pytest.fixture(scope="module")
def policies(prereg_study):
    return policy_versions(Workload(prereg_study).arch, prereg_study.actor.lora, prereg_study.actor.payload_digest, 8)


@pytest.fixture(scope="module")
def f32(prereg_study, policies):
    pair = started_backends(prereg_study, policies[0], (("hf_reference", "hf_reference", {}),
                                                        ("hf_cached", "hf_cached", {})),
                            device="cuda", compute_dtype="float32")
    yield pair
    for backend in pair.values():
        backend.teardown()


def test_full_size_snapshot_digest_matches_preregistration(prereg_study):
    from rollout_lib.models.synthetic import ensure_snapshot

    spec = prereg_study.actor
    info = ensure_snapshot(spec.architecture.name, spec.synthetic_seed, spec.logit_scale, spec.payload_digest)
    assert info.payload_digest == spec.payload_digest


def test_budget_fraction_emulates_16_gib(f32, prereg_study):
    import torch

    cached = f32["hf_cached"]
    total = torch.cuda.get_device_properties(0).total_memory
    if total > prereg_study.memory.budget_bytes:
        assert cached.budget_fraction == pytest.approx(prereg_study.memory.budget_bytes / total)


@pytest.mark.parametrize("cell_id", ["p128-r64-n1-greedy", "p512-r64-n1-greedy"])
def test_float32_greedy_identical_full_size(prereg_study, f32, cell_id):
    work = Workload(prereg_study)
    requests = work.requests(work.cell(cell_id))
    comparison = compare_free_running(f32["hf_reference"].generate(requests).results,
                                      f32["hf_cached"].generate(requests).results)
    assert comparison["identical"] == len(requests), comparison


def test_float32_seeded_samples_graphs_partitions_and_seeds_full_size(prereg_study, f32):
    work = Workload(prereg_study)
    cell = work.cell("p128-r64-n1-stochastic")
    requests = work.requests(cell)
    cached = f32["hf_cached"].generate(requests)
    assert f32["hf_cached"].environment()["decode"] == "graphs"
    # reproducible, and independent of batch mates and partition
    assert [r.token_ids for r in f32["hf_cached"].generate(requests).results] == [r.token_ids for r in cached.results]
    split = [r for batch in work.partition_batches(cell, (1, 1, 1, 1))
             for r in f32["hf_cached"].generate(batch).results]
    assert [r.token_ids for r in split] == [r.token_ids for r in cached.results]
    reseeded = f32["hf_cached"].generate([dataclasses.replace(r, seed=r.seed + 7) for r in requests])
    assert all(a.token_ids != b.token_ids for a, b in zip(cached.results, reseeded.results, strict=True))


def test_eos_stop_identical_full_size(prereg_study, f32):
    work = Workload(prereg_study)
    requests = work.requests(work.cell("p128-r64-n1-greedy"))
    free = f32["hf_cached"].generate(requests).results[1].token_ids
    eos_requests = [dataclasses.replace(r, eos_token_ids=(free[5],)) for r in requests]
    reference = f32["hf_reference"].generate(eos_requests)
    cached = f32["hf_cached"].generate(eos_requests)
    assert [(r.token_ids, r.stop_reason) for r in reference.results] == [
        (r.token_ids, r.stop_reason) for r in cached.results]
    assert cached.results[1].stop_reason == "eos"


def test_policy_refresh_full_size(prereg_study, f32, policies):
    work = Workload(prereg_study)
    requests = work.requests(work.cell("p128-r64-n1-stochastic"))
    cached = f32["hf_cached"]
    before = cached.generate(requests)
    identities = [cached.sync_policy(p) for p in policies]
    assert identities == [p.identity for p in policies] and len(set(identities)) == 8
    after = cached.generate(requests)
    assert [r.token_ids for r in before.results] != [r.token_ids for r in after.results]
    cached.sync_policy(policies[0])
