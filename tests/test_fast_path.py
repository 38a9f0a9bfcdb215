"""hf_cached fast path on CPU: the counter-based noise, and the compact static-cache decoder (the
same step the CUDA graphs capture, run eagerly) against the transformers + peft eager path."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from rollout_lib.backends import counter_noise, create_backend
from rollout_lib.models.policy import PolicyIdentityMismatch, policy_versions
from rollout_lib.study.workload import Workload

# ------------------------------------------------------------------------------------------
# The noise function
# ------------------------------------------------------------------------------------------


def test_noise_is_a_pure_function_of_seed_step_and_index():
    seeds = torch.tensor([1101, 2101, 3101])
    a = counter_noise.uniform(seeds, 7, 1000)
    b = counter_noise.uniform(seeds.clone(), torch.tensor(7), 1000)
    assert torch.equal(a, b)
    assert not torch.equal(a, counter_noise.uniform(seeds, 8, 1000)), "the step must change the noise"
    assert not torch.equal(a[0], a[1]), "the seed must change the noise"


def test_a_rows_noise_does_not_depend_on_its_batch_mates():
    alone = counter_noise.uniform(torch.tensor([2101]), 3, 4096)
    for mates in ([1101, 2101], [2101, 9, 10, 11], [5, 6, 7, 2101]):
        batch = counter_noise.uniform(torch.tensor(mates), 3, 4096)
        assert torch.equal(batch[mates.index(2101)], alone[0])


def test_noise_is_uniform_enough():
    u = counter_noise.uniform(torch.arange(64), 5, 16384).flatten()
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.002 and abs(u.var().item() - 1 / 12) < 0.001
    counts = torch.histc(u, bins=32, min=0.0, max=1.0)
    expected = u.numel() / 32
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 70, f"chi-square {chi2:.1f} over 31 degrees of freedom"  # p < 1e-4 for a uniform source
    # neighbouring indices and neighbouring seeds are not correlated
    grid = counter_noise.uniform(torch.arange(256), 0, 256)
    corr_index = torch.corrcoef(torch.stack([grid[:, :-1].flatten(), grid[:, 1:].flatten()]))[0, 1]
    corr_seed = torch.corrcoef(torch.stack([grid[:-1].flatten(), grid[1:].flatten()]))[0, 1]
    assert abs(corr_index) < 0.02 and abs(corr_seed) < 0.02


def test_the_exponential_race_samples_the_distribution():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.log(p).repeat(4000, 1)
    seeds = torch.arange(4000)
    draws = []
    for step in range(5):
        tokens, logprobs = counter_noise.sample(logits, seeds, step, torch.ones(4000),
                                                torch.zeros(4000, dtype=torch.bool))
        draws.append(tokens)
        assert torch.allclose(logprobs, torch.log(p)[tokens])
    freq = torch.bincount(torch.cat(draws), minlength=4).float() / 20000
    assert torch.allclose(freq, p, atol=0.015), freq
    greedy, _ = counter_noise.sample(logits[:3], seeds[:3], 0, torch.ones(3), torch.ones(3, dtype=torch.bool))
    assert greedy.tolist() == [0, 0, 0]


def test_temperature_scales_the_distribution():
    logits = torch.tensor([[2.0, 0.0]]).repeat(8000, 1)
    hot, _ = counter_noise.sample(logits, torch.arange(8000), 1, torch.full((8000,), 0.5),
                                  torch.zeros(8000, dtype=torch.bool))
    expected = 1 / (1 + math.exp(-1.0))  # softmax([1, 0])[0] at temperature 2
    assert abs((hot == 0).float().mean().item() - expected) < 0.02


# ------------------------------------------------------------------------------------------
# The compact decoder against the eager path (tiny model)
# ------------------------------------------------------------------------------------------

CELLS = ["p48-r24-n2-greedy", "p16-r24-n2-stochastic"]


def assert_same_results(got, want, tolerance: float = 1e-4) -> None:
    """Request by request: the same tokens and stop, log-probabilities within `tolerance` (float32 rounding of
    the same math in another order)."""
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason, a.request_id
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < tolerance, a.request_id


@contextlib.contextmanager
def synced_engine(study, cache_dir, outputs, dtype: str = "float32", **options):
    """A graphs-path hf_cached on the CPU serving the `outputs` fixture's policy (its identity checked), torn
    down afterwards."""
    expected = outputs[(dtype, "graphs")]
    backend = create_backend("hf_cached", study, device="cpu", compute_dtype=dtype, cache_dir=cache_dir, **options)
    backend.cold_start()
    try:
        assert backend.sync_policy(expected["policy"]) == expected["identity"]
        yield backend
    finally:
        backend.teardown()


@pytest.fixture(scope="module")
def outputs(smoke_study, snapshot_cache):
    workload = Workload(smoke_study)
    policy = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)[-1]
    out = {}
    for dtype in ("float32", "bfloat16"):
        for decode in ("eager", "graphs"):
            backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype=dtype, decode=decode,
                                     cache_dir=snapshot_cache)
            backend.cold_start()
            identity = backend.sync_policy(policy)
            runs = {c: backend.generate(workload.requests(workload.cell(c))).results for c in CELLS}
            partition = {c: [r for q in workload.requests(workload.cell(c)) for r in backend.generate([q]).results]
                         for c in CELLS}
            again = {c: backend.generate(workload.requests(workload.cell(c))).results for c in CELLS}
            out[(dtype, decode)] = {"identity": identity, "runs": runs, "partition": partition, "again": again,
                                    "environment": backend.environment(), "policy": policy}
            backend.teardown()
    return out


def test_float32_greedy_tokens_and_stops_equal_the_eager_path(outputs):
    eager, fast = outputs[("float32", "eager")], outputs[("float32", "graphs")]
    assert_same_results(fast["runs"]["p48-r24-n2-greedy"], eager["runs"]["p48-r24-n2-greedy"])


def test_both_paths_serve_the_same_identity(outputs):
    identities = {v["identity"] for v in outputs.values()}
    assert identities == {outputs[("float32", "eager")]["policy"].identity}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_path_sampling_is_deterministic_and_independent_of_partition(outputs, dtype):
    fast = outputs[(dtype, "graphs")]
    for cell in CELLS:
        tokens = [r.token_ids for r in fast["runs"][cell]]
        assert tokens == [r.token_ids for r in fast["again"][cell]], "the same seeds must give the same tokens"
        assert tokens == [r.token_ids for r in fast["partition"][cell]], "one request alone must match its batch row"
    stochastic = [r.token_ids for r in fast["runs"]["p16-r24-n2-stochastic"]]
    assert len(set(stochastic)) == len(stochastic), "different seeds must give different samples"


def test_environment_names_the_path(outputs):
    env = outputs[("float32", "graphs")]["environment"]
    assert env["decode"] == "graphs" and env["cuda_graphs"] is False  # CPU: the same step, not captured
    assert env["graph_buckets"] and env["static_cache_bytes"] > 0
    assert outputs[("float32", "eager")]["environment"]["decode"] == "eager"


def test_unknown_decode_path_is_refused(smoke_study):
    with pytest.raises(ValueError, match="hf_cached: decode 'fast' is not allowed; allowed: graphs, eager"):
        create_backend("hf_cached", smoke_study, device="cpu", decode="fast")


def test_sync_rewrites_the_static_buffers_without_new_buckets(smoke_study, snapshot_cache):
    workload = Workload(smoke_study)
    versions = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 3)
    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="float32", cache_dir=snapshot_cache)
    backend.cold_start()
    buckets = dict(backend.buckets.buckets)
    logprobs = []
    for version in versions:
        assert backend.sync_policy(version) == version.identity
        logprobs.append(backend.generate(workload.requests(workload.cell("p48-r24-n1-greedy"))).results[0].logprobs)
        assert backend.buckets.buckets == buckets, "a policy sync must not rebuild (recapture) any bucket"
    assert len(set(logprobs)) == len(versions), "the served policy must change what is computed"
    backend.teardown()


def test_grouped_lora_copy_writes_every_tensor_exactly(smoke_study, snapshot_cache):
    """The sync copies one group per (projection, A|B) across all layers (stacked buffers); every served
    tensor must equal its source bit for bit, the block-diagonal zeros must stay zero, a partial set goes
    tensor by tensor, and the dense re-read the identity hashes equals the buffers."""
    import torch

    workload = Workload(smoke_study)
    version = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)[-1]
    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="float32", cache_dir=snapshot_cache)
    backend.cold_start()
    engine = backend.engine
    groups = engine.lora_groups()
    assert len(groups) == 2 * len(smoke_study.actor.lora.target_modules)
    assert sorted(n for _, names in groups for n in names) == sorted(engine.lora_views())
    for _, names in groups:
        assert len(names) == len(engine.layers)
    stack_a, _ = engine._lora_stacks["qkv"]
    assert engine.layers[1].proj["qkv"].lora_a.data_ptr() == stack_a[1].data_ptr()  # a slice, not a copy
    engine.load_lora(version.tensors, version.scaling)
    views = engine.lora_views()
    for name, tensor in version.tensors.items():
        assert torch.equal(views[name], tensor), name
    for stack_a, stack_b in engine._lora_stacks.values():  # outside the served blocks: exact zeros
        for stack in (stack_a, stack_b):
            rest = stack.clone()
            for view, _ in groups:
                if view.data_ptr() >= stack.data_ptr() and view.data_ptr() < stack.data_ptr() + stack.nbytes:
                    rest.as_strided(view.size(), view.stride(), view.storage_offset()).zero_()
            assert torch.count_nonzero(rest) == 0
    served = engine.served_lora()
    assert list(served) == list(views)
    assert all(torch.equal(served[n], views[n]) and served[n].is_contiguous() for n in views)
    one = next(iter(version.tensors))
    engine.load_lora({one: torch.full_like(version.tensors[one], 0.5)}, version.scaling)  # a partial set
    assert torch.all(engine.lora_views()[one] == 0.5)
    backend.teardown()


def test_sync_records_its_phases(smoke_study, snapshot_cache):
    workload = Workload(smoke_study)
    version = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 1)[0]
    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="float32", cache_dir=snapshot_cache)
    backend.cold_start()
    backend.sync_policy(version)
    phases = backend.served_policies[-1]["sync_phases_s"]
    assert set(phases) == {"actor_stand_in_s", "copy_into_buffers_s", "identity_from_buffers_s",
                           "identity_gather_s", "identity_wait_s", "identity_hash_s"}
    assert all(value >= 0 for value in phases.values())
    assert phases["identity_gather_s"] + phases["identity_hash_s"] <= phases["identity_from_buffers_s"] + 1e-6
    backend.teardown()


def test_a_preset_actor_skips_the_stand_in_once(smoke_study, snapshot_cache):
    """The refresh check writes the version into the actor before its timer; the sync then copies the
    actor's live tensors. The skip is one-shot: after the actor moves on (a trainer step), a sync of
    the same version writes it again, so what is served is always the version asked for."""
    from rollout_lib.backends.hf_cached import live_lora_tensors

    workload = Workload(smoke_study)
    v1, v2 = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)
    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="float32", cache_dir=snapshot_cache)
    backend.cold_start()
    backend.set_actor_policy(v2)
    assert backend.sync_policy(v2) == v2.identity
    with torch.no_grad():
        next(iter(live_lora_tensors(backend.actor).values())).add_(1.0)  # the actor moves on
    assert backend.sync_policy(v2) == v2.identity, "a second sync must write the version again"
    backend.set_actor_policy(v1)
    with torch.no_grad():
        next(iter(live_lora_tensors(backend.actor).values())).add_(1.0)  # moved on after the preset
    with pytest.raises(PolicyIdentityMismatch, match="hf_cached serves identity"):
        backend.sync_policy(v1)  # the skipped stand-in is covered by the identity check
    backend.teardown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: vLLM's served_bf16_identity
@pytest.mark.parametrize("chunk_bytes", [4, 1000, 4 << 20])
def test_the_streamed_identity_equals_the_policy_identity(smoke_study, chunk_bytes, dtype):
    from rollout_lib.models.fast_identity import policy_identity_streamed
    from rollout_lib.models.policy import policy_identity

    workload = Workload(smoke_study)
    version = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)[-1]
    cast = {name: t.to(getattr(torch, dtype)) for name, t in version.tensors.items()}
    # transposed views: non-contiguous inputs, as the blocks of the fused buffers are
    tensors = {name: t.t().contiguous().t() for name, t in cast.items()}
    expected = policy_identity(version.base_digest, cast)
    too_small = torch.empty(3)
    timings = {}
    assert policy_identity_streamed(version.base_digest, tensors, too_small, timings, chunk_bytes) == expected
    assert set(timings) == {"gather_s", "wait_s", "hash_s"}
    tensors[sorted(tensors)[-1]][0, 0] += 1.0
    assert policy_identity_streamed(version.base_digest, tensors, chunk_bytes=chunk_bytes) != expected


def test_streamed_identity_refuses_mixed_dtypes():
    from rollout_lib.models.fast_identity import policy_identity_streamed

    with pytest.raises(ValueError, match="one dtype and one device"):
        policy_identity_streamed("d", {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.float64)})


def test_unknown_step_compile_is_refused(smoke_study):
    with pytest.raises(ValueError, match="hf_cached: step_compile 'max' is not allowed; allowed: auto, inductor, off"):
        create_backend("hf_cached", smoke_study, device="cpu", step_compile="max")


def test_inductor_step_gives_the_uncompiled_tokens(smoke_study, snapshot_cache):
    """The compiled pieces (LoRA products as reductions, fused norms and rotary, fused sampler) are
    the same float32 math in another order: the same greedy and seeded tokens, log-probabilities
    within float32 rounding. (On a CPU, `auto` means uncompiled; CUDA compiles and captures.)"""
    workload = Workload(smoke_study)
    policy = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)[-1]
    results = {}
    for mode in ("off", "inductor"):
        backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="float32", step_compile=mode,
                                 cache_dir=snapshot_cache)
        backend.cold_start()
        backend.sync_policy(policy)
        results[mode] = {c: backend.generate(workload.requests(workload.cell(c))).results for c in CELLS}
        assert backend.environment()["step_compile"] == mode
        backend.teardown()
    for cell in CELLS:
        assert_same_results(results["inductor"][cell], results["off"][cell])


# ------------------------------------------------------------------------------------------
# The float32 LM head's operands
# ------------------------------------------------------------------------------------------


def test_head_operands_take_the_tied_bf16_embedding_for_the_mirrors_float32_head():
    """The mirror's head is a float32 copy of the tied bf16 embedding (`use_float32_lm_head`). Where the
    bf16 GEMM with float32 output runs, its operands are that embedding itself: no copy; lease 5 found
    the engine had kept the float32 GEMM because it tested the head's dtype instead of its values."""
    from rollout_lib.backends.compact_qwen3 import HEAD_BF16_OPERANDS, HEAD_FLOAT32, head_operands

    gen = torch.Generator().manual_seed(3)
    embed = torch.randn(40000, 16, generator=gen).to(torch.bfloat16)
    head = embed.to(torch.float32)
    mode, operands = head_operands(head, embed, torch.bfloat16, True)
    assert mode == HEAD_BF16_OPERANDS and operands.data_ptr() == embed.data_ptr()
    # untied but exactly bf16-valued: one bf16 copy with the same values
    other = torch.randn(40000, 16, generator=gen).to(torch.bfloat16).to(torch.float32)
    mode, operands = head_operands(other, embed, torch.bfloat16, True)
    assert mode == HEAD_BF16_OPERANDS and operands.dtype == torch.bfloat16
    assert torch.equal(operands.to(torch.float32), other)
    # one value off the bf16 grid (past the first comparison chunk): the float32 GEMM stays
    off_grid = head.clone()
    off_grid[39999, 7] += 2.0 ** -20
    mode, operands = head_operands(off_grid, embed, torch.bfloat16, True)
    assert mode == HEAD_FLOAT32 and operands is off_grid
    # no bf16 GEMM with float32 output (a CPU), or float32 compute: the float32 GEMM
    assert head_operands(head, embed, torch.bfloat16, False)[0] == HEAD_FLOAT32
    mode, operands = head_operands(head, head, torch.float32, True)
    assert mode == HEAD_FLOAT32 and operands.dtype == torch.float32


