"""O_EPILOGUE "triton" (`rollout_lib/backends/norm_epilogue.py`): the o GEMM's float32 output to the residual stream
and its norm in one kernel, as `_fused_linear`, `_after_attention` and `_rms` compute them. On a CUDA GPU it runs
there; on a CPU in Triton's interpreter where Triton is installed (the CPU CI has no Triton: skipped there, saying
so). The projection's sums are order-free on the exact values below (small integers times powers of two), so a
wrong part, rank column or row cannot hide: the residual stream bit for bit on a GPU; the interpreter truncates
float32 -> bf16 conversions (the GPU rounds to nearest even), so there a bf16 result is the reference's or its
neighbour toward zero. The norm's sum of squares is a float32 sum in another order: within a rounding."""

from __future__ import annotations

import pytest
import torch

from rollout_lib.backends.triton_ops import device_key
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


def _operands(rows, hidden, rank, generator):
    """`both` as the o GEMM with the shrink's rows returns it (base columns exact in bf16, then A's three parts),
    B, the residual stream and the norm's weight."""
    both = torch.cat([exact_values((rows, hidden), generator, 0.5), exact_values((rows, 3 * rank), generator, 0.25)],
                     dim=1)
    lora_b = exact_values((hidden, rank), generator, 0.125)
    h = exact_values((rows, hidden), generator, 1.0).to(torch.bfloat16)
    weight = (1 + exact_values((hidden,), generator, 0.0625)).to(torch.bfloat16)
    return both, lora_b, h, weight


def _reference(both, lora_b, h, weight, scaling, oracle_rounding):
    """The engine's own arithmetic: `_fused_linear`'s add and rounding, the residual, `_rms`."""
    from rollout_lib.backends.compact_qwen3 import _rms

    hidden, rank = lora_b.shape
    base = both[:, :hidden].to(torch.bfloat16)
    parts = both[:, hidden:].reshape(-1, 3, rank)
    xa = (parts[:, 0] + parts[:, 1]) + parts[:, 2]
    low = (xa[:, None, :] * lora_b).sum(-1)
    o = base + (low * scaling).to(torch.bfloat16) if oracle_rounding else (base.float() + low * scaling).to(
        torch.bfloat16)
    after = h + o
    return after, _rms(after, weight, EPS)


@pytest.mark.parametrize("oracle_rounding", [False, True])
@pytest.mark.parametrize(("rows", "hidden", "rank", "rank_major"), [
    (4, 1024, 16, True),   # Qwen3-0.6B's o projection at 4 rows, B stored as the engine stores it
    (16, 200, 8, False),   # a hidden size off a power of two, B row-major
    (37, 64, 4, False),    # a prefill's rows
])
def test_the_residual_stream_and_its_norm_are_the_engines(rows, hidden, rank, rank_major, oracle_rounding):
    from rollout_lib.backends import norm_epilogue

    generator = torch.Generator().manual_seed(rows + hidden)
    both, lora_b, h, weight = (t.to(DEVICE) for t in _operands(rows, hidden, rank, generator))
    if rank_major:
        lora_b = lora_b.t().contiguous().t()
    got = norm_epilogue.launch(both, lora_b, h, weight, 2.0, EPS, oracle_rounding)
    want_h, want_x = _reference(both, lora_b, h, weight, 2.0, oracle_rounding)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, hidden)
    if DEVICE == "cuda":
        assert torch.equal(got[0], want_h)
    else:
        assert truncated_or_equal(got[0].cpu(), want_h.cpu())
    # the norm: its float32 sum of squares in another order, then two bf16 roundings (the normalized value, the
    # weight's product): within two bf16 steps of the engine's, on a GPU most of it bit for bit
    step = 2 * torch.finfo(torch.bfloat16).eps
    x, want_x = got[1].float().cpu(), want_x.float().cpu()
    assert bool(((x - want_x).abs() <= step * want_x.abs() + 1e-30).all())
    if DEVICE == "cuda":
        assert float((x == want_x).float().mean()) > 0.9


@pytest.mark.parametrize("splits", [2, 8])
def test_split_k_partials_are_added_in_the_engines_order_before_anything_else(splits):
    """GEMM_SPLIT_K: the GEMM's partial sums [S, rows, H + 3 r] in, the kernel adds them as `_sum_in_order` does:
    the same bits as the kernel on their sum (on any values: the same float32 adds in the same order)."""
    from rollout_lib.backends import norm_epilogue
    from rollout_lib.backends.compact_qwen3 import _sum_in_order

    generator = torch.Generator().manual_seed(splits)
    both, lora_b, h, weight = _operands(4, 256, 8, generator)
    partials = torch.randn((splits, *both.shape), generator=generator) * both / splits
    partials, lora_b, h, weight = (t.to(DEVICE) for t in (partials, lora_b, h, weight))
    summed = _sum_in_order([partials[index] for index in range(splits)])
    got = norm_epilogue.launch(partials, lora_b, h, weight, 2.0, EPS)
    assert torch.equal(got, norm_epilogue.launch(summed, lora_b, h, weight, 2.0, EPS))
    after, x = norm_epilogue.residual_and_norm(partials, lora_b, h, weight, 2.0, EPS, split_partials=True)
    assert torch.equal(after, got[0]) and torch.equal(x, got[1])


