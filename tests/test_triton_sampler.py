"""SAMPLER "triton" (`rollout_lib/backends/triton_sampler.py`): the decode step's sampler as one kernel. On a CUDA GPU
it runs there; on a CPU in Triton's interpreter where Triton is installed (the CPU CI has no Triton: skipped there,
saying so). Against `counter_noise.sample`, the sampler it stands in for: the same tokens (random logits put no two
race values within a float32 rounding), log-probabilities within a float32 rounding, the noise's bits (flat logits:
the race is the noise alone), the first maximum on ties, every row counter zero again after a launch."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_lib.backends import counter_noise
from rollout_lib.backends.triton_ops import device_key
from tests.triton_here import (  # noqa: F401 (an autouse fixture)
    DEVICE,
    MARKS,
    assert_parts_only_after_close_logprobs,
    interpreter_on_a_cpu,
    run_engines,
)

pytestmark = MARKS


def _inputs(rows: int, vocab: int, seed: int):
    """Logits of a model's spread (a few nats), seeds above 2**32 too (the hash keeps their low 32 bits), the step
    as the decode bucket holds it (a 0-d int64 tensor), temperatures 0.7-2 on the stochastic rows, greedy rows at
    1.0 (the sampler's contract)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    seeds = torch.randint(0, 2 ** 40, (rows,), generator=generator)
    greedy = torch.arange(rows) % 3 == 0
    inv_temperature = torch.where(greedy, 1.0, 1 / (0.7 + 1.3 * torch.rand(rows, generator=generator)))
    step = torch.tensor(int(torch.randint(0, 1000, (), generator=generator)))
    return tuple(t.to(DEVICE) for t in (logits, seeds, step, inv_temperature, greedy))


def _counters_zero() -> bool:
    from rollout_lib.backends import triton_sampler

    return not bool(triton_sampler._LOCKS[device_key(DEVICE)].any())


@pytest.mark.parametrize(("rows", "vocab"), [
    (4, 151_936),  # Qwen3's vocabulary at 4 rows: 75 chunks, the last 384 entries wide
    (16, 4_099),   # 16 rows, a prime vocabulary (3 chunks, the last 3 entries wide)
    (3, 37),       # one chunk, mostly masked
])
def test_tokens_and_log_probabilities_are_those_of_the_counter_noise_sampler(rows, vocab):
    from rollout_lib.backends import triton_sampler

    logits, seeds, step, inv_temperature, greedy = _inputs(rows, vocab, rows * vocab)
    triton_sampler.prepare(logits.device)
    tokens, logp = triton_sampler.launch(logits, seeds, step, inv_temperature, greedy)
    want_tokens, want_logp = counter_noise.sample(logits, seeds, step, inv_temperature, greedy)
    assert tokens.dtype == torch.int64 and logp.dtype == torch.float32 and tokens.shape == logp.shape == (rows,)
    assert tokens.tolist() == want_tokens.tolist()
    # log p = (z - top) - log(sum exp(z - top)), the sum in another order: within a float32 rounding of |log p|
    # and of the log-sum-exp (up to ~12 nats here)
    assert float((logp - want_logp).abs().max()) < 5e-5
    assert _counters_zero()


@pytest.mark.parametrize("step", [0, 1, 2 ** 32 + 5])
def test_on_flat_logits_the_token_is_the_noise_s_largest_uniform(step):
    """With every logit equal the race is the noise alone: each stochastic row's token is the argmax of
    `counter_noise.uniform(seed, step, ·)`, so a wrong bit of the hash (seed, step or index) moves it. The step as
    an int (`sample` makes it a tensor), above 2**32 too (its low 32 bits)."""
    from rollout_lib.backends import triton_sampler

    rows, vocab = 6, 151_936
    seeds = torch.tensor([0, 1, 2 ** 32 - 1, 2 ** 32, 123_456_789_012, 7], device=DEVICE)
    logits = torch.zeros(rows, vocab, device=DEVICE)
    triton_sampler.prepare(logits.device)
    tokens, logp = triton_sampler.sample(logits, seeds, step, torch.ones(rows, device=DEVICE),
                                         torch.zeros(rows, dtype=torch.bool, device=DEVICE))
    assert tokens.tolist() == counter_noise.uniform(seeds, step, vocab).argmax(dim=-1).tolist()
    assert torch.allclose(logp, torch.full((rows,), -math.log(vocab), device=DEVICE), atol=1e-5)  # on the device
    assert _counters_zero()


def test_a_greedy_row_takes_the_first_maximum_across_and_within_chunks():
    from rollout_lib.backends import triton_sampler

    logits = torch.zeros(2, 5_000)
    logits[0, [4_500, 100, 2_100]] = 7.0  # three chunks hold the maximum: the first chunk's
    logits[1, [1_500, 1_200]] = 7.0  # one chunk, twice: its first
    logits = logits.to(DEVICE)
    triton_sampler.prepare(logits.device)
    tokens, _ = triton_sampler.launch(logits, torch.tensor([3, 4], device=DEVICE), torch.tensor(9, device=DEVICE),
                                      torch.ones(2, device=DEVICE), torch.ones(2, dtype=torch.bool, device=DEVICE))
    assert tokens.tolist() == [100, 1_200]


def test_minus_infinity_logits_are_never_drawn_and_a_chunk_of_them_adds_nothing():
    """A vocabulary padded past the tokenizer (logits of -inf) and a whole chunk of them: never drawn, and the
    log-probabilities are those of the finite entries (no NaN from a chunk whose maximum is -inf)."""
    from rollout_lib.backends import triton_sampler

    logits, seeds, step, inv_temperature, greedy = _inputs(4, 7_000, 11)
    logits[:, 2_048:4_096] = float("-inf")  # the second chunk whole
    logits[:, 6_000:] = float("-inf")
    triton_sampler.prepare(logits.device)
    tokens, logp = triton_sampler.launch(logits, seeds, step, inv_temperature, greedy)
    want_tokens, want_logp = counter_noise.sample(logits, seeds, step, inv_temperature, greedy)
    assert tokens.tolist() == want_tokens.tolist()
    assert all(t < 2_048 or 4_096 <= t < 6_000 for t in tokens.tolist())
    assert bool(torch.isfinite(logp).all()) and float((logp - want_logp).abs().max()) < 5e-5


def test_nan_logits_still_give_a_token_inside_the_vocabulary():
    """A broken model's NaN logits match no maximum; the token read back (and its logit, read by the last program)
    stays inside the row."""
    from rollout_lib.backends import triton_sampler

    logits, seeds, step, inv_temperature, greedy = _inputs(3, 5_000, 3)
    logits[:, 4_999] = float("nan")
    logits[1] = float("nan")
    triton_sampler.prepare(logits.device)
    tokens, _ = triton_sampler.launch(logits, seeds, step, inv_temperature, greedy)
    assert all(0 <= t < 5_000 for t in tokens.tolist())
    assert _counters_zero()


def test_the_op_is_the_kernel_and_a_second_launch_on_the_same_counters_gives_the_same():
    from rollout_lib.backends import triton_sampler

    logits, seeds, step, inv_temperature, greedy = _inputs(5, 3_000, 5)
    triton_sampler.prepare(logits.device)
    direct = triton_sampler.launch(logits, seeds, step, inv_temperature, greedy)
    through_op = triton_sampler.sample(logits, seeds, step, inv_temperature, greedy)
    again = triton_sampler.sample(logits, seeds, step, inv_temperature, greedy)
    for got in (through_op, again):
        assert torch.equal(got[0], direct[0]) and torch.equal(got[1], direct[1])
    assert _counters_zero()


def test_inputs_it_cannot_take_are_refused_by_name_before_any_launch():
    from rollout_lib.backends import triton_sampler

    key = device_key(DEVICE)
    saved = triton_sampler._LOCKS.pop(key, None)
    args = (torch.tensor([1], device=DEVICE), torch.tensor(0, device=DEVICE), torch.ones(1, device=DEVICE),
            torch.zeros(1, dtype=torch.bool, device=DEVICE))
    try:
        with pytest.raises(RuntimeError, match=r"^SAMPLER triton: triton_sampler.prepare\(.*\) was not called "
                                               r"before use$"):
            triton_sampler.launch(torch.zeros(1, 10, device=DEVICE), *args)
    finally:
        if saved is not None:
            triton_sampler._LOCKS[key] = saved
    triton_sampler.prepare(DEVICE)
    with pytest.raises(ValueError, match=r"^SAMPLER triton: logits torch.bfloat16 with strides \(10, 1\); allowed: "
                                         r"float32 with the vocabulary contiguous$"):
        triton_sampler.launch(torch.zeros(1, 10, dtype=torch.bfloat16, device=DEVICE), *args)
    rows = triton_sampler.MAX_ROWS + 1
    with pytest.raises(ValueError, match=rf"^SAMPLER triton: logits of {rows} rows x 2 entries; allowed: up to "
                                         rf"{triton_sampler.MAX_ROWS} rows"):
        triton_sampler.launch(torch.zeros(rows, 2, device=DEVICE), torch.zeros(rows, dtype=torch.int64,
                                                                                   device=DEVICE),
                              torch.tensor(0, device=DEVICE), torch.ones(rows, device=DEVICE),
                              torch.zeros(rows, dtype=torch.bool, device=DEVICE))


def test_a_bf16_engine_with_the_kernel_samples_the_tokens_of_the_chunked_sampler(smoke_study, snapshot_cache):
    """The kernel as the compiled decode step's sampler (an opaque op after the LM head): the synced policy's
    identity is the chunked sampler's engine's; every decode step went through it (on a CPU: the op's calls; on a
    GPU: its kernel's launches, which CUDA graphs replay without calling the op); and the greedy and stochastic
    cells' tokens are the chunked sampler's, their log-probabilities within a float32 rounding (on a CPU the same
    logits: nothing before the sampler changed)."""
    policy, runs = run_engines(smoke_study, snapshot_cache, ({"SAMPLER": "chunked"}, {"SAMPLER": "triton"}),
                               "rollout::counter_sample", "counter_sample_kernel")
    (default_identity, default, none), (identity, got, used) = runs
    assert identity == default_identity == policy.identity
    assert none == [] and len(used) >= 2  # at least a step in each cell
    if DEVICE == "cuda":
        # each engine's inductor pieces choose their reductions' launches at first run (the default REDUCTION_LAUNCH),
        # so the two engines' bf16 logits may part by a rounding: tokens apart only after close log-probabilities
        assert_parts_only_after_close_logprobs(default, got, 0.05)
        return
    for cell, results in default.items():
        for a, b in zip(results, got[cell], strict=True):
            assert a.token_ids == b.token_ids, (cell, a.request_id)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_a_float32_engine_with_the_kernel_keeps_the_default_engines_tokens(smoke_study, snapshot_cache):
    """Item 3's float32 check as conformance runs the candidate (SAMPLER triton is kept in float32): a float32
    engine with the kernel, uncompiled, generates the default engine's tokens (its row sampler) in a greedy and a
    stochastic cell, log-probabilities within a float32 rounding."""
    from rollout_lib.backends import create_backend
    from rollout_lib.models.policy import policy_versions
    from rollout_lib.study.workload import Workload

    workload = Workload(smoke_study)
    policy = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 1)[-1]
    results = []
    for engine in ({}, {"SAMPLER": "triton"}):
        backend = create_backend("hf_cached", smoke_study, device=DEVICE, compute_dtype="float32", decode="graphs",
                                 step_compile="off", cache_dir=snapshot_cache, engine=engine)
        backend.cold_start()
        try:
            backend.sync_policy(policy)
            results.append({c: backend.generate(workload.requests(workload.cell(c))).results
                            for c in ("p16-r8-n1-greedy", "p16-r24-n2-stochastic")})
        finally:
            backend.teardown()
    default, got = results
    for cell, rows in default.items():
        for a, b in zip(rows, got[cell], strict=True):
            assert a.token_ids == b.token_ids, (cell, a.request_id)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