def test_cpu_engine_keeps_the_float32_head(outputs):
    """On a CPU (no bf16 GEMM with float32 output) the compact engine computes the head as a float32
    GEMM, in both compute dtypes, and says so in its environment."""
    from rollout_lib.backends.compact_qwen3 import HEAD_FLOAT32, _cuda_bf16_gemm_with_float32_output

    assert not _cuda_bf16_gemm_with_float32_output(torch.device("cpu"))
    for dtype in ("float32", "bfloat16"):
        assert outputs[(dtype, "graphs")]["environment"]["lm_head"] == HEAD_FLOAT32


# ------------------------------------------------------------------------------------------
# How the step is compiled: per row count or dynamic; the cache write inside or outside
# ------------------------------------------------------------------------------------------


def _compiled_entries(function) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(function.__code__))


@pytest.mark.parametrize(("shapes", "write", "options"),
                         [("per_rows", "outside", {}), ("dynamic", "outside", {}),
                          ("dynamic", "inside", {"coordinate_descent_tuning": True})])
def test_compiled_step_variants_give_the_uncompiled_tokens(smoke_study, snapshot_cache, monkeypatch, shapes, write,
                                                           options):
    """Every way of compiling the step is the same float32 math: the tokens of the uncompiled step.
    "per_rows" compiles once per row count (4 and 8 rows here), "dynamic" once for both; "inside"
    writes the k/v cache from the compiled piece; inductor options reach the compilation's record."""
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, "STEP_SHAPES", shapes)
    monkeypatch.setattr(compact_qwen3, "CACHE_WRITE", write)
    monkeypatch.setattr(compact_qwen3, "INDUCTOR_OPTIONS", options)
    workload = Workload(smoke_study)
    policy = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)[-1]
    cells = ["p16-r8-n1-greedy", "p16-r8-n2-stochastic"]  # 4 rows, then 8 rows
    results = {}
    for mode in ("off", "inductor"):
        # compiled entries are shared by every engine of a process whose calls pass their guards (a
        # dynamic-shape call passes a per-row entry's guard): start from none, as a measuring process does
        torch._dynamo.reset()
        backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="float32", step_compile=mode,
                                 cache_dir=snapshot_cache)
        backend.cold_start()
        backend.sync_policy(policy)
        before = _compiled_entries(compact_qwen3.CompactQwen3._before_attention)
        results[mode] = {c: backend.generate(workload.requests(workload.cell(c))).results for c in cells}
        if mode == "inductor":
            env = backend.environment()
            assert (env["step_shapes"], env["cache_write"], env["inductor_options"]) == (shapes, write, options)
            compilations = _compiled_entries(compact_qwen3.CompactQwen3._before_attention) - before
            assert compilations == (2 if shapes == "per_rows" else 1), compilations
        backend.teardown()
    for cell in cells:
        assert_same_results(results["inductor"][cell], results["off"][cell])


def test_unknown_compile_variant_is_refused(smoke_study, snapshot_cache, monkeypatch):
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, "STEP_SHAPES", "per_bucket")
    backend = create_backend("hf_cached", smoke_study, device="cpu", step_compile="inductor", cache_dir=snapshot_cache)
    with pytest.raises(ValueError, match=r"STEP_SHAPES 'per_bucket' \(allowed: per_rows, dynamic\)"):
        backend.cold_start()
    backend.teardown()


# ------------------------------------------------------------------------------------------
# How the low-rank term is added (a conformance diagnostic)
# ------------------------------------------------------------------------------------------


def test_lora_add_modes_round_as_their_names_say():
    """float32_once: add in float32, round once (peft's lora.Linear over the bf16 mirror);
    bf16_like_nf4_oracle: round the term to bf16, add in bf16 (peft's Linear4bit, the oracle).
    Different in bf16, one and the same in float32."""
    from rollout_lib.backends.compact_qwen3 import _fused_linear

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, generator=generator)
    weight = torch.randn(256, 64, generator=generator) / 8
    lora_a = torch.randn(8, 64, generator=generator) / 8
    lora_b = torch.randn(256, 8, generator=generator) / 8
    low = (x @ lora_a.T) @ lora_b.T * 2.0
    xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    base = torch.nn.functional.linear(xb, wb)
    low_b = (xb.float() @ lora_a.T) @ lora_b.T * 2.0
    once = _fused_linear(xb, wb, lora_a, lora_b, 2.0)
    like_oracle = _fused_linear(xb, wb, lora_a, lora_b, 2.0, lora_add="bf16_like_nf4_oracle")
    assert torch.equal(once, (base.float() + low_b).to(torch.bfloat16))
    assert torch.equal(like_oracle, base + low_b.to(torch.bfloat16))
    assert (once != like_oracle).any(), "the two roundings should differ somewhere in 1,024 bf16 values"
    f32 = [_fused_linear(x, weight, lora_a, lora_b, 2.0, lora_add=mode) for mode in ("float32_once",
                                                                                    "bf16_like_nf4_oracle")]
    assert torch.equal(f32[0], f32[1]) and torch.allclose(f32[0], x @ weight.T + low, atol=1e-5)


def test_lora_add_is_checked_and_graphs_only(smoke_study, snapshot_cache):
    with pytest.raises(ValueError, match=r"lora_add 'bf16' is not allowed; allowed: float32_once, "
                                         r"bf16_like_nf4_oracle"):
        create_backend("hf_cached", smoke_study, device="cpu", lora_add="bf16", cache_dir=snapshot_cache)
    with pytest.raises(ValueError, match="lora_add applies to decode graphs only"):
        create_backend("hf_cached", smoke_study, device="cpu", decode="eager", lora_add="bf16_like_nf4_oracle",
                       cache_dir=snapshot_cache)


def test_a_conformance_run_with_candidate_options_is_a_diagnostic(smoke_study, snapshot_cache):
    """The gate judges hf_cached as it is measured: a run with other options has its own kind."""
    from rollout_lib.checks.conformance import ConformanceSettings, run_conformance

    settings = ConformanceSettings(prompt_tokens=(16,), response_tokens=(8,), partitions_response_tokens=())
    report = run_conformance(smoke_study, settings, device="cpu", cache_dir=snapshot_cache, show_progress=False,
                             candidate_options={"lora_add": "bf16_like_nf4_oracle"})
    assert report["kind"] == "local_conformance_diagnostic"
    assert report["candidate_options"] == {"lora_add": "bf16_like_nf4_oracle"}
    for dtype in ("float32", smoke_study.actor.quantization.compute_dtype):
        assert report[dtype]["environment"]["hf_cached"]["lora_add"] == "bf16_like_nf4_oracle"
    assert report["verdict"]["checks"]["a_float32_greedy_exact"]  # in float32 the modes are one


def test_a_conformance_run_leaves_a_bf16_only_engine_setting_out_of_its_float32_part(smoke_study, snapshot_cache):
    """Lease 31: the picked engine (LORA_SHRINK in_base_gemm, bf16 only) failed conformance at its float32 part's
    cold start. The float32 part now runs the candidate without it (and without what needs it), says so, and the
    bf16 part runs it whole."""
    from rollout_lib.checks.conformance import ConformanceSettings, run_conformance

    settings = ConformanceSettings(prompt_tokens=(16,), response_tokens=(8,), partitions_response_tokens=())
    engine = {"LORA_SHRINK": "in_base_gemm", "PREFILL": "shared_prompts"}
    report = run_conformance(smoke_study, settings, device="cpu", cache_dir=snapshot_cache, show_progress=False,
                             candidate_options={"engine": engine})
    bf16 = smoke_study.actor.quantization.compute_dtype
    assert report["candidate_options"] == {"engine": engine}
    assert report["float32"]["engine_settings"] == {"PREFILL": "shared_prompts"}
    assert report["float32"]["engine_settings_left_out"] == {
        "LORA_SHRINK": "in_base_gemm: bfloat16 engines only (A is appended to the bf16 base weight as three bf16 "
                       "parts)"}
    assert report[bf16]["engine_settings"] == engine and report[bf16]["engine_settings_left_out"] == {}
    env = {dtype: report[dtype]["environment"]["hf_cached"] for dtype in ("float32", bf16)}
    assert "lora_shrink" not in env["float32"] and env[bf16]["lora_shrink"] == "in_base_gemm"
    assert env["float32"]["prefill"] == env[bf16]["prefill"] == "shared_prompts"
    assert report["verdict"]["checks"]["a_float32_greedy_exact"]


