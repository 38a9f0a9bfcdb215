"""GATE_UP_EPILOGUE "triton" (`rollout_lib/backends/mlp_epilogue.py`): the gate_up GEMM's float32 output to the
SiLU product in one kernel, as `_fused_linear` and `_after_attention` compute it. On a CUDA GPU it runs there; on a
CPU in Triton's interpreter where Triton is installed (the CPU CI has no Triton: skipped there, saying so). Sums
are order-free on the exact values below (small integers times powers of two), so a wrong part, rank column or
block cannot hide: bit for bit on a GPU before SiLU; the interpreter truncates float32 -> bf16 conversions (the GPU
rounds to nearest even), so there a bf16 result is the reference's or its neighbour toward zero."""

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


def _gemm_output(rows, inter, rank, generator):
    """`both` as the gate_up GEMM with the shrink's rows returns it: base columns exact in bf16, then A's three
    parts for gate's and up's ranks; and its block-diagonal B."""
    base = exact_values((rows, 2 * inter), generator, 0.5)
    parts = exact_values((rows, 3 * 2 * rank), generator, 0.25)
    lora_b = exact_values((2 * inter, 2 * rank), generator, 0.125)
    lora_b[:inter, rank:] = 0.0
    lora_b[inter:, :rank] = 0.0
    return torch.cat([base, parts], dim=1), lora_b


def _reference(both, lora_b, scaling, inter, oracle_rounding, activation):
    low_rows = lora_b.shape[1]
    base = both[:, :2 * inter].to(torch.bfloat16)
    parts = both[:, 2 * inter:].reshape(-1, 3, low_rows)
    xa = (parts[:, 0] + parts[:, 1]) + parts[:, 2]
    low = (xa[:, None, :] * lora_b).sum(-1)
    if oracle_rounding:
        out = base + (low * scaling).to(torch.bfloat16)
    else:
        out = (base.float() + low * scaling).to(torch.bfloat16)
    if not activation:
        return out
    gate, up = out.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up




@pytest.mark.parametrize("oracle_rounding", [False, True])
@pytest.mark.parametrize(("rows", "inter", "rank", "rank_major"), [
    (4, 3072, 16, True),   # Qwen3-0.6B's gate_up at 4 rows, B stored as the engine stores it
    (16, 200, 8, False),   # features off the block, B row-major
    (37, 96, 4, False),    # more rows than a program holds (a prefill's)
])
def test_gate_and_up_are_added_and_rounded_as_the_engine_does(rows, inter, rank, rank_major, oracle_rounding):
    from rollout_lib.backends import mlp_epilogue

    generator = torch.Generator().manual_seed(rows + inter)
    both, lora_b = _gemm_output(rows, inter, rank, generator)
    if rank_major:
        lora_b = lora_b.t().contiguous().t()
    both, lora_b = both.to(DEVICE), lora_b.to(DEVICE)
    got = mlp_epilogue.launch(both, lora_b, 2.0, inter, oracle_rounding, activation=False)
    want = _reference(both, lora_b, 2.0, inter, oracle_rounding, activation=False)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 2 * inter)
    if DEVICE == "cuda":
        assert torch.equal(got, want)
    else:
        assert truncated_or_equal(got.cpu(), want.cpu())


def test_the_silu_product_is_within_two_roundings_of_torchs_and_any_shape_goes_through_the_op():
    """SiLU's sigmoid is Triton's, torch's another float32 formula: the product within two bf16 steps of torch's
    (a rounding of SiLU, a rounding of the product), on a GPU most of it bit for bit; [batch, length, width] in,
    [batch, length, inter] out."""
    from rollout_lib.backends import mlp_epilogue

    rows, inter, rank = 16, 3072, 16
    generator = torch.Generator().manual_seed(5)
    both, lora_b = _gemm_output(rows, inter, rank, generator)
    both, lora_b = both.to(DEVICE), lora_b.to(DEVICE)
    want = _reference(both, lora_b, 2.0, inter, False, activation=True).float()
    got = mlp_epilogue.gate_up_activation(both.reshape(4, 4, -1), lora_b, 2.0, inter)
    assert got.shape == (4, 4, inter) and got.dtype == torch.bfloat16
    got = got.reshape(rows, inter).float()
    assert bool(((got - want).abs() <= 2 * torch.finfo(torch.bfloat16).eps * want.abs() + 1e-30).all())
    if DEVICE == "cuda":  # rounding to nearest as torch does: most products bit for bit
        assert float((got == want).float().mean()) > 0.9


def test_a_gemm_output_that_is_not_a_gate_up_with_its_shrink_is_refused_by_name():
    from rollout_lib.backends import mlp_epilogue

    both = torch.zeros(4, 2 * 96 + 3 * 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"^GATE_UP_EPILOGUE triton: the GEMM output \(4, 216\) and B \(192, 4\) "
                                         r"are not a gate_up projection of 96 features"):
        mlp_epilogue.launch(both, torch.zeros(192, 4, device=DEVICE), 1.0, 96)


def test_a_bf16_engine_with_the_epilogue_serves_the_policy_and_its_tokens(smoke_study, snapshot_cache):
    """The kernel inside the engine's compiled pieces (an opaque op between the gate_up and down GEMMs), with the
    shrink in the base GEMM: the synced policy's identity is the default engine's; every layer's MLP went through it
    (on a CPU: the op's calls; on a GPU: its kernel's launches, which CUDA graphs replay without calling the op);
    and the bf16 tokens and log-probabilities are those of the same engine with inductor's expand and SiLU: the
    same float32 products summed in another order, SiLU's sigmoid by another formula, whose bf16 roundings part
    now and then and carry through the layers: log-probabilities within 0.05 and tokens apart only after that."""
    from rollout_lib.study.workload import Workload

    policy, runs = run_engines(smoke_study, snapshot_cache, ({"LORA_SHRINK": "in_base_gemm"}, {
        "LORA_SHRINK": "in_base_gemm", "GATE_UP_EPILOGUE": "triton"}), "rollout::gate_up_epilogue",
        "gate_up_epilogue_kernel")
    (default_identity, default, none), (identity, got, used) = runs
    assert identity == default_identity == policy.identity
    assert none == [] and len(used) >= Workload(smoke_study).arch.num_hidden_layers
    assert_parts_only_after_close_logprobs(default, got)
