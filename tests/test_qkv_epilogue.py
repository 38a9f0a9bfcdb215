"""QKV_EPILOGUE "triton" (`rollout_lib/backends/qkv_epilogue.py`): the qkv GEMM's float32 output to the queries and
the k/v cache writes in one kernel, as `_fused_linear` and `_before_attention` compute them under inductor. On a
CUDA GPU it runs there; on a CPU in Triton's interpreter where Triton is installed (the CPU CI has no Triton:
skipped there, saying so). The projection's sums are order-free on the exact values below, so v (written as the
projection gives it) is bit for bit on a GPU, and a wrong part, rank column, head or cache column cannot hide; the
interpreter truncates float32 -> bf16 conversions (the GPU rounds to nearest even), so there a bf16 result is the
reference's or its neighbour toward zero. q and k pass through a norm (rsqrt by another formula) and the rotary
embedding: within two bf16 steps."""

from __future__ import annotations

import pytest
import torch

from tests.triton_here import (  # noqa: F401 (an autouse fixture)
    DEVICE,
    MARKS,
    assert_parts_only_after_close_logprobs,
    exact_values,
    interpreter_on_a_cpu,
    run_engines,
    truncated_or_equal,
)

pytestmark = MARKS
EPS = 1e-6


def _operands(batch, length, heads, kv_heads, head_dim, rank, generator):
    features = (heads + 2 * kv_heads) * head_dim
    rows = batch * length
    both = torch.cat([exact_values((rows, features), generator, 0.5), exact_values((rows, 9 * rank), generator, 0.25)],
                     dim=1)
    lora_b = torch.zeros(features, 3 * rank)
    bounds = (0, heads * head_dim, (heads + kv_heads) * head_dim, features)
    for part in range(3):  # block-diagonal: each projection's features read its own rank columns
        lora_b[bounds[part]:bounds[part + 1], part * rank:(part + 1) * rank] = exact_values(
            (bounds[part + 1] - bounds[part], rank), generator, 0.125)
    norms = [(1 + exact_values((head_dim,), generator, 0.0625)).to(torch.bfloat16) for _ in range(2)]
    angle = torch.rand(rows, head_dim // 2, generator=generator) * 6.0
    cos = torch.cat([angle.cos()] * 2, dim=-1).to(torch.bfloat16)
    sin = torch.cat([angle.sin()] * 2, dim=-1).to(torch.bfloat16)
    return both, lora_b, norms, cos, sin


def _reference(both, lora_b, q_norm, k_norm, cos, sin, batch, length, heads, kv_heads, head_dim, scaling,
               oracle_rounding):
    """The engine's arithmetic with inductor's roundings: the projection and the normalized value rounded to bf16,
    the weight's product and the rotary in float32, rounded once. (q [B, H, T, D], k, v [B, KV, T, D])."""
    features, low = lora_b.shape
    rank = low // 3
    base = both[:, :features].to(torch.bfloat16)
    parts = both[:, features:].reshape(-1, 3, low)
    xa = (parts[:, 0] + parts[:, 1]) + parts[:, 2]
    term = (xa[:, None, :] * lora_b).sum(-1) * scaling
    x = base + term.to(torch.bfloat16) if oracle_rounding else (base.float() + term).to(torch.bfloat16)
    q, k, v = x.float().split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    del rank

    def norm_rotary(t, weight, count):
        t = t.reshape(batch * length, count, head_dim)
        normed = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16).float()
        y = weight.float() * normed
        rotated = torch.cat([-y[..., head_dim // 2:], y[..., :head_dim // 2]], dim=-1)
        out = (y * cos.float()[:, None] + rotated * sin.float()[:, None]).to(torch.bfloat16)
        return out.reshape(batch, length, count, head_dim).transpose(1, 2)

    v = v.to(torch.bfloat16).reshape(batch, length, kv_heads, head_dim).transpose(1, 2)
    return norm_rotary(q, q_norm, heads), norm_rotary(k, k_norm, kv_heads), v


def _close(got, want, steps: int) -> bool:
    """Within `steps` bf16 steps of the reference, and of the rotary's terms where they cancel: a normalized head
    has RMS 1 (times weights within 1 +- 0.19), so its terms are O(1) and an error of a step in one shows in a
    result near 0 as an absolute ~eps."""
    step = torch.finfo(torch.bfloat16).eps
    return bool(((got.float() - want.float()).abs() <= steps * step * (want.float().abs() + 1.0)).all())


@pytest.mark.parametrize("oracle_rounding", [False, True])
@pytest.mark.parametrize(("batch", "length", "heads", "kv_heads", "head_dim", "rank", "rank_major"), [
    (4, 1, 16, 8, 128, 16, True),   # Qwen3-0.6B's decode step at 4 rows, B stored as the engine stores it
    (2, 5, 4, 2, 16, 4, False),     # a prefill: several positions per row, two query heads per kv head
])
def test_queries_and_the_cache_writes_are_the_engines(batch, length, heads, kv_heads, head_dim, rank, rank_major,
                                                      oracle_rounding):
    from rollout_lib.backends import qkv_epilogue

    generator = torch.Generator().manual_seed(batch * length + heads)
    both, lora_b, (q_norm, k_norm), cos, sin = _operands(batch, length, heads, kv_heads, head_dim, rank, generator)
    if rank_major:
        lora_b = lora_b.t().contiguous().t()
    columns = 12
    sentinel = torch.full((batch, kv_heads, columns, head_dim), 7.0, dtype=torch.bfloat16)
    cache_k, cache_v = sentinel.clone().to(DEVICE), sentinel.clone().to(DEVICE)
    write = torch.arange(3, 3 + length)
    q = qkv_epilogue.launch(*(t.to(DEVICE) for t in (both, lora_b, q_norm, k_norm, cos, sin)), cache_k, cache_v,
                            write.to(DEVICE), heads, length, 2.0, EPS, oracle_rounding)
    want_q, want_k, want_v = _reference(both, lora_b, q_norm, k_norm, cos, sin, batch, length, heads, kv_heads,
                                        head_dim, 2.0, oracle_rounding)
    groups = heads // kv_heads
    assert q.shape == (batch, kv_heads, groups * length, head_dim) and q.dtype == torch.bfloat16
    cache_k, cache_v = cache_k.cpu(), cache_v.cpu()
    untouched = torch.ones(columns, dtype=torch.bool)
    untouched[write] = False
    assert torch.equal(cache_k[:, :, untouched], sentinel[:, :, untouched])
    assert torch.equal(cache_v[:, :, untouched], sentinel[:, :, untouched])
    got_v = cache_v[:, :, write]
    assert torch.equal(got_v, want_v) if DEVICE == "cuda" else truncated_or_equal(got_v, want_v)
    steps = 2 if DEVICE == "cuda" else 4  # the interpreter truncates twice on the way (the projection, the norm)
    assert _close(q.cpu().reshape(batch, heads, length, head_dim), want_q, steps)
    assert _close(cache_k[:, :, write], want_k, steps)


def test_operands_that_are_not_one_qkv_projection_are_refused_by_name():
    from rollout_lib.backends import qkv_epilogue

    generator = torch.Generator().manual_seed(1)
    both, lora_b, (q_norm, k_norm), cos, sin = _operands(2, 1, 4, 2, 16, 4, generator)
    cache = torch.zeros(2, 2, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"^QKV_EPILOGUE triton: the GEMM output \(2, 164\), B \(128, 12\), the "
                                         r"caches \(2, 2, 8, 16\), cos \(2, 16\) and the columns \(1,\) are not one "
                                         r"qkv projection of 2 query heads over 1 positions"):
        qkv_epilogue.launch(*(t.to(DEVICE) for t in (both, lora_b, q_norm, k_norm, cos, sin)), cache, cache.clone(),
                            torch.zeros(1, dtype=torch.long, device=DEVICE), 2, 1, 1.0, EPS)


@pytest.mark.parametrize("epilogues", [{"QKV_EPILOGUE": "triton"},
                                       {"QKV_EPILOGUE": "triton", "O_EPILOGUE": "triton", "DOWN_EPILOGUE": "triton",
                                        "GATE_UP_EPILOGUE": "triton"}])
def test_a_bf16_engine_with_the_epilogue_serves_the_policy_and_its_tokens(smoke_study, snapshot_cache, epilogues):
    """The kernel inside the engine's compiled pieces (an opaque op between the qkv GEMM and attention, writing the
    caches in place), with the shrink in the base GEMM, alone and with the other three epilogues: the synced
    policy's identity is the default engine's; every layer's qkv projection of the compiled decode steps went
    through it (on a CPU: the op's calls; on a GPU: its kernel's launches); and the bf16 tokens and
    log-probabilities are those of the same engine with inductor's kernels but for the bf16 roundings of float32
    sums in another order: log-probabilities close and tokens apart only after that."""
    from rollout_lib.study.workload import Workload

    policy, runs = run_engines(smoke_study, snapshot_cache, ({"LORA_SHRINK": "in_base_gemm"}, {
        "LORA_SHRINK": "in_base_gemm", **epilogues}), "rollout::qkv_epilogue", "qkv_epilogue_kernel")
    (default_identity, default, none), (identity, got, used) = runs
    assert identity == default_identity == policy.identity
    assert none == [] and len(used) >= Workload(smoke_study).arch.num_hidden_layers
    # the interpreter truncates each bf16 rounding toward zero (a GPU rounds to nearest), a bias the GPU does not
    # have: the interpreter's log-probabilities up to 0.052 apart with this kernel alone, tokens all alike
    assert_parts_only_after_close_logprobs(default, got, 0.05 if DEVICE == "cuda" else 0.1)