@pytest.mark.parametrize(("engine", "dtype", "kept", "left_out"), [
    ({"ATTENTION_BACKEND": "fa3", "DECODE_PREFIX": "shared", "COMBO_KERNELS": "on"}, "float32",
     {"COMBO_KERNELS": "on"}, {"ATTENTION_BACKEND": "fa3: bfloat16 engines only (FA3's kernels take bf16 or fp16 "
                                                    "only)",
                               "DECODE_PREFIX": "shared: needs ATTENTION_BACKEND fa3 or triton, left out in "
                                                "float32"}),
    ({"ATTENTION_BACKEND": "fa3", "DECODE_PREFIX": "shared"}, "bfloat16",
     {"ATTENTION_BACKEND": "fa3", "DECODE_PREFIX": "shared"}, {}),
    ({"ATTENTION_BACKEND": "triton", "DECODE_PREFIX": "shared"}, "float32",
     {}, {"ATTENTION_BACKEND": "triton: bfloat16 engines only (its kernel multiplies bf16 operands)",
          "DECODE_PREFIX": "shared: needs ATTENTION_BACKEND fa3 or triton, left out in float32"}),
    ({"ATTENTION_BACKEND": "triton", "DECODE_PREFIX": "shared"}, "bfloat16",
     {"ATTENTION_BACKEND": "triton", "DECODE_PREFIX": "shared"}, {}),
    ({"ATTENTION_BACKEND": "triton", "DECODE_PREFIX": "shared_long"}, "float32",
     {}, {"ATTENTION_BACKEND": "triton: bfloat16 engines only (its kernel multiplies bf16 operands)",
          "DECODE_PREFIX": "shared_long: needs ATTENTION_BACKEND fa3 or triton, left out in float32"}),
    ({"ATTENTION_BACKEND": "triton", "COMBO_KERNELS": "on"}, "float32",
     {"COMBO_KERNELS": "on"}, {"ATTENTION_BACKEND": "triton: bfloat16 engines only (its kernel multiplies bf16 "
                                                    "operands)"}),
    ({"ATTENTION_BACKEND": "flex", "READBACK": "pipelined"}, "float32",
     {"ATTENTION_BACKEND": "flex", "READBACK": "pipelined"}, {}),
    ({"ATTENTION_BACKEND": "fa3", "ATTENTION_PLAN": "per_step", "SAMPLER": "chunked"}, "float32",
     {"SAMPLER": "chunked"}, {"ATTENTION_BACKEND": "fa3: bfloat16 engines only (FA3's kernels take bf16 or fp16 "
                                                    "only)",
                              "ATTENTION_PLAN": "per_step: needs ATTENTION_BACKEND fa3, left out in float32"}),
    ({"O_EPILOGUE": "triton", "LORA_SHRINK": "in_base_gemm", "NORM_EPILOGUE_ROW": "slices", "SAMPLER": "chunked"},
     "float32", {"SAMPLER": "chunked"},
     {"LORA_SHRINK": "in_base_gemm: bfloat16 engines only (A is appended to the bf16 base weight as three bf16 parts)",
      "O_EPILOGUE": "triton: needs LORA_SHRINK in_base_gemm, left out in float32",
      "NORM_EPILOGUE_ROW": "slices: needs O_EPILOGUE triton, left out in float32"}),
    ({"ATTENTION_BACKEND": "triton", "ATTENTION_LAUNCH": "by_columns"}, "float32", {},
     {"ATTENTION_BACKEND": "triton: bfloat16 engines only (its kernel multiplies bf16 operands)",
      "ATTENTION_LAUNCH": "by_columns: needs ATTENTION_BACKEND triton, left out in float32"}),
    ({"O_EPILOGUE": "triton", "LORA_SHRINK": "in_base_gemm", "DEPENDENT_LAUNCH": "epilogues"}, "float32", {},
     {"LORA_SHRINK": "in_base_gemm: bfloat16 engines only (A is appended to the bf16 base weight as three bf16 parts)",
      "O_EPILOGUE": "triton: needs LORA_SHRINK in_base_gemm, left out in float32",
      "DEPENDENT_LAUNCH": "epilogues: needs O_EPILOGUE triton, left out in float32"}),
    ({"O_EPILOGUE": "triton", "LORA_SHRINK": "in_base_gemm", "DEPENDENT_LAUNCH": "norm_epilogues"}, "float32", {},
     {"LORA_SHRINK": "in_base_gemm: bfloat16 engines only (A is appended to the bf16 base weight as three bf16 parts)",
      "O_EPILOGUE": "triton: needs LORA_SHRINK in_base_gemm, left out in float32",
      "DEPENDENT_LAUNCH": "norm_epilogues: needs O_EPILOGUE triton, left out in float32"}),
    # the sampler kernel takes float32 logits in either dtype: conformance runs it in float32 too
    ({"SAMPLER": "triton"}, "float32", {"SAMPLER": "triton"}, {}),
    ({"ATTENTION_BACKEND": "triton", "ATTENTION_DEPENDENT_LAUNCH": "prefetch_kv"}, "float32", {},
     {"ATTENTION_BACKEND": "triton: bfloat16 engines only (its kernel multiplies bf16 operands)",
      "ATTENTION_DEPENDENT_LAUNCH": "prefetch_kv: needs ATTENTION_BACKEND triton, left out in float32"}),
])
def test_an_engine_mapping_for_a_dtype_keeps_what_that_dtype_runs(engine, dtype, kept, left_out):
    from rollout_lib.backends.compact_qwen3 import settings_for_dtype

    assert settings_for_dtype(engine, dtype) == (kept, left_out)
    with pytest.raises(ValueError, match="SAMPLER 'fast' is not allowed; allowed: "):
        settings_for_dtype({"SAMPLER": "fast"}, dtype)


def _lora_layer(seed: int, rows: int, in_features: int, out_features: int, rank: int):
    """x (bf16), W (bf16) and float32 LoRA A, B of one projection, at scales like the engine's."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, in_features, generator=generator).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    lora_a = torch.randn(rank, in_features, generator=generator) * 0.03
    lora_b = torch.randn(out_features, rank, generator=generator) * 0.01
    return x, weight, lora_a, lora_b


def test_lora_shrink_in_the_base_gemm_is_the_float32_low_rank_term_in_another_order():
    """Issue 43 candidate (LORA_SHRINK "in_base_gemm"): [W; A_hi; A_mid; A_lo] in one GEMM with float32
    output. The split is exact, and the layer's output is within its two bf16 roundings (the base
    projection, then the sum) of the exact result, as the default path's is."""
    from rollout_lib.backends.compact_qwen3 import _fused_linear

    x, weight, lora_a, lora_b = _lora_layer(seed=4, rows=5, in_features=64, out_features=96, rank=8)
    high = lora_a.bfloat16()
    middle = (lora_a - high.float()).bfloat16()
    last = (lora_a - high.float() - middle.float()).bfloat16()
    assert torch.equal((high.float() + middle.float()) + last.float(), lora_a), "the split is exact"
    weight_cat = torch.cat([weight, high, middle, last])
    got = _fused_linear(x, weight_cat, lora_a, lora_b, 2.0)
    expected = _fused_linear(x, weight, lora_a, lora_b, 2.0)
    base = x.double() @ weight.double().t()
    exact = base + 2.0 * (x.double() @ lora_a.double().t()) @ lora_b.double().t()
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # two bf16 roundings (the base projection, then the sum), each at most half a spacing: 2^-8 relative
    bound = (base.abs() + exact.abs()) * 2.0 ** -8 + 1e-6
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert bool(((expected.double() - exact).abs() <= bound).all())  # the default path obeys the same bound


def test_lora_expand_as_a_gemm_is_the_float32_low_rank_term_in_another_order():
    """Issue 43 candidate (LORA_EXPAND "gemm"): under inductor's reductions the B product may still be a float32
    GEMM; the layer's output is within the same two bf16 roundings of the exact result, whichever form the
    shrink takes, and with reductions off the flag changes nothing."""
    from rollout_lib.backends.compact_qwen3 import _fused_linear

    x, weight, lora_a, lora_b = _lora_layer(seed=5, rows=4, in_features=48, out_features=80, rank=8)
    base = x.double() @ weight.double().t()
    exact = base + 2.0 * (x.double() @ lora_a.double().t()) @ lora_b.double().t()
    bound = (base.abs() + exact.abs()) * 2.0 ** -8 + 1e-6
    for reductions in (True, False):
        got = _fused_linear(x, weight, lora_a, lora_b, 2.0, reductions, expand="gemm")
        assert bool(((got.double() - exact).abs() <= bound).all())
    assert torch.equal(_fused_linear(x, weight, lora_a, lora_b, 2.0, False, expand="gemm"),
                       _fused_linear(x, weight, lora_a, lora_b, 2.0, False))


def test_an_unrolled_lora_expand_adds_the_rank_in_order_and_compiles_without_a_reduction():
    """Issue 43 candidate (LORA_EXPAND "unrolled"): the B product as rank products added one by one. Its float32
    result is the left-to-right float32 sum of the products (a numpy reference, term by term); with integer-valued
    operands it is the exact product; the layer's output stays within the two bf16 roundings; and inductor
    compiles the reduction form to a reduction loop but the unrolled one to none (CPU code: no accumulator)."""
    import numpy as np
    from torch._inductor.utils import run_and_get_code

    from rollout_lib.backends.compact_qwen3 import _fused_linear, _unrolled_expand

    generator = torch.Generator().manual_seed(11)
    xa = torch.randn(3, 2, 16, generator=generator)
    lora_b = torch.randn(40, 16, generator=generator)
    got = _unrolled_expand(xa, lora_b)
    products = xa.numpy()[..., None, :] * lora_b.numpy()  # [3, 2, 40, 16], float32
    reference = products[..., 0].copy()
    for r in range(1, 16):
        reference = (reference + products[..., r]).astype(np.float32)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), reference)
    integers = torch.randint(-8, 9, (3, 2, 16), generator=generator).float()
    integer_b = torch.randint(-8, 9, (40, 16), generator=generator).float()
    assert torch.equal(_unrolled_expand(integers, integer_b), integers @ integer_b.t())

    x, weight, lora_a, lora_b = _lora_layer(seed=12, rows=4, in_features=48, out_features=80, rank=16)
    base = x.double() @ weight.double().t()
    exact = base + 2.0 * (x.double() @ lora_a.double().t()) @ lora_b.double().t()
    bound = (base.abs() + exact.abs()) * 2.0 ** -8 + 1e-6
    got = _fused_linear(x, weight, lora_a, lora_b, 2.0, True, expand="unrolled")
    assert got.dtype == torch.bfloat16 and bool(((got.double() - exact).abs() <= bound).all())
    assert torch.equal(_fused_linear(x, weight, lora_a, lora_b, 2.0, False, expand="unrolled"),
                       _fused_linear(x, weight, lora_a, lora_b, 2.0, False))  # uncompiled path: unchanged

    def code_for(expand: str) -> str:
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, a, b: _fused_linear(x, weight, a, b, 2.0, True, expand=expand),
                                 fullgraph=True)
        result, code = run_and_get_code(compiled, x, lora_a, lora_b)
        assert bool(((result.double() - exact).abs() <= bound).all())
        return "\n".join(code)

    # the shrink (K = 48) is a reduction in both; the expand adds one more only in the reduction form
    assert code_for("reductions").count("tmp_acc") > code_for("unrolled").count("tmp_acc")


