"""LORA_EXPAND "triton" (`compact_qwen3.lora_expand_add`): the hand-written kernel adds and rounds the low-rank term
as `_fused_linear`'s other expands do. On a CUDA GPU it runs there; on a CPU it runs in Triton's interpreter
where Triton is installed (the CPU CI has no Triton: skipped there, saying so); the engine's refusal off CUDA is
tested in test_fast_path.py. Sums are order-free on the exact values below (small integers times eighths), so the
kernel's fixed summation order cannot hide a wrong rounding: bit for bit there, within one rounding elsewhere.
Triton's CPU interpreter truncates float32 -> bf16 conversions (the GPU rounds to nearest even, as torch), so
there a bf16 result is the reference's or its neighbour toward zero, and bit for bit only in float32."""

from __future__ import annotations

import pytest
import torch

from tests.triton_here import (  # noqa: F401 (an autouse fixture)
    DEVICE,
    MARKS,
    exact_values,
    interpreter_on_a_cpu,
    truncated_or_equal,
)

pytestmark = MARKS


def _reference(base, xa, lora_b, scaling, oracle_rounding):
    low = (xa[..., None, :] * lora_b).sum(-1)
    if oracle_rounding:
        return base + (low * scaling).to(base.dtype)
    return (base.float() + low * scaling).to(base.dtype)


@pytest.mark.parametrize("oracle_rounding", [False, True])
@pytest.mark.parametrize(("dtype", "rows", "features", "rank"), [
    (torch.bfloat16, 4, 1040, 16),   # o_proj's shape at 4 rows
    (torch.bfloat16, 16, 4096, 48),  # the fused qkv at 16 rows (its B block-diagonal in the engine: zeros here too)
    (torch.float32, 3, 130, 32),     # a float32 engine, features not a multiple of the block
])
def test_the_kernel_adds_and_rounds_as_the_other_expands_do(dtype, rows, features, rank, oracle_rounding):
    from rollout_lib.backends.compact_qwen3 import lora_expand_add

    generator = torch.Generator().manual_seed(rows + features)
    wide = (torch.randn(rows, features + 3 * rank, generator=generator) * 4).to(dtype).to(DEVICE)
    base = wide[:, :features]  # a strided view, as the shrink in the base GEMM returns it
    xa = exact_values((rows, rank), generator, 1.0).to(DEVICE)
    lora_b = exact_values((features, rank), generator, 0.125)
    lora_b[: features // 2, rank // 2:] = 0.0  # a block of exact zeros, as a fused projection's B has
    lora_b = lora_b.to(DEVICE)
    got = lora_expand_add(base, xa, lora_b, 2.0, oracle_rounding)
    assert got.dtype == dtype and got.shape == (rows, features) and got.is_contiguous()
    want = _reference(base, xa, lora_b, 2.0, oracle_rounding)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # the interpreter's truncating conversion: the reference, or one bf16 step toward zero from the sum
        assert truncated_or_equal(got, want)
    # any shape [..., features], as the engine's [batch, length, features]
    got3 = lora_expand_add(base.reshape(rows, 1, features), xa.reshape(rows, 1, rank), lora_b, 2.0, oracle_rounding)
    assert got3.shape == (rows, 1, features) and torch.equal(got3.reshape(rows, features), got)


def test_on_any_values_the_kernel_is_within_one_rounding_of_the_reference():
    """Random float32 terms: the kernel's summation order is its own, so a bf16 result may differ from the
    reference's by one unit in the last place where the float32 sums round apart, never more."""
    from rollout_lib.backends.compact_qwen3 import lora_expand_add

    generator = torch.Generator().manual_seed(7)
    base = torch.randn(16, 4096, generator=generator).bfloat16().to(DEVICE)
    xa = torch.randn(16, 48, generator=generator).to(DEVICE)
    lora_b = (torch.randn(4096, 48, generator=generator) * 0.05).to(DEVICE)
    got, want = lora_expand_add(base, xa, lora_b, 2.0).float(), _reference(base, xa, lora_b, 2.0, False).float()
    ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(got.abs(), want.abs())
    assert ((got - want).abs() <= ulp).all()
    if DEVICE == "cuda":  # rounded to nearest: apart only where the float32 sums round apart
        assert (got != want).float().mean() < 0.05


def test_a_float32_engine_with_the_triton_expand_keeps_the_default_engines_tokens(smoke_study, snapshot_cache):
    """The kernel inside the engine's compiled pieces (an opaque op: inductor calls it as it calls a GEMM): the
    synced policy's identity is the default engine's, and so are its greedy and sampled tokens in float32."""
    from rollout_lib.backends import create_backend
    from rollout_lib.models.policy import policy_versions
    from rollout_lib.study.workload import Workload

    workload = Workload(smoke_study)
    policy = policy_versions(workload.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)[-1]
    cells = ("p48-r24-n2-greedy", "p16-r24-n2-stochastic")
    runs = {}
    for engine in ({}, {"LORA_EXPAND": "triton"}):
        torch._dynamo.reset()
        backend = create_backend("hf_cached", smoke_study, device=DEVICE, compute_dtype="float32", decode="graphs",
                                 step_compile="inductor", cache_dir=snapshot_cache,
                                 **({"engine": engine} if engine else {}))
        backend.cold_start()
        try:
            identity = backend.sync_policy(policy)
            results = {c: backend.generate(workload.requests(workload.cell(c))).results for c in cells}
            runs[backend.environment().get("lora_expand", "reductions")] = identity, results
        finally:
            backend.teardown()
    (default_identity, default), (identity, got) = runs["reductions"], runs["triton"]
    assert identity == default_identity == policy.identity
    for cell in cells:
        for a, b in zip(default[cell], got[cell], strict=True):
            assert a.token_ids == b.token_ids and a.stop_reason == b.stop_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