def test_any_shape_goes_through_the_op():
    """[batch, length, H] in, two [batch, length, H] out, the op's values the kernel's."""
    from rollout_lib.backends import norm_epilogue

    generator = torch.Generator().manual_seed(7)
    both, lora_b, h, weight = (t.to(DEVICE) for t in _operands(16, 256, 8, generator))
    after, x = norm_epilogue.residual_and_norm(both.reshape(4, 4, -1), lora_b, h.reshape(4, 4, -1), weight, 2.0, EPS)
    assert after.shape == x.shape == (4, 4, 256) and after.dtype == x.dtype == torch.bfloat16
    direct = norm_epilogue.launch(both, lora_b, h, weight, 2.0, EPS)
    assert torch.equal(after.reshape(16, 256), direct[0]) and torch.equal(x.reshape(16, 256), direct[1])


@pytest.mark.parametrize("oracle_rounding", [False, True])
@pytest.mark.parametrize(("rows", "hidden", "rank", "slice_features", "splits"), [
    (4, 1024, 16, 128, 1),   # Qwen3-0.6B's o projection at 4 rows: 8 slices a row
    (16, 200, 8, 64, 1),     # 4 slices, the last one 8 features wide (a slice count off a power of two)
    (3, 256, 8, 32, 4),      # split-K partials, 8 slices
])
def test_the_slices_kernel_gives_the_one_program_kernels_residual_and_its_norm(rows, hidden, rank, slice_features,
                                                                                splits, oracle_rounding):
    """NORM_EPILOGUE_ROW "slices": h' value for value the one-program kernel's (the same operations per feature),
    the norm within a rounding of it (its sum of squares in another order: slices, then their sums), and every
    counter zero again after the launch (a graph replays it)."""
    from rollout_lib.backends import norm_epilogue

    generator = torch.Generator().manual_seed(rows * hidden + splits)
    both, lora_b, h, weight = _operands(rows, hidden, rank, generator)
    if splits > 1:
        both = torch.randn((splits, *both.shape), generator=generator) * both / splits
    both, lora_b, h, weight = (t.to(DEVICE) for t in (both, lora_b.t().contiguous().t(), h, weight))
    norm_epilogue.prepare(both.device)
    got = norm_epilogue.launch(both, lora_b, h, weight, 2.0, EPS, oracle_rounding, slices=True,
                               slice_features=slice_features)
    one = norm_epilogue.launch(both, lora_b, h, weight, 2.0, EPS, oracle_rounding)
    assert got.shape == one.shape and got.dtype == one.dtype
    assert torch.equal(got[0], one[0])
    step = 2 * torch.finfo(torch.bfloat16).eps
    x, want = got[1].float().cpu(), one[1].float().cpu()
    assert bool(((x - want).abs() <= step * want.abs() + 1e-30).all())
    assert float((x == want).float().mean()) > 0.9
    assert not norm_epilogue._LOCKS[device_key(both.device)].any()
    # again, through the op, on the same counters
    after, normed = norm_epilogue.residual_and_norm(both, lora_b, h, weight, 2.0, EPS, oracle_rounding,
                                                    split_partials=splits > 1, slices=True)
    assert torch.equal(after, one[0])
    assert bool(((normed.float().cpu() - want).abs() <= step * want.abs() + 1e-30).all())


def test_the_slices_kernel_refuses_to_run_before_its_counters_exist_and_leaves_a_prefill_to_the_one_program_one():
    from rollout_lib.backends import norm_epilogue

    generator = torch.Generator().manual_seed(5)
    both, lora_b, h, weight = (t.to(DEVICE) for t in _operands(4, 64, 4, generator))
    key = device_key(both.device)
    saved = norm_epilogue._LOCKS.pop(key, None)
    try:
        with pytest.raises(RuntimeError, match=r"^NORM_EPILOGUE_ROW slices: norm_epilogue.prepare\(.*\) was not "
                                               r"called before use$"):
            norm_epilogue.launch(both, lora_b, h, weight, 2.0, EPS, slices=True)
    finally:
        if saved is not None:
            norm_epilogue._LOCKS[key] = saved
    norm_epilogue.prepare(both.device)
    rows = norm_epilogue.SLICE_MAX_ROWS + 1  # more rows than counters: the one-program kernel, the same bits
    both, lora_b, h, weight = (t.to(DEVICE) for t in _operands(rows, 64, 4, generator))
    assert torch.equal(norm_epilogue.launch(both, lora_b, h, weight, 2.0, EPS, slices=True),
                       norm_epilogue.launch(both, lora_b, h, weight, 2.0, EPS))