def test_a_gemm_split_over_k_is_the_float32_product_in_another_order():
    """Issue 43 candidate (GEMM_SPLIT_K): the projection's GEMM as one batched GEMM over slices of K, the float32
    partial sums added in order. With integer-valued bf16 operands every partial and total sum is exact, so it
    equals the float32 product bit for bit; with random operands the layer's output obeys the same two-rounding
    bound as the one-GEMM path, with the shrink in the base GEMM too, and one slice is the default path itself."""
    from rollout_lib.backends.compact_qwen3 import _fused_linear, _split_k_product

    generator = torch.Generator().manual_seed(7)
    x = torch.randint(-8, 9, (3, 1, 64), generator=generator).bfloat16()
    weight = torch.randint(-8, 9, (40, 64), generator=generator).bfloat16()
    for splits in (2, 4, 8):
        got = _split_k_product(x, weight, splits)
        assert got.dtype == torch.float32 and got.shape == (3, 1, 40)
        assert torch.equal(got, x.float() @ weight.float().t())

    x, weight, lora_a, lora_b = _lora_layer(seed=6, rows=4, in_features=64, out_features=96, rank=8)
    high = lora_a.bfloat16()
    middle = (lora_a - high.float()).bfloat16()
    last = (lora_a - high.float() - middle.float()).bfloat16()
    weight_cat = torch.cat([weight, high, middle, last])
    base = x.double() @ weight.double().t()
    exact = base + 2.0 * (x.double() @ lora_a.double().t()) @ lora_b.double().t()
    bound = (base.abs() + exact.abs()) * 2.0 ** -8 + 1e-6
    for splits in (2, 4):
        for layer_weight in (weight, weight_cat):
            got = _fused_linear(x, layer_weight, lora_a, lora_b, 2.0, split_k=splits)
            assert got.dtype == torch.bfloat16 and bool(((got.double() - exact).abs() <= bound).all())
        plain = _fused_linear(x, weight, None, None, 2.0, split_k=splits)  # a projection without LoRA
        assert bool(((plain.double() - base).abs() <= base.abs() * 2.0 ** -8 + 1e-6).all())
    assert torch.equal(_fused_linear(x, weight, lora_a, lora_b, 2.0, split_k=1),
                       _fused_linear(x, weight, lora_a, lora_b, 2.0))


@pytest.mark.parametrize(("out_features", "in_features", "setting", "multiprocessors", "splits"), [
    # the actor's projections with the LoRA shrink rows (r16) in the GEMM, on a 132-SM H200 / H100
    (4096 + 48, 1024, "auto", 132, 2),  # qkv: 65 tiles of 64 outputs -> 130 blocks
    (1024 + 48, 2048, "auto", 132, 8),  # o: 17 tiles -> 136 blocks
    (6144 + 96, 1024, "auto", 132, 2),  # gate_up: 98 tiles -> 196 blocks
    (1024 + 48, 3072, "auto", 132, 8),  # down: 17 tiles -> 136 blocks
    (1024, 512, "auto", 132, 2),  # each slice at least GEMM_MIN_SLICE long
    (1024, 2048, "auto", None, 1),  # no GPU: nothing to fill
    (1024, 2048, "off", 132, 1),
    (1024, 2048, "4", None, 4),
    (1024, 100, "8", 132, 4),  # halved until it divides K
    (1024, 2050, "8", 132, 2),
])
def test_gemm_splits_per_projection(out_features, in_features, setting, multiprocessors, splits):
    from rollout_lib.backends.compact_qwen3 import gemm_splits

    assert gemm_splits(out_features, in_features, setting, multiprocessors) == splits


def test_an_engine_with_its_gemms_split_over_k_is_the_same_step(smoke_study, snapshot_cache, outputs, monkeypatch):
    """Issue 43 candidate (GEMM_SPLIT_K "4"): every projection of every decode step (one position per row) goes
    through the split, never a prefill's; uncompiled and compiled by inductor, the float32 tokens and stops are the
    default engine's and the log-probabilities agree to float32 rounding (the same sums in another order)."""
    from rollout_lib.backends import compact_qwen3

    # split GEMMs run [decode, prefill, not 4 slices], counted by the step itself (see _counting_run)
    calls = torch.zeros(3, dtype=torch.long)
    split_k_product = compact_qwen3._split_k_product

    def counted(x, weight, splits):
        calls[0 if x.shape[-2] == 1 else 1] += 1
        if splits != 4:
            calls[2] += 1
        return split_k_product(x, weight, splits)

    results, per_mode = _counting_run(smoke_study, snapshot_cache, outputs, monkeypatch, "_split_k_product", counted,
                                      calls, {"GEMM_SPLIT_K": "4"})
    with synced_engine(smoke_study, snapshot_cache, outputs, engine={"GEMM_SPLIT_K": "4"}) as backend:
        assert backend.environment()["gemm_splits"] == {"qkv": 4, "o": 4, "gate_up": 4, "down": 4}
    decode_calls = per_mode["off"][0]
    assert decode_calls > 0 and per_mode == {"off": [decode_calls, 0, 0], "inductor": [decode_calls, 0, 0]}, per_mode
    for cell in CELLS:
        default = outputs[("float32", "graphs")]["runs"][cell]
        assert_same_results(results["off"][cell], default)
        assert_same_results(results["inductor"][cell], default)


@pytest.mark.parametrize(("setting", "value", "allowed"), [
    ("LORA_EXPAND", "gemms", "reductions, gemm, unrolled"),
    ("ATTENTION_BACKEND", "flash", "auto, efficient, cudnn"),
])
def test_an_unknown_engine_setting_is_refused_with_the_allowed_values(smoke_study, snapshot_cache, monkeypatch,
                                                                       setting, value, allowed):
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, setting, value)
    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="bfloat16", decode="graphs",
                             cache_dir=snapshot_cache)
    with pytest.raises(ValueError, match=rf"{setting} '{value}' is not allowed; allowed: {allowed}"):
        backend.cold_start()
    backend.teardown()


def test_every_engine_setting_is_an_engine_attribute_the_environment_names_when_not_the_default(
        smoke_study, snapshot_cache):
    """Lease 39 ran NORM_EPILOGUE_ROW slices with no key for it in the environment (its GPU test read the key and
    failed): each setting an `engine` option takes has an attribute on the engine and a default in hf_cached's
    table, that default is the module's, and a default engine's environment names none of them."""
    from rollout_lib.backends import compact_qwen3
    from rollout_lib.backends.hf_cached import ENGINE_ENVIRONMENT_DEFAULTS

    keys = {name: {"SAMPLER": "sampler_reduction"}.get(name, name.lower()) for name in compact_qwen3.ENGINE_SETTINGS}
    assert set(keys.values()) == set(ENGINE_ENVIRONMENT_DEFAULTS)
    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="bfloat16", decode="graphs",
                             cache_dir=snapshot_cache)
    backend.cold_start()
    try:
        env = backend.environment()
        for name, key in keys.items():
            assert getattr(compact_qwen3, name) == ENGINE_ENVIRONMENT_DEFAULTS[key], name
            assert getattr(backend.engine, key) == ENGINE_ENVIRONMENT_DEFAULTS[key], key
            assert key not in env, key
    finally:
        backend.teardown()


def test_an_engine_with_lora_shrink_in_the_base_gemm_serves_the_policy_exactly(smoke_study, snapshot_cache,
                                                                                monkeypatch, outputs):
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, "LORA_SHRINK", "in_base_gemm")
    workload = Workload(smoke_study)
    policy = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)[-1]
    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="bfloat16", decode="graphs",
                             cache_dir=snapshot_cache)
    backend.cold_start()
    try:
        assert backend.sync_policy(policy) == outputs[("bfloat16", "graphs")]["identity"]
        assert backend.environment()["lora_shrink"] == "in_base_gemm"
        engine = backend.engine
        for layer in engine.layers:
            for linear in layer.proj.values():
                if linear.weight_cat is None:
                    continue
                rows, low = linear.lora_b.shape[0], linear.lora_a.shape[0]
                parts = linear.weight_cat[rows:].float().reshape(3, low, -1)
                assert torch.equal((parts[0] + parts[1]) + parts[2], linear.lora_a)
                assert linear.weight.data_ptr() == linear.weight_cat.data_ptr()  # W is a view: no second copy
        cell = workload.cell("p48-r24-n2-greedy")
        results = backend.generate(workload.requests(cell)).results
        default = outputs[("bfloat16", "graphs")]["runs"]["p48-r24-n2-greedy"]
        same = sum(a.token_ids == b.token_ids for a, b in zip(results, default, strict=True))
        # bf16 arithmetic in another order: a near-tie may flip a greedy token (this machine: 8 of 8 identical)
        assert same >= len(default) - 2, f"greedy tokens identical in only {same} of {len(default)} requests"
    finally:
        backend.teardown()
    assert "lora_shrink" not in outputs[("bfloat16", "graphs")]["environment"], "the default adds no key"


def test_flex_attention_serves_the_same_float32_tokens_and_log_probabilities(smoke_study, snapshot_cache, monkeypatch,
                                                                              outputs):
    """Issue 43 candidate (ATTENTION_BACKEND "flex"): FlexAttention with the boolean mask read in the kernel is the
    same attention: in float32 the smoke actor's greedy tokens and stops are those of SDPA's path and its
    log-probabilities agree to float32 rounding (eager flex on the CPU; compiled on CUDA: test_gpu_fast_path.py)."""
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, "ATTENTION_BACKEND", "flex")
    calls = []
    flex = compact_qwen3._flex_decode
    monkeypatch.setattr(compact_qwen3, "_flex_decode", lambda *args: calls.append(args[0].shape) or flex(*args))
    workload = Workload(smoke_study)
    with synced_engine(smoke_study, snapshot_cache, outputs) as backend:
        assert backend.environment()["attention_backend"] == "flex"
        cell = "p48-r24-n2-greedy"
        results = backend.generate(workload.requests(workload.cell(cell))).results
        assert_same_results(results, outputs[("float32", "graphs")]["runs"][cell])
        # every layer of every decode step went through flex (one query position, the grouped heads as rows)
        assert calls and all(shape[2] == 2 for shape in calls) and len(calls) % 2 == 0, len(calls)  # 2 layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompts_samples_share_one_prefill_and_keep_their_own_tokens(smoke_study, snapshot_cache, monkeypatch,
                                                                       outputs, dtype):
    """Issue 43 item 5 (PREFILL "shared_prompts"): the n samples of a prompt are prefilled once. Each row still
    draws from its own seed's counter noise, so in float32 every request's tokens, stops and log-probabilities
    are those of the per-row prefill; in either dtype a request alone or in a shuffled batch gets the same
    tokens as in its batch, and the prefill really ran on the distinct prompts only."""
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, "PREFILL", "shared_prompts")
    workload = Workload(smoke_study)
    prefill_rows = []
    with synced_engine(smoke_study, snapshot_cache, outputs, dtype) as backend:
        expected = outputs[(dtype, "graphs")]
        assert backend.environment()["prefill"] == "shared_prompts"
        forward = backend.engine.forward
        monkeypatch.setattr(backend.engine, "forward", lambda tokens, *a, **k: (
            prefill_rows.append(tokens.shape[0]) if tokens.shape[1] > 1 else None) or forward(tokens, *a, **k))
        for cell in CELLS:
            requests = workload.requests(workload.cell(cell))
            distinct = len({r.prompt_token_ids for r in requests})
            assert distinct < len(requests), "the cell repeats its prompts (n = 2)"
            prefill_rows.clear()
            results = backend.generate(requests).results
            assert prefill_rows == [distinct]
            shuffled = requests[1::2] + requests[0::2]  # a prompt's samples apart and out of order
            by_id = {r.request_id: r for r in backend.generate(shuffled).results}
            alone = {q.request_id: backend.generate([q]).results[0] for q in requests[:2]}
            for got in results:
                assert got.token_ids == by_id[got.request_id].token_ids
                if got.request_id in alone:
                    assert got.token_ids == alone[got.request_id].token_ids
            if dtype == "float32":
                assert_same_results(results, expected["runs"][cell], tolerance=1e-5)
    assert "prefill" not in outputs[(dtype, "graphs")]["environment"], "the default adds no key"


