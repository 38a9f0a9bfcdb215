"""hf_reference (legacy oracle) and hf_cached on the tiny synthetic Qwen3, CPU, real NF4 (bitsandbytes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout_lib.backends import UnknownBackendError, create_backend, known_backends
from rollout_lib.checks.conformance import (
    ConformanceSettings,
    compare_free_running,
    oracle_self_consistency,
    run_conformance,
)
from rollout_lib.models.policy import PolicyIdentityMismatch, policy_versions
from rollout_lib.study.workload import Workload

from .conftest import started_backends


def _pair(study, cache, dtype, policy):
    """The oracle, hf_cached on its default fast path (`graphs`; on a CPU the compact step without
    capture) and hf_cached on the eager path (same sampler as the oracle)."""
    return started_backends(study, policy, (("hf_reference", "hf_reference", {}), ("hf_cached", "hf_cached", {}),
                                            ("hf_cached_eager", "hf_cached", {"decode": "eager"})),
                            device="cpu", compute_dtype=dtype, cache_dir=cache)


@pytest.fixture(scope="module")
def policies(smoke_study):
    return policy_versions(Workload(smoke_study).arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 8)


@pytest.fixture(scope="module")
def f32(smoke_study, snapshot_cache, policies):
    return _pair(smoke_study, snapshot_cache, "float32", policies[0])


@pytest.fixture(scope="module")
def bf16(smoke_study, snapshot_cache, policies):
    return _pair(smoke_study, snapshot_cache, "bfloat16", policies[0])


def _tokens(batch):
    return [(r.token_ids, r.stop_reason) for r in batch.results]


def test_registry_lists_known_backends():
    assert {"hf_reference", "hf_cached"} <= set(known_backends())
    with pytest.raises(UnknownBackendError, match="known backends: hf_cached, hf_reference, vllm"):
        create_backend("hf_turbo", None)


def test_unknown_option_and_dtype_fail_loudly(smoke_study):
    with pytest.raises(ValueError, match="unknown option 'batch'"):
        create_backend("hf_cached", smoke_study, batch=4)
    with pytest.raises(ValueError, match="allowed: bfloat16, float32"):
        create_backend("hf_cached", smoke_study, compute_dtype="float16")


def test_actor_is_real_nf4_and_mirror_holds_dequantized_weights(f32):
    import bitsandbytes as bnb

    from rollout_lib.models.actor import dequantized_linear_weights

    cached = f32["hf_cached"]
    nf4_layers = [m for m in cached.actor.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(nf4_layers) == 2 * 7
    assert nf4_layers[0].weight.quant_state.quant_type == "nf4"
    weights = dequantized_linear_weights(cached.actor.get_base_model())
    cached = f32["hf_cached_eager"]
    mirror_modules = dict(cached.mirror.get_base_model().named_modules())
    for name, weight in weights.items():
        assert name.endswith(".base_layer")
        assert torch.equal(mirror_modules[name].weight, weight.to(torch.float32)), name


@pytest.mark.parametrize("cell_index", range(8))
def test_float32_greedy_identical_on_every_smoke_cell_shape(smoke_study, f32, cell_index):
    work = Workload(smoke_study)
    cells = [c for c in work.cells() if c.sampling.name == "greedy"]
    assert len(cells) == 8
    requests = work.requests(cells[cell_index])
    reference = f32["hf_reference"].generate(requests)
    cached = f32["hf_cached"].generate(requests)
    comparison = compare_free_running(reference.results, cached.results)
    assert comparison["identical"] == len(requests), comparison
    assert all(len(r.token_ids) == cells[cell_index].response_tokens for r in cached.results)


def test_float32_seeded_samples_identical_across_backends(smoke_study, f32):
    """The eager path keeps the oracle's sampler (one torch.Generator per request): same samples.
    The graph path draws counter-based noise instead (DESIGN.md decision 10): other samples, each
    deterministic (tests/test_fast_path.py)."""
    work = Workload(smoke_study)
    requests = work.requests(work.cell("p48-r24-n2-stochastic"))
    reference = f32["hf_reference"].generate(requests)  # sequential, one request at a time
    cached = f32["hf_cached_eager"].generate(requests)  # one batch of 8
    assert _tokens(reference) == _tokens(cached)
    fast = f32["hf_cached"].generate(requests)
    assert _tokens(fast) != _tokens(reference) and _tokens(fast) == _tokens(f32["hf_cached"].generate(requests))


@pytest.mark.parametrize("sampling", ["greedy", "stochastic"])
def test_partition_invariance_float32(smoke_study, f32, sampling):
    work = Workload(smoke_study)
    cell = work.cell(f"p48-r24-n2-{sampling}")
    outputs = []
    for partition in smoke_study.workload.batch_partitions:
        results = [r for batch in work.partition_batches(cell, partition)
                   for r in f32["hf_cached"].generate(batch).results]
        outputs.append([(r.request_id, r.token_ids) for r in results])
    assert outputs[0] == outputs[1] == outputs[2]


def test_same_seed_same_samples_other_seed_other_samples(smoke_study, bf16):
    work = Workload(smoke_study)
    requests = work.requests(work.cell("p16-r24-n1-stochastic"))
    cached = bf16["hf_cached"]
    first, again = cached.generate(requests), cached.generate(requests)
    assert _tokens(first) == _tokens(again)
    reseeded = [dataclasses.replace(r, seed=r.seed + 1000) for r in requests]
    other = cached.generate(reseeded)
    assert all(a.token_ids != b.token_ids for a, b in zip(first.results, other.results, strict=True))
    # a request's samples do not depend on its batch mates
    alone = cached.generate(requests[2:3])
    assert alone.results[0].token_ids == first.results[2].token_ids


@pytest.mark.parametrize("sampling", ["greedy", "stochastic"])
def test_eos_stop_decisions_identical(smoke_study, f32, sampling):
    """Make EOS really occur: declare as EOS a token that row 0 emits at step 3."""
    work = Workload(smoke_study)
    requests = work.requests(work.cell(f"p16-r24-n2-{sampling}"))
    # stochastic tokens are comparable with the oracle's on the eager path (same sampler)
    key = "hf_cached" if sampling == "greedy" else "hf_cached_eager"
    free = f32[key].generate(requests).results[0].token_ids
    eos = free[3]
    stop_requests = [dataclasses.replace(r, eos_token_ids=(eos,)) for r in requests]
    reference = f32["hf_reference"].generate(stop_requests)
    cached = f32[key].generate(stop_requests)
    assert _tokens(reference) == _tokens(cached)
    first = cached.results[0]
    assert first.stop_reason == "eos" and first.token_ids[-1] == eos and len(first.token_ids) == free.index(eos) + 1
    assert any(r.stop_reason == "length" and len(r.token_ids) == 24 for r in cached.results) or all(
        r.stop_reason == "eos" for r in cached.results)
    assert all(len(r.logprobs) == len(r.token_ids) for r in cached.results)


@pytest.mark.parametrize("sampling", ["greedy", "stochastic"])
def test_policy_refresh_changes_identity_and_output(smoke_study, bf16, policies, sampling):
    work = Workload(smoke_study)
    requests = work.requests(work.cell(f"p48-r24-n1-{sampling}"))
    cached = bf16["hf_cached"]
    before = cached.generate(requests)
    identity_2 = cached.sync_policy(policies[1])
    after = cached.generate(requests)
    cached.sync_policy(policies[0])
    assert identity_2 == policies[1].identity != policies[0].identity
    assert len({p.identity for p in policies}) == 8
    assert all(r.policy_identity == identity_2 for r in after.results)
    # the served distribution changed: every request's log-probabilities move
    assert all(a.logprobs != b.logprobs for a, b in zip(before.results, after.results, strict=True))
    if sampling == "stochastic":  # and seeded samples follow the new policy
        assert _tokens(before) != _tokens(after)
    restored = cached.generate(requests)
    assert _tokens(restored) == _tokens(before)
    assert [r.logprobs for r in restored.results] == [r.logprobs for r in before.results]


def test_served_identity_is_checked_against_live_tensors(smoke_study, snapshot_cache, policies):
    cached = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="float32", cache_dir=snapshot_cache)
    cached.cold_start()
    work = Workload(smoke_study)
    with pytest.raises(RuntimeError, match="before sync_policy"):
        cached.generate(work.requests(work.cell("p16-r8-n1-greedy")))
    cached.sync_policy(policies[0])
    # the fast path re-derives the identity from its static buffers: a corrupted copy is caught
    load = cached.engine.load_lora

    def corrupted(tensors, scaling):
        load(tensors, scaling)
        cached.engine.layers[0].proj["qkv"].lora_b.add_(1e-3)

    cached.engine.load_lora = corrupted
    with pytest.raises(PolicyIdentityMismatch, match="serves identity"):
        cached.sync_policy(policies[1])
    cached.teardown()
    eager = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="float32", cache_dir=snapshot_cache,
                           decode="eager")
    eager.cold_start()
    eager.sync_policy(policies[0])
    with torch.no_grad():
        next(p for n, p in eager.mirror.named_parameters() if "lora_B" in n).add_(1e-3)
    with pytest.raises(PolicyIdentityMismatch, match="serves identity"):
        eager._served_identity(eager.mirror, policies[0])
    eager.teardown()


def test_phase_statuses(smoke_study, bf16):
    work = Workload(smoke_study)
    requests = work.requests(work.cell("p16-r8-n1-greedy"))
    reference = bf16["hf_reference"].generate(requests)
    cached = bf16["hf_cached"].generate(requests)
    assert {p.status for p in reference.phases.values()} == {"not_measured"}
    assert all(p.seconds is None for p in reference.phases.values())
    assert {p.status for p in cached.phases.values()} == {"measured"}
    assert cached.phases["prefill_s"].seconds > 0 and cached.phases["decode_s"].seconds > 0
    assert reference.wall_s > 0 and cached.wall_s > 0


def test_the_oracles_scoring_noise_rungs_on_tiny(smoke_study, snapshot_cache):
    """Issue 42's ladder, the oracle against itself: the same rows scored teacher-forced twice one by one
    (run to run: deterministic on CPU, exactly 0) and all together in one padded batch (batch
    composition), on every scored position. The smoke actor computes in bf16; on a CPU whose ATen runs
    its AVX512 kernels a row's scores barely depend on the rows beside it (< 1e-4), on one running its
    AVX2 kernels (session 39's AMD EPYC) the bf16 GEMMs' blocking follows the batch: 0.014, a few bf16
    steps of a logit (on the GPU the GEMM tiling changes with the batch: what the rung measures there)."""

    settings = ConformanceSettings(prompt_tokens=(16,), response_tokens=(8, 24))
    report = oracle_self_consistency(smoke_study, settings, device="cpu", cache_dir=snapshot_cache)
    noise = report["scoring_noise"]
    assert set(noise["cells"]) == {"p16-r8-n1-stochastic", "p16-r24-n1-stochastic"}
    generated = sum(row["generated_tokens"] for rows in report["cells"].values() for row in rows)
    assert sum(c["batch_composition"]["positions"] for c in noise["cells"].values()) == generated > 0
    assert noise["run_to_run_max_abs_diff"] == 0.0
    bound = 0.05 if torch.backends.cpu.get_cpu_capability() == "AVX2" else 1e-4
    assert 0.0 <= noise["batch_composition_max_abs_diff"] < bound


def test_conformance_two_part_check_on_tiny(smoke_study, snapshot_cache):
    settings = ConformanceSettings(prompt_tokens=(16,), response_tokens=(8, 24))
    report = run_conformance(smoke_study, settings, device="cpu", cache_dir=snapshot_cache, show_progress=False)
    checks = report["verdict"]["checks"]
    assert checks["a_float32_greedy_exact"] and checks["a_float32_partitions_exact"] and checks["d_identity_exact"]
    tf = report["bfloat16"]["teacher_forced"]
    assert tf["positions"] == 4 * (8 + 24)
    assert all({"oracle_margin_logits", "near_tie", "position"} <= set(d) for d in tf["disagreements"])
    assert tf["passed"] == (tf["disagreements_beyond_tie_margin"] == 0)
    sampled = report["bfloat16"]["sampled_logprob"]
    assert sampled["passed"] == (sampled["max_abs_diff"] <= smoke_study.tolerances.nf4_sampled_logprob_abs)
    # float32 compute: the mirror's sampled-token log-probabilities match the NF4 scorer far inside tolerance
    assert report["float32"]["sampled_logprob"]["max_abs_diff"] < 1e-4