def test_operands_that_are_not_one_projection_with_its_shrink_are_refused_by_name():
    from rollout_lib.backends import norm_epilogue

    both = torch.zeros(4, 96 + 3 * 8, device=DEVICE)
    h = torch.zeros(4, 96, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"^O_EPILOGUE triton: the GEMM output \(4, 120\), B \(96, 4\), the "
                                         r"residual \(4, 96\) and the norm's weight \(96,\) are not one projection "
                                         r"of 96 features"):
        norm_epilogue.launch(both, torch.zeros(96, 4, device=DEVICE), h, torch.ones(96, dtype=torch.bfloat16,
                                                                                     device=DEVICE), 1.0, EPS)


@pytest.mark.parametrize(("epilogues", "per_layer"), [({"O_EPILOGUE": "triton"}, 1),
                                                     ({"DOWN_EPILOGUE": "triton"}, 1),
                                                     ({"O_EPILOGUE": "triton", "DOWN_EPILOGUE": "triton"}, 2),
                                                     # the GEMMs' split-K partials added by the kernel
                                                     ({"O_EPILOGUE": "triton", "DOWN_EPILOGUE": "triton",
                                                       "GEMM_SPLIT_K": "4"}, 2),
                                                     # each row over slices, its last program writing the norm
                                                     ({"O_EPILOGUE": "triton", "DOWN_EPILOGUE": "triton",
                                                       "NORM_EPILOGUE_ROW": "slices"}, 2)])
def test_a_bf16_engine_with_the_epilogue_serves_the_policy_and_its_tokens(smoke_study, snapshot_cache, epilogues,
                                                                          per_layer):
    """The kernel inside the engine's compiled pieces (an opaque op after the o GEMM, and after the down GEMM with
    the next layer's input norm, which the next piece takes), with the shrink in the base GEMM: the synced policy's
    identity is the default engine's; every layer's o projection, every down projection but the last layer's (the
    final norm is the step's), went through it (on a CPU: the op's calls; on a GPU: its kernel's launches, which CUDA
    graphs replay without calling the op); and the bf16 tokens and log-probabilities are those of the same engine
    with inductor's expand, residual and norm: the same float32 products summed in another order, whose bf16
    roundings part now and then and carry through the layers: log-probabilities within 0.05 and tokens apart only
    after that."""
    from rollout_lib.study.workload import Workload

    split = {"GEMM_SPLIT_K": epilogues["GEMM_SPLIT_K"]} if "GEMM_SPLIT_K" in epilogues else {}
    policy, runs = run_engines(smoke_study, snapshot_cache, ({"LORA_SHRINK": "in_base_gemm", **split}, {
        "LORA_SHRINK": "in_base_gemm", **epilogues}), "rollout::residual_norm_epilogue",
        "residual_norm_slices_kernel" if epilogues.get("NORM_EPILOGUE_ROW") == "slices"
        else "residual_norm_epilogue_kernel")
    (default_identity, default, none), (identity, got, used) = runs
    layers = Workload(smoke_study).arch.num_hidden_layers
    assert identity == default_identity == policy.identity
    assert none == [] and len(used) >= per_layer * layers - ("DOWN_EPILOGUE" in epilogues)
    # the interpreter truncates each bf16 rounding toward zero (a GPU rounds to nearest): two epilogues a layer
    # shrink the residual stream by a bias the GPU does not have (the interpreter's log-probabilities 0.045-0.055
    # apart with both, within 0.05 with one)
    assert_parts_only_after_close_logprobs(default, got, 0.05 if DEVICE == "cuda" else 0.1)


def test_the_engine_stores_b_rank_major_for_each_projection_an_epilogue_kernel_reads(smoke_study, snapshot_cache):
    """Lease 34 (H100): with B row-major the kernels' loads of one rank term were a B row apart across a warp's
    features, and the o/down kernel took 10.5 us a call (inductor's two kernels it replaces: ~4 us). The engine
    stores B rank-major (B[:, k] contiguous) for the projections whose epilogue is on, and row-major for the rest
    (inductor's expand reductions read a row's terms together)."""
    from rollout_lib.backends import create_backend

    backend = create_backend("hf_cached", smoke_study, device=DEVICE, compute_dtype="bfloat16", decode="graphs",
                             cache_dir=snapshot_cache, engine={"LORA_SHRINK": "in_base_gemm", "O_EPILOGUE": "triton",
                                                              "QKV_EPILOGUE": "triton"})
    backend.cold_start()
    try:
        for layer in backend.engine.layers:
            for projection, rank_major in (("qkv", True), ("o", True), ("gate_up", False), ("down", False)):
                lora_b = layer.proj[projection].lora_b
                assert (lora_b.stride(0) == 1) is rank_major, (projection, lora_b.stride())
                assert (lora_b.stride(1) == 1) is not rank_major, (projection, lora_b.stride())
    finally:
        backend.teardown()