def test_the_compiled_prefill_gives_the_eager_prefills_tokens(smoke_study, snapshot_cache, monkeypatch):
    """Issue 43 candidate (PREFILL_STEP "compiled_graph"): the prompt's forward through the step's inductor
    pieces (compiled once more, or once per prompt width) with the
    first token's sampling, captured on CUDA (test_gpu_fast_path.py), run as the same function on the CPU.
    Float32: the eager prefill's tokens and stops, log-probabilities within float32 rounding."""
    from rollout_lib.backends import compact_qwen3

    workload = Workload(smoke_study)
    policy = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)[-1]
    cells = ["p16-r8-n2-stochastic", "p48-r24-n2-greedy"]
    results, prefills, compilations = {}, {}, {}
    for step in ("eager", "compiled_graph"):
        monkeypatch.setattr(compact_qwen3, "PREFILL_STEP", step)
        torch._dynamo.reset()
        backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="float32",
                                 step_compile="inductor", cache_dir=snapshot_cache)
        backend.cold_start()
        backend.sync_policy(policy)
        before = _compiled_entries(compact_qwen3.CompactQwen3._before_attention)
        results[step] = {c: backend.generate(workload.requests(workload.cell(c))).results for c in cells}
        compilations[step] = _compiled_entries(compact_qwen3.CompactQwen3._before_attention) - before
        prefills[step] = sorted(backend.buckets.prefills)
        assert backend.environment().get("prefill_step", "eager") == step
        backend.teardown()
    # the prefill really ran through the compiled pieces: one more compilation per prompt width at most (this
    # torch specializes the two widths here: 2)
    assert 1 <= compilations["compiled_graph"] - compilations["eager"] <= 2, compilations
    assert prefills["eager"] == [] and [(rows, width, distinct) for rows, width, _, distinct
                                        in prefills["compiled_graph"]] == [(8, 16, None), (8, 48, None)]
    for cell in cells:
        assert_same_results(results["compiled_graph"][cell], results["eager"][cell])


def _reference_fa3(q, k, v, seqused_k, leftpad_k, scale):
    """FlashAttention-3's decode semantics as `_fa3_decode` relies on them: query head h reads kv head h // G;
    row b reads columns leftpad_k[b] <= j < seqused_k[b]."""
    return _reference_fa3_with_lse(q, k, v, seqused_k, leftpad_k, scale)[0]


def test_the_fa3_decode_path_hands_the_kernel_the_cache_and_the_rows_ranges(smoke_study, snapshot_cache, monkeypatch,
                                                                          outputs):
    """Issue 43 candidate (ATTENTION_BACKEND "fa3": vLLM's FlashAttention-3 over the static cache, on the H200 in
    test_gpu_fast_path.py). On the CPU the kernel is replaced by its reference semantics: the engine must hand it
    the query heads in FA3's grouping, the cache as strided views (no copy per step), and each row's column range
    as int32 left padding and used length; then float32 tokens and log-probabilities are SDPA's."""
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, "ATTENTION_BACKEND", "fa3")
    monkeypatch.setattr(compact_qwen3, "_check_fa3", lambda device, dtype: None)
    calls = []

    def kernel(q, k, v, seqused_k, leftpad_k, scale, plan=None):
        assert plan is None, "ATTENTION_PLAN per_call: each call plans for itself"
        calls.append((seqused_k.dtype, leftpad_k.dtype, k.is_contiguous(), k.stride(-1), q.shape))
        return _reference_fa3(q, k, v, seqused_k, leftpad_k, scale)

    monkeypatch.setattr(compact_qwen3, "_fa3_decode", kernel)
    workload = Workload(smoke_study)
    with synced_engine(smoke_study, snapshot_cache, outputs) as backend:
        expected = outputs[("float32", "graphs")]
        assert backend.environment()["attention_backend"] == "fa3"
        want = {r.request_id: r for cell in CELLS for r in expected["runs"][cell]}
        batches = [workload.requests(workload.cell(cell)) for cell in CELLS]
        # each cell's own batch, then both in one: the 16-token prompts left-padded to the 48-token ones' width
        for requests in [*batches, [q for batch in batches for q in batch]]:
            results = backend.generate(requests).results
            assert_same_results(results, [want[r.request_id] for r in results])
    arch = workload.arch
    assert calls and {c[:4] for c in calls} == {(torch.int32, torch.int32, False, 1)}
    assert {c[4][1:] for c in calls} == {(1, arch.num_attention_heads, arch.head_dim)}


def _reference_fa3_with_lse(q, k, v, seqused_k, leftpad_k, scale, plan=None):
    """`_fa3_attention`'s semantics for T query positions per batch entry, none causal: (out [B, T, H, D],
    log-sum-exp [B, H, T]); `plan` (FA3's scheduler metadata) changes no output."""
    groups = q.shape[2] // k.shape[2]
    keys, values = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) * scale
    columns = torch.arange(k.shape[1])
    keep = (columns[None, :] >= leftpad_k[:, None].long()) & (columns[None, :] < seqused_k[:, None].long())
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), values), torch.logsumexp(scores, dim=-1)


def test_the_fa3_plan_is_made_once_per_decode_step_and_read_by_every_layer(smoke_study, snapshot_cache, monkeypatch,
                                                                            outputs):
    """Issue 43 candidate (ATTENTION_PLAN "per_step"): FA3's scheduler metadata computed once per decode step from
    the step's arguments (`_fa3_plan`) and handed to every layer's call, which then skips its own planning kernel
    (on the H200 in test_gpu_fast_path.py: the same outputs bit for bit). On the CPU the plan is a stand-in tensor
    per step: each step makes one, from the shapes and the rows' ranges its calls get, every layer of that step
    reads that one, and the tokens are the default engine's. Without fa3 the setting is refused; with the shared
    prefix's cascade (two calls of other shapes per layer) no plan is made."""
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, "_check_fa3", lambda device, dtype: None)
    plans, calls = [], []

    def plan_for(positions, heads, kv_heads, head_dim, columns, dtype, seqused_k, leftpad_k):
        plans.append(((positions, heads, kv_heads, head_dim, columns, dtype), seqused_k.tolist(), leftpad_k.tolist()))
        return torch.tensor([len(plans)], dtype=torch.int32)

    def kernel(q, k, v, seqused_k, leftpad_k, scale, plan=None):
        calls.append((int(plan), (q.shape[1], q.shape[2], k.shape[2], q.shape[3], k.shape[1], q.dtype),
                      seqused_k.tolist(), leftpad_k.tolist()))
        return _reference_fa3(q, k, v, seqused_k, leftpad_k, scale)

    monkeypatch.setattr(compact_qwen3, "_fa3_plan", plan_for)
    monkeypatch.setattr(compact_qwen3, "_fa3_decode", kernel)
    workload = Workload(smoke_study)
    want = {r.request_id: r for cell in CELLS for r in outputs[("float32", "graphs")]["runs"][cell]}
    with synced_engine(smoke_study, snapshot_cache, outputs,
                       engine={"ATTENTION_BACKEND": "fa3", "ATTENTION_PLAN": "per_step"}) as backend:
        assert backend.environment()["attention_plan"] == "per_step"
        layers = len(backend.engine.layers)
        for cell in CELLS:
            plans.clear()
            calls.clear()
            results = backend.generate(workload.requests(workload.cell(cell))).results
            assert_same_results(results, [want[r.request_id] for r in results])
            assert plans and len(calls) == layers * len(plans)
            for step, (shapes, used, pad) in enumerate(plans, 1):
                of_step = calls[(step - 1) * layers:step * layers]
                assert {c[0] for c in of_step} == {step}, "every layer of a step reads that step's plan"
                assert all(c[1:] == (shapes, used, pad) for c in of_step), (of_step[0], shapes, used, pad)
    monkeypatch.setattr(compact_qwen3, "_fa3_attention", _reference_fa3_with_lse)  # the cascade's calls
    plans.clear()
    with synced_engine(smoke_study, snapshot_cache, outputs, engine={
            "ATTENTION_BACKEND": "fa3", "ATTENTION_PLAN": "per_step", "DECODE_PREFIX": "shared"}) as backend:
        results = backend.generate(workload.requests(workload.cell(CELLS[0]))).results  # blocks of 2: cascaded
        assert_same_results(results, [want[r.request_id] for r in results])
    assert plans == []
    with pytest.raises(ValueError, match=r"ATTENTION_PLAN per_step needs ATTENTION_BACKEND fa3 "), \
            synced_engine(smoke_study, snapshot_cache, outputs, engine={"ATTENTION_PLAN": "per_step"}):
        pass


def test_the_fa3_wrappers_hand_vllms_ops_their_arguments_in_place(monkeypatch):
    """`_fa3_attention` and `_fa3_plan` call vLLM 0.26's FA3 ops positionally (`_vllm_fa3_C.fwd`,
    `_vllm_fa3_C.get_scheduler_metadata`, as vllm_flash_attn's `flash_attn_varlen_func` and
    `get_scheduler_metadata` call them): the plan goes where the forward reads `scheduler_metadata`, and the plan is
    asked for the forward's own case (no causal mask, no window, no softcap, FA3's own splits and GQA packing)."""
    from rollout_lib.backends import compact_qwen3

    forward, planner = [], []
    monkeypatch.setattr(compact_qwen3, "_fa3_op", lambda: lambda *args: forward.append(args) or ("out", "lse"))
    monkeypatch.setattr(compact_qwen3, "_fa3_plan_op", lambda: lambda *args: planner.append(args) or "plan")
    q, k, v = torch.zeros(3, 1, 4, 8), torch.zeros(3, 20, 2, 8), torch.zeros(3, 20, 2, 8)
    used, pad = torch.tensor([9, 12, 20], dtype=torch.int32), torch.tensor([0, 3, 1], dtype=torch.int32)
    plan = compact_qwen3._fa3_plan(1, 4, 2, 8, 20, torch.bfloat16, used, pad)
    assert plan == "plan" and compact_qwen3._fa3_attention(q, k, v, used, pad, 0.25, plan) == ("out", "lse")
    (args,) = forward
    assert len(args) == 37 and args[:3] == (q, k, v) and args[11] is used and args[16] is pad
    assert args[23:31] == (0.25, False, -1, -1, 0.0, True, "plan", 0)  # scale, causal, window, softcap, ..., plan
    assert all(a is None for i, a in enumerate(args) if i in (3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 17, 18, 19,
                                                                  20, 21, 22, 31, 33))
    (asked,) = planner
    assert asked[:8] == (3, 1, 20, 4, 2, 8, 8, torch.bfloat16) and asked[8] is used and asked[13] is pad
    assert asked[14:] == (None, 0, False, -1, -1, False, 0, None, 0) and asked[9:13] == (None,) * 4
    compact_qwen3._fa3_attention(q, k, v, used, pad, 0.25)
    assert forward[1][29] is None, "without a plan the forward plans for itself"


def test_two_attention_halves_merge_into_attention_over_both():
    from rollout_lib.backends.compact_qwen3 import merge_attention_states

    generator = torch.Generator().manual_seed(11)
    q = torch.randn(3, 2, 4, 8, generator=generator)  # B, T, H, D
    k, v = torch.randn(3, 20, 2, 8, generator=generator), torch.randn(3, 20, 2, 8, generator=generator)
    everything = torch.full((3,), 20, dtype=torch.int32)
    full, _ = _reference_fa3_with_lse(q, k, v, everything, torch.zeros(3, dtype=torch.int32), 0.3)
    first = _reference_fa3_with_lse(q, k, v, torch.tensor([7, 1, 12], dtype=torch.int32),
                                    torch.zeros(3, dtype=torch.int32), 0.3)
    rest = _reference_fa3_with_lse(q, k, v, everything, torch.tensor([7, 1, 12], dtype=torch.int32), 0.3)
    merged = merge_attention_states(*first, *rest)
    assert torch.allclose(merged, full, atol=1e-6), float((merged - full).abs().max())
    swapped = merge_attention_states(first[0], rest[1], rest[0], first[1])
    assert not torch.allclose(swapped, full, atol=1e-3), "the weights follow their halves"


@pytest.mark.parametrize(("prompts", "blocks"), [
    (["a", "a", "b", "b"], 2), (["a", "a", "a", "a"], 4), (["a", "a", "b", "b", "c", "c"], 2),
    (["a", "a", "b", "b", "b", "b"], 2), (["a", "b", "a", "b"], 1), (["a", "a", "a", "b"], 1),
    (["a", "a", "b", "c"], 1), (["a"], 1), (["a", "b", "c", "d"], 1)])
def test_rows_share_a_prefix_only_in_equal_blocks_of_one_prompt(prompts, blocks):
    from rollout_lib.backends.compact_qwen3 import prompt_blocks

    assert prompt_blocks([tuple(p) for p in prompts]) == blocks


@pytest.mark.parametrize(("decode_prefix", "backend", "width", "group"), [
    ("shared", "triton", 128, 2), ("shared", "fa3", 512, 2), ("shared", "sdpa", 512, 1),
    ("shared_long", "triton", 128, 1), ("shared_long", "triton", 255, 1), ("shared_long", "triton", 256, 2),
    ("shared_long", "fa3", 512, 2), ("shared_long", "flex", 512, 1), ("per_row", "triton", 512, 1)])
def test_a_block_reads_its_prompt_once_only_where_the_setting_and_the_prompts_width_say(decode_prefix, backend,
                                                                                          width, group):
    """DECODE_PREFIX "shared_long" is "shared" from SHARED_PROMPT_MIN_COLUMNS (padded) prompt columns; below them,
    and with an attention backend that cannot read a prompt once, each row reads its own copy."""
    from rollout_lib.backends.compact_qwen3 import SHARED_PROMPT_MIN_COLUMNS, shared_prompt_group

    assert SHARED_PROMPT_MIN_COLUMNS == 256
    prompts = [(1, 2), (1, 2), (3, 4), (3, 4)]
    assert shared_prompt_group(decode_prefix, backend, prompts, width) == group
    assert shared_prompt_group(decode_prefix, backend, [(1,), (2,), (3,), (4,)], width) == 1


def test_the_shared_prefix_decode_cascades_per_block_and_keeps_the_tokens(smoke_study, snapshot_cache, monkeypatch,
                                                                         outputs):
    """Issue 43 item 5 candidate (DECODE_PREFIX "shared" with fa3): a block of n rows with one prompt attends to
    the prompt once, from the block's first row, with its n rows as query positions, and each row to its own
    generated columns; the halves merge by log-sum-exp. On the CPU FA3 is replaced by its semantics: float32
    tokens and log-probabilities are the default engine's; a batch whose prompts are not in blocks, and a lone
    request, decode per row."""
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, "_check_fa3", lambda device, dtype: None)
    calls = []

    def kernel(q, k, v, seqused_k, leftpad_k, scale, plan=None):
        assert plan is None, "the cascade's calls plan for themselves"
        calls.append((tuple(q.shape), k.shape[0], seqused_k.tolist(), leftpad_k.tolist()))
        return _reference_fa3_with_lse(q, k, v, seqused_k, leftpad_k, scale)

    monkeypatch.setattr(compact_qwen3, "_fa3_attention", kernel)
    workload = Workload(smoke_study)
    arch = workload.arch
    want = {r.request_id: r for cell in CELLS for r in outputs[("float32", "graphs")]["runs"][cell]}
    with synced_engine(smoke_study, snapshot_cache, outputs,
                       engine={"ATTENTION_BACKEND": "fa3", "DECODE_PREFIX": "shared"}) as backend:
        assert backend.environment()["decode_prefix"] == "shared"
        for cell in CELLS:  # 4 prompts x 2 samples, prompt-major: blocks of 2
            requests = workload.requests(workload.cell(cell))
            calls.clear()
            results = backend.generate(requests).results
            assert_same_results(results, [want[r.request_id] for r in results])
            prompt = len(requests[0].prompt_token_ids)
            shared = [c for c in calls if c[0][1] == 2]
            assert shared and all(c[0] == (4, 2, arch.num_attention_heads, arch.head_dim) and c[1] == 4
                                  and c[2] == [prompt] * 4 and c[3] == [0] * 4 for c in shared), shared[:2]
            own = [c for c in calls if c[0][1] == 1]
            assert len(own) == len(shared) and all(c[3] == [prompt] * 8 for c in own)
        assert sorted(backend.buckets.shared_prefix_buckets) and \
            {key[2] for key in backend.buckets.shared_prefix_buckets} == {2}
        assert "graph_buckets_shared_prefix" in backend.environment()
        requests = workload.requests(workload.cell(CELLS[0]))
        interleaved = requests[0::2] + requests[1::2]  # q0s0, q1s0, ... : not in blocks
        calls.clear()
        results = backend.generate(interleaved).results
        assert_same_results(results, [want[r.request_id] for r in results])
        assert calls and all(c[0][1] == 1 and c[3] == [0] * 8 for c in calls), "per row: no prefix call"


def test_the_shared_prefix_merge_compiles_with_the_step(smoke_study, snapshot_cache, monkeypatch, outputs):
    """With the step compiled (as on the GPU), the two halves' merge is one compiled function per engine, and the
    float32 tokens stay the default engine's."""
    from rollout_lib.backends import compact_qwen3

    monkeypatch.setattr(compact_qwen3, "_check_fa3", lambda device, dtype: None)
    monkeypatch.setattr(compact_qwen3, "_fa3_attention", _reference_fa3_with_lse)
    torch._dynamo.reset()
    workload = Workload(smoke_study)
    cell = "p16-r24-n2-stochastic"
    with synced_engine(smoke_study, snapshot_cache, outputs, step_compile="inductor",
                       engine={"ATTENTION_BACKEND": "fa3", "DECODE_PREFIX": "shared"}) as backend:
        assert backend.engine.merge is not compact_qwen3.merge_attention_states
        assert_same_results(backend.generate(workload.requests(workload.cell(cell))).results,
                            outputs[("float32", "graphs")]["runs"][cell])


def test_an_engine_under_a_reduction_launch_rule_compiles_each_piece_under_it(smoke_study, snapshot_cache, outputs):
    """REDUCTION_LAUNCH "fewest_programs": every compiled piece runs under the rule (a CPU's C++ kernels have no
    launch configuration to pick: the hook is inert here, the GPU test picks), with inductor's autotune cache off
    for these compilations, and the float32 tokens stay the default engine's."""
    from rollout_lib.backends import reduction_launch

    torch._dynamo.reset()
    workload = Workload(smoke_study)
    cell = "p16-r24-n2-stochastic"
    with synced_engine(smoke_study, snapshot_cache, outputs, step_compile="inductor",
                       engine={"REDUCTION_LAUNCH": "fewest_programs"}) as backend:
        engine = backend.engine
        assert engine.inductor_options == {"autotune_local_cache": False, "autotune_remote_cache": False}
        for piece in (engine.before_attention, engine.after_attention, engine.sample):
            assert piece.__wrapped__ is not None and piece.__name__ == piece.__wrapped__.__name__
        assert backend.environment()["reduction_launch"] == "fewest_programs"
        assert_same_results(backend.generate(workload.requests(workload.cell(cell))).results,
                            outputs[("float32", "graphs")]["runs"][cell])
    assert reduction_launch.PICKS == {}, "no Triton kernel on a CPU"


@pytest.mark.parametrize(("settings", "dtype", "message"), [
    ({"LORA_SHRINK": "in_base_gemm"}, "float32",
     r"LORA_SHRINK in_base_gemm needs a bfloat16 engine, not torch\.float32"),
    ({"ATTENTION_BACKEND": "fa3"}, "bfloat16", r"ATTENTION_BACKEND fa3 needs a bf16 engine on a Hopper GPU .*cpu"),
    ({"DECODE_PREFIX": "shared"}, "float32",
     r"DECODE_PREFIX shared needs ATTENTION_BACKEND fa3 or triton \(.*\); this engine: ATTENTION_BACKEND auto"),
    ({"LORA_EXPAND": "triton"}, "float32", r"LORA_EXPAND triton needs a CUDA GPU and Triton; this engine: cpu"),
    ({"GEMM_KERNEL": "triton_skinny"}, "float32", r"GEMM_KERNEL triton_skinny needs a bfloat16 engine, not "),
    ({"GEMM_KERNEL": "triton_skinny", "GEMM_SPLIT_K": "4"}, "bfloat16",
     r"GEMM_KERNEL triton_skinny splits K itself; this engine: GEMM_SPLIT_K 4 \(allowed with it: off\)"),
    ({"GEMM_KERNEL": "triton_skinny"}, "bfloat16", r"GEMM_KERNEL triton_skinny needs a CUDA GPU and Triton; this "
                                                   r"engine: cpu"),
    ({"GEMM_KERNEL": "triton_skinny_o_down"}, "float32",
     r"GEMM_KERNEL triton_skinny_o_down needs a bfloat16 engine, not "),
    ({"GEMM_KERNEL": "triton_skinny_o_down", "GEMM_SPLIT_K": "auto"}, "bfloat16",
     r"GEMM_KERNEL triton_skinny_o_down splits K itself; this engine: GEMM_SPLIT_K auto \(allowed with it: off\)"),
    ({"GATE_UP_EPILOGUE": "triton"}, "bfloat16",
     r"GATE_UP_EPILOGUE triton needs LORA_SHRINK in_base_gemm \(its kernel reads the shrink's rows from the gate_up "
     r"GEMM's output\); this engine: LORA_SHRINK reductions"),
    ({"GATE_UP_EPILOGUE": "triton", "LORA_SHRINK": "in_base_gemm"}, "bfloat16",
     r"GATE_UP_EPILOGUE triton needs a CUDA GPU and Triton; this engine: cpu"),
    ({"O_EPILOGUE": "triton"}, "bfloat16",
     r"O_EPILOGUE triton needs LORA_SHRINK in_base_gemm \(its kernel reads the shrink's rows from the o GEMM's "
     r"output\); this engine: LORA_SHRINK reductions"),
    ({"O_EPILOGUE": "triton", "LORA_SHRINK": "in_base_gemm"}, "bfloat16",
     r"O_EPILOGUE triton needs a CUDA GPU and Triton; this engine: cpu"),
    ({"DOWN_EPILOGUE": "triton"}, "float32", r"DOWN_EPILOGUE triton needs LORA_SHRINK in_base_gemm \(its kernel "
                                             r"reads the shrink's rows from the down GEMM's output\)"),
    ({"DOWN_EPILOGUE": "triton", "LORA_SHRINK": "in_base_gemm"}, "bfloat16",
     r"DOWN_EPILOGUE triton needs a CUDA GPU and Triton; this engine: cpu"),
    ({"QKV_EPILOGUE": "triton"}, "bfloat16", r"QKV_EPILOGUE triton needs LORA_SHRINK in_base_gemm \(its kernel "
                                             r"reads the shrink's rows from the qkv GEMM's output\)"),
    ({"QKV_EPILOGUE": "triton", "LORA_SHRINK": "in_base_gemm"}, "bfloat16",
     r"QKV_EPILOGUE triton needs a CUDA GPU and Triton; this engine: cpu"),
    ({"NORM_EPILOGUE_ROW": "slices", "LORA_SHRINK": "in_base_gemm", "DOWN_EPILOGUE": "triton"}, "bfloat16",
     r"NORM_EPILOGUE_ROW slices needs O_EPILOGUE triton \(it is how that kernel \(and DOWN_EPILOGUE triton's\) is "
     r"launched\); this engine: O_EPILOGUE inductor"),
    ({"ATTENTION_LAUNCH": "by_columns"}, "bfloat16",
     r"ATTENTION_LAUNCH by_columns needs ATTENTION_BACKEND triton \(it chooses that kernel's launch configuration\); "
     r"this engine: ATTENTION_BACKEND auto"),
    ({"SAMPLER": "triton"}, "float32", r"SAMPLER triton needs a CUDA GPU and Triton; this engine: cpu"),
    ({"WEIGHT_PREFETCH": "rest_of_layer"}, "bfloat16",
     r"WEIGHT_PREFETCH rest_of_layer needs a CUDA GPU of compute capability 9.0 or later \(sm_90's bulk L2 "
     r"prefetch\) and Triton; this engine: cpu$"),
    ({"DEPENDENT_LAUNCH": "epilogues"}, "bfloat16",
     r"DEPENDENT_LAUNCH epilogues needs a CUDA GPU of compute capability 9.0 or later \(programmatic dependent "
     r"launch\) and Triton; this engine: cpu$"),
    ({"ATTENTION_DEPENDENT_LAUNCH": "prefetch_kv"}, "bfloat16",
     r"ATTENTION_DEPENDENT_LAUNCH prefetch_kv needs a CUDA GPU of compute capability 9.0 or later \(programmatic "
     r"dependent launch\) and Triton; this engine: cpu$"),
    ({"DEPENDENT_LAUNCH": "epilogues_from_16_rows"}, "bfloat16",
     r"DEPENDENT_LAUNCH epilogues_from_16_rows needs a CUDA GPU of compute capability 9.0 or later \(programmatic "
     r"dependent launch\) and Triton; this engine: cpu$"),
    ({"WEIGHT_PREFETCH_BY": "attention"}, "bfloat16",
     r"WEIGHT_PREFETCH_BY attention issues WEIGHT_PREFETCH's plans from ATTENTION_BACKEND triton's kernel; this "
     r"engine: WEIGHT_PREFETCH off, ATTENTION_BACKEND auto \(allowed with it: WEIGHT_PREFETCH rest_of_layer or "
     r"through_next_qkv, ATTENTION_BACKEND triton\)$"),
    ({"WEIGHT_PREFETCH_BY": "side_stream_wide"}, "bfloat16",
     r"WEIGHT_PREFETCH_BY side_stream_wide widens WEIGHT_PREFETCH's kernel; this engine: WEIGHT_PREFETCH off "
     r"\(allowed with it: rest_of_layer, through_next_qkv\)$"),
    ({"WEIGHT_PREFETCH_BY": "attention", "WEIGHT_PREFETCH": "rest_of_layer"}, "bfloat16",
     r"WEIGHT_PREFETCH_BY attention .* this engine: WEIGHT_PREFETCH rest_of_layer, ATTENTION_BACKEND auto "),
])
def test_an_engine_setting_is_refused_where_it_cannot_run(smoke_study, snapshot_cache, monkeypatch, settings, dtype,
                                                          message):
    from rollout_lib.backends import compact_qwen3

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # LORA_EXPAND triton runs on a CPU only in the interpreter
    for name, value in settings.items():
        monkeypatch.setattr(compact_qwen3, name, value)
    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype=dtype, decode="graphs",
                             cache_dir=snapshot_cache)
    with pytest.raises(ValueError, match=message):
        backend.cold_start()
    backend.teardown()


def test_an_engine_candidate_is_an_option_of_one_backend_not_a_module_edit(smoke_study, snapshot_cache, outputs):
    """hf_cached's `engine` option sets issue 43's candidates for this backend alone (a conformance run or a
    campaign can name them; `rollout conformance --candidate-option 'engine={...}'`); the module's defaults stay,
    the environment names what differs, and the float32 tokens stay the default engine's."""
    from rollout_lib.backends import compact_qwen3

    workload = Workload(smoke_study)
    with synced_engine(smoke_study, snapshot_cache, outputs,
                       engine={"PREFILL": "shared_prompts", "LORA_EXPAND": "gemm"}) as backend:
        env = backend.environment()
        assert (env["prefill"], env["lora_expand"]) == ("shared_prompts", "gemm") and "lora_shrink" not in env
        assert (compact_qwen3.PREFILL, compact_qwen3.LORA_EXPAND) == ("per_row", "reductions")
        cell = "p16-r24-n2-stochastic"
        assert_same_results(backend.generate(workload.requests(workload.cell(cell))).results,
                            outputs[("float32", "graphs")]["runs"][cell])


@pytest.mark.parametrize(("options", "message"), [
    ({"engine": {"LORA_SHRINK": "fused"}}, "hf_cached: LORA_SHRINK 'fused' is not allowed; allowed: reductions, "
                                           "in_base_gemm"),
    ({"engine": {"STEP_SHAPES": "dynamic"}}, "hf_cached: engine setting 'STEP_SHAPES' is not allowed; allowed: "
                                             "LORA_SHRINK, LORA_EXPAND, ATTENTION_BACKEND, PREFILL, PREFILL_STEP"),
    ({"engine": ["PREFILL=shared_prompts"]}, "hf_cached: engine ['PREFILL=shared_prompts'] is not allowed; allowed: "
                                             "a mapping of LORA_SHRINK"),
    ({"engine": {"PREFILL": "shared_prompts"}, "decode": "eager"}, "hf_cached: engine settings apply to decode "
                                                                   "graphs only"),
])
def test_a_bad_engine_option_is_refused_before_anything_loads(smoke_study, options, message):
    with pytest.raises(ValueError) as caught:
        create_backend("hf_cached", smoke_study, device="cpu", **options)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def _uncompiled_and_compiled(study, cache_dir, outputs, engine: dict[str, str], pieces: tuple,
                             after_mode=None) -> dict[str, dict]:
    """The CELLS' results of a float32 engine with `engine` settings, its step uncompiled ("off") and through
    inductor ("inductor"), each in a fresh dynamo state; checks the environment names every setting and that
    inductor compiled each of `pieces` (functions) at least once more. `after_mode(mode)` runs after each
    mode's generate calls."""
    workload = Workload(study)
    policy = outputs[("float32", "graphs")]["policy"]
    results = {}
    for mode in ("off", "inductor"):
        torch._dynamo.reset()
        backend = create_backend("hf_cached", study, device="cpu", compute_dtype="float32", step_compile=mode,
                                 cache_dir=cache_dir, engine=engine)
        backend.cold_start()
        backend.sync_policy(policy)
        before = [_compiled_entries(piece) for piece in pieces]
        results[mode] = {c: backend.generate(workload.requests(workload.cell(c))).results for c in CELLS}
        if after_mode is not None:
            after_mode(mode)
        env = backend.environment()
        assert all(env[name.lower()] == value for name, value in engine.items()
                   if name.lower() in env or value != "auto"), env
        if mode == "inductor":
            assert all(_compiled_entries(piece) > count for piece, count in zip(pieces, before, strict=True))
        backend.teardown()
    return results


def _counting_run(study, cache_dir, outputs, monkeypatch, attribute: str, counted, calls: torch.Tensor,
                  engine: dict[str, str]) -> tuple[dict[str, dict], dict[str, list[int]]]:
    """`_uncompiled_and_compiled` over both pieces that hold projections, with compact_qwen3.<attribute> replaced
    by `counted`, which adds to the tensor `calls` (the step counts itself: an in-place add that the compiled piece
    runs at every call too; a Python list would put its length in dynamo's guards). Returns the results and each
    mode's counts."""
    from rollout_lib.backends import compact_qwen3

    per_mode = {}

    def take_count(mode):
        per_mode[mode] = calls.tolist()
        calls.zero_()

    monkeypatch.setattr(compact_qwen3, attribute, counted)
    results = _uncompiled_and_compiled(study, cache_dir, outputs, engine,
                                       (compact_qwen3.CompactQwen3._before_attention,
                                        compact_qwen3.CompactQwen3._after_attention), after_mode=take_count)
    return results, per_mode


def test_one_piece_across_layers_is_the_same_step(smoke_study, snapshot_cache, outputs):
    """Issue 43 candidate (STEP_PIECES "across_layers": a layer's MLP and residual with the next layer's norm,
    projections and rotary in one compiled piece, so the residual add and the RMSNorm fuse). Uncompiled it is
    the very same sequence of operations (identical results); compiled by inductor it is the same float32 math
    in another order, compiled once for every layer boundary."""
    from rollout_lib.backends import compact_qwen3

    results = _uncompiled_and_compiled(smoke_study, snapshot_cache, outputs, {"STEP_PIECES": "across_layers"},
                                       (compact_qwen3.CompactQwen3._between_layers,))
    for cell in CELLS:
        default = outputs[("float32", "graphs")]["runs"][cell]
        assert_same_results(results["off"][cell], default, tolerance=1e-12)
        assert_same_results(results["inductor"][cell], default)


def test_the_unrolled_lora_expand_keeps_the_engine_s_tokens(smoke_study, snapshot_cache, outputs, monkeypatch):
    """LORA_EXPAND "unrolled" in the float32 engine: uncompiled the very same path as the default (the B product is
    a GEMM there); compiled by inductor the same float32 math in a fixed order: the default's tokens and stops,
    log-probabilities within the comparison's tolerance, with both compiled pieces that hold projections, and the
    unrolled form run by the compiled step's projections (counted by the step; never uncompiled)."""
    from rollout_lib.backends import compact_qwen3

    calls = torch.zeros(1, dtype=torch.long)  # see _counting_run
    unrolled = compact_qwen3._unrolled_expand

    def counted(xa, lora_b):
        calls[0] += 1
        return unrolled(xa, lora_b)

    results, per_mode = _counting_run(smoke_study, snapshot_cache, outputs, monkeypatch, "_unrolled_expand", counted,
                                      calls, {"LORA_EXPAND": "unrolled"})
    # uncompiled the B product is a GEMM (never unrolled); compiled, each layer's four projections unroll it
    assert per_mode["off"][0] == 0 and per_mode["inductor"][0] > 0 and per_mode["inductor"][0] % 4 == 0, per_mode
    for cell in CELLS:
        default = outputs[("float32", "graphs")]["runs"][cell]
        assert_same_results(results["off"][cell], default, tolerance=1e-12)
        assert_same_results(results["inductor"][cell], default)


def test_the_unrolled_expand_per_part_is_the_dense_one_bit_for_bit():
    """LORA_EXPAND "unrolled_parts" (issue 43): a fused projection's block-diagonal B expanded part by part, each
    part with only its own rank terms, gives `_unrolled_expand`'s float32 result bit for bit (there a part's sum
    starts with exact zeros and adds exact zeros after its own terms), whatever B's strides (rank-major storage
    included); a single part is the dense expand itself."""
    from rollout_lib.backends.compact_qwen3 import _unrolled_expand, _unrolled_expand_parts

    generator = torch.Generator().manual_seed(21)
    rank, part_out = 16, (24, 8, 8)  # qkv-like: q wider than k and v
    xa = torch.randn(4, 1, rank * len(part_out), generator=generator)
    lora_b = torch.zeros(sum(part_out), rank * len(part_out))
    start = 0
    for index, rows in enumerate(part_out):  # block-diagonal, as the engine's fused buffers
        lora_b[start:start + rows, index * rank:(index + 1) * rank] = torch.randn(rows, rank, generator=generator)
        start += rows
    dense = _unrolled_expand(xa, lora_b)
    assert torch.equal(_unrolled_expand_parts(xa, lora_b, part_out), dense)
    rank_major = lora_b.t().contiguous().t()
    assert rank_major.stride() == (1, sum(part_out)) and torch.equal(rank_major, lora_b)
    assert torch.equal(_unrolled_expand_parts(xa, rank_major, part_out), dense)
    single = torch.randn(40, rank, generator=generator)
    assert torch.equal(_unrolled_expand_parts(xa[..., :rank], single, (40,)), _unrolled_expand(xa[..., :rank], single))


def test_the_unrolled_expand_per_part_keeps_the_engine_s_tokens(smoke_study, snapshot_cache, outputs, monkeypatch):
    """LORA_EXPAND "unrolled_parts" in the float32 engine: B's stacked buffers are rank-major (same shapes and
    values, B[:, r] contiguous), a sync still serves the policy under its identity (checked by `synced_engine`),
    and the compiled step, which runs the per-part expand in each layer's projections (counted), keeps the default
    engine's tokens and stops, log-probabilities within the comparison's tolerance."""
    from rollout_lib.backends import compact_qwen3

    workload = Workload(smoke_study)
    calls = torch.zeros(1, dtype=torch.long)
    per_part = compact_qwen3._unrolled_expand_parts

    def counted(xa, lora_b, part_out):
        calls[0] += 1
        return per_part(xa, lora_b, part_out)

    monkeypatch.setattr(compact_qwen3, "_unrolled_expand_parts", counted)
    torch._dynamo.reset()
    with synced_engine(smoke_study, snapshot_cache, outputs, step_compile="inductor",
                       engine={"LORA_EXPAND": "unrolled_parts"}) as backend:
        engine = backend.engine
        for _, stack_b in engine._lora_stacks.values():
            _, out, columns = stack_b.shape
            assert stack_b.stride() == (out * columns, 1, out)
        assert backend.environment()["lora_expand"] == "unrolled_parts"
        for cell in CELLS:
            assert_same_results(backend.generate(workload.requests(workload.cell(cell))).results,
                                outputs[("float32", "graphs")]["runs"][cell])
    assert int(calls[0]) > 0  # counted inside the compiled pieces, as the steps run them


def test_autotune_rows_largest_captures_the_largest_row_count_first(smoke_study, snapshot_cache, outputs):
    """AUTOTUNE_ROWS "largest": the cold start captures the buckets of the largest row count first (so inductor's
    first run of each compiled kernel, where it picks the launch configuration kept for every row count, is at
    that row count); the default keeps the study's order. The same buckets either way, the same tokens."""
    workload, spec = Workload(smoke_study), smoke_study.workload
    rows = [spec.logical_prompts * n for n in spec.samples_per_prompt]
    assert rows[0] < max(rows), "the smoke study lists its smallest row count first"
    orders = {}
    for engine in ({}, {"AUTOTUNE_ROWS": "largest"}):
        with synced_engine(smoke_study, snapshot_cache, outputs, engine=engine) as backend:
            orders[bool(engine)] = [key[0] for key in backend.buckets.buckets]
            assert backend.environment().get("autotune_rows") == engine.get("AUTOTUNE_ROWS")
            if engine:
                for cell in CELLS:
                    assert_same_results(backend.generate(workload.requests(workload.cell(cell))).results,
                                        outputs[("float32", "graphs")]["runs"][cell], tolerance=1e-12)
    assert orders[False][0] == rows[0] and orders[True][0] == max(rows)
    assert sorted(orders[False]) == sorted(orders[True])


def test_combo_kernels_reach_inductor_for_this_engine_only(smoke_study, snapshot_cache, outputs):
    """COMBO_KERNELS "on" (issue 43; lease 30's `+combo` gained in every probed cell): this engine's compilations get
    inductor's `combo_kernels` and its environment says so; the module's options stay empty for other engines, a
    value outside the allowed ones is refused by name; float32 tokens are the default engine's."""
    from rollout_lib.backends import compact_qwen3

    workload = Workload(smoke_study)
    torch._dynamo.reset()
    with synced_engine(smoke_study, snapshot_cache, outputs, step_compile="inductor",
                       engine={"COMBO_KERNELS": "on"}) as backend:
        env = backend.environment()
        assert env["combo_kernels"] == "on" and env["inductor_options"] == {"combo_kernels": True}
        assert compact_qwen3.INDUCTOR_OPTIONS == {}
        for cell in CELLS:
            assert_same_results(backend.generate(workload.requests(workload.cell(cell))).results,
                                outputs[("float32", "graphs")]["runs"][cell])
    with pytest.raises(ValueError, match=r"COMBO_KERNELS 'yes' is not allowed; allowed: off, on"):
        compact_qwen3.check_engine_settings({"COMBO_KERNELS": "yes"})


def test_shared_prompts_in_the_compiled_prefill_graph(smoke_study, snapshot_cache, outputs):
    """Both prefill candidates together: the compiled prefill runs on the distinct prompts only and copies their
    k/v and logits to every row inside the same function (the captured graph on CUDA), each row's spread given
    per call, so a shuffled batch reuses the graph. Float32: the default engine's tokens and log-probabilities."""
    workload = Workload(smoke_study)
    expected = outputs[("float32", "graphs")]
    torch._dynamo.reset()
    with synced_engine(smoke_study, snapshot_cache, outputs, step_compile="inductor",
                       engine={"PREFILL": "shared_prompts", "PREFILL_STEP": "compiled_graph"}) as backend:
        for cell in CELLS:
            requests = workload.requests(workload.cell(cell))
            assert_same_results(backend.generate(requests).results, expected["runs"][cell])
            shuffled = requests[1::2] + requests[0::2]
            results = backend.generate(shuffled).results
            assert_same_results(results, [next(r for r in expected["runs"][cell] if r.request_id == q.request_id)
                                          for q in results])
        rows = len(workload.requests(workload.cell(CELLS[0])))
        assert sorted((r, w, d) for r, w, _, d in backend.buckets.prefills) == [(rows, 16, rows // 2),
                                                                                 (rows, 48, rows // 2)]


@pytest.mark.parametrize("vocab", [151936, 1024, 1187])
def test_the_chunked_sampler_draws_the_same_tokens(vocab):
    """Issue 43 candidate (SAMPLER "chunked"): the same noise and formulas with the vocabulary reductions split
    into chunks (128 for Qwen3's 151,936 = 128 x 1,187; one for a prime vocabulary). Greedy and seeded rows
    get the same tokens as `sample`; log-probabilities agree to float32 rounding, and the chunked sum is no
    further from a float64 reference than the one-pass sum."""
    from rollout_lib.backends import counter_noise

    generator = torch.Generator().manual_seed(vocab)
    rows = 16
    logits = torch.randn(rows, vocab, generator=generator) * 3
    seeds = torch.randint(0, 2**31, (rows,), generator=generator)
    greedy = torch.arange(rows) % 3 == 0
    inv_temperature = torch.where(greedy | (torch.arange(rows) % 2 == 0), 1.0, 1 / 0.7)
    chunks = counter_noise.vocabulary_chunks(vocab)
    assert chunks == {151936: 128, 1024: 128, 1187: 1}[vocab]
    for step in range(3):
        want, want_logp = counter_noise.sample(logits, seeds, torch.tensor(step), inv_temperature, greedy)
        got, got_logp = counter_noise.sample_chunked(logits, seeds, torch.tensor(step), inv_temperature, greedy,
                                                     chunks)
        assert torch.equal(got, want)
        exact = torch.log_softmax(logits.double() * inv_temperature[:, None].double(), -1)
        exact = exact.gather(-1, got[:, None])[:, 0]
        assert float((got_logp.double() - exact).abs().max()) <= float((want_logp.double() - exact).abs().max()) + 1e-6
        assert float((got_logp - want_logp).abs().max()) < 1e-4
        width = vocab // chunks  # the chunked noise is the one-pass noise, bit for bit, viewed in chunks
        assert torch.equal(counter_noise._uniform_in_chunks(seeds, torch.tensor(step), chunks, width),
                           counter_noise.uniform(seeds, torch.tensor(step), vocab).view(rows, chunks, width))


def test_an_engine_with_the_chunked_sampler_samples_as_the_default(smoke_study, snapshot_cache, outputs):
    """SAMPLER "chunked" in the engine: uncompiled and compiled by inductor, the default engine's float32 tokens."""
    workload = Workload(smoke_study)
    expected = outputs[("float32", "graphs")]
    for mode in ("off", "inductor"):
        torch._dynamo.reset()
        with synced_engine(smoke_study, snapshot_cache, outputs, step_compile=mode,
                           engine={"SAMPLER": "chunked"}) as backend:
            assert backend.environment()["sampler_reduction"] == "chunked"
            for cell in CELLS:
                assert_same_results(backend.generate(workload.requests(workload.cell(cell))).results,
                                    expected["runs"][cell])


def test_a_pipelined_readback_decodes_the_same_tokens_and_stops(smoke_study, snapshot_cache, outputs):
    """Issue 43 candidate (READBACK "pipelined": step t+1 enqueued before step t's tokens are read). The same
    steps in the same order, so the default engine's very results (float32, uncompiled), greedy and seeded;
    where every row stops early by EOS, the same tokens and stops, and one step run past the stop at most."""
    import dataclasses

    workload = Workload(smoke_study)
    expected = outputs[("float32", "graphs")]
    with synced_engine(smoke_study, snapshot_cache, outputs, engine={"READBACK": "pipelined"}) as backend:
        assert backend.environment()["readback"] == "pipelined"
        for cell in CELLS:
            requests = workload.requests(workload.cell(cell))
            assert_same_results(backend.generate(requests).results, expected["runs"][cell], tolerance=1e-12)
        requests = workload.requests(workload.cell("p16-r24-n2-stochastic"))
        default_run = expected["runs"]["p16-r24-n2-stochastic"]
        # each row's first token from the 4th on that it had not drawn before becomes its end of sequence
        fresh = [next(i for i in range(3, len(r.token_ids)) if r.token_ids[i] not in r.token_ids[:i])
                 for r in default_run]
        early = [dataclasses.replace(q, eos_token_ids=(r.token_ids[i],))
                 for q, r, i in zip(requests, default_run, fresh, strict=True)]
        piped = backend.generate(early)
    with synced_engine(smoke_study, snapshot_cache, outputs) as default:
        stepped = default.generate(early)
    assert [len(r.token_ids) for r in stepped.results] == [i + 1 for i in fresh]
    assert {r.stop_reason for r in stepped.results} == {"eos"} and stepped.decode_steps == max(fresh)
    assert_same_results(piped.results, stepped.results, tolerance=1e-12)
    assert piped.decode_steps == stepped.decode_steps + 1, "the step enqueued past the last stop, discarded"


def test_a_pipelined_readback_never_runs_past_its_step_limit(smoke_study, snapshot_cache, outputs):
    """The steps a batch may take are the cache columns it has: a tracker that never finishes gets exactly the
    limit, the cache's write column advanced by as many steps, and nothing past it."""
    workload = Workload(smoke_study)

    class NeverDone:
        done = False

        def __init__(self):
            self.added = 0

        def add(self, tokens, logprobs):
            self.added += 1

    with synced_engine(smoke_study, snapshot_cache, outputs, engine={"READBACK": "pipelined"}) as backend:
        backend.generate(workload.requests(workload.cell(CELLS[0])))  # builds the cell's bucket
        bucket = next(iter(backend.buckets.buckets.values()))
        bucket.start(torch.zeros(bucket.rows, dtype=torch.long), column=3, step=1)
        tracker = NeverDone()
        assert bucket.run_pipelined(tracker, 5) == 5 and tracker.added == 5
        assert int(bucket.write) == 3 + 5
        assert bucket.run_pipelined(NeverDone(), 0) == 0 and int(bucket.write) == 3 + 5


@pytest.mark.parametrize("attention", ["auto", "flex"])
def test_the_steps_edges_compiled_are_the_same_step(smoke_study, snapshot_cache, outputs, attention):
    """Issue 43 candidate (STEP_EDGES "compiled": the step's inputs, final norm and bookkeeping as three compiled
    pieces). Uncompiled it is the very same sequence of operations (identical results); compiled by inductor the
    same float32 math in another order, each piece compiled (with the SDPA bias, and with flex's boolean mask)."""
    from rollout_lib.backends import compact_qwen3

    results = _uncompiled_and_compiled(smoke_study, snapshot_cache, outputs,
                                       {"STEP_EDGES": "compiled", "ATTENTION_BACKEND": attention},
                                       (compact_qwen3._decode_inputs, compact_qwen3._rms, compact_qwen3._advance))
    for cell in CELLS:
        default = outputs[("float32", "graphs")]["runs"][cell]
        assert_same_results(results["off"][cell], default, tolerance=1e-12 if attention == "auto" else 1e-4)
        assert_same_results(results["inductor"][cell], default)
