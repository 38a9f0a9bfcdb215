"""GEMM_KERNEL "triton_skinny" (`rollout_lib/backends/skinny_gemm.py`): the decode step's projection GEMMs as one
Triton kernel that splits K across programs and adds the slices itself, in a fixed order. On a CUDA GPU it runs
there; on a CPU in Triton's interpreter where Triton is installed (the CPU CI has no Triton: skipped there, saying
so; there the tiles are multiplied as float32 upcasts, since the interpreter cannot multiply bf16 tiles, so the CPU
checks the tiling, the slices, their ordered sum and the counters, the GPU the MMA too). Sums are order-free on
the exact values below (small integers times powers of two), so a wrong tile, slice or mask cannot hide: bit for
bit there, within float32 rounding elsewhere."""

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
)

pytestmark = MARKS


def _exact(shape, generator, scale):
    return exact_values(shape, generator, scale).to(torch.bfloat16).to(DEVICE)


def _reference(x, weight):
    return x.double() @ weight.double().t()


@pytest.mark.parametrize(("rows", "features", "inner", "splits"), [
    (4, 4096 + 48, 1024, 4),   # the fused qkv with the shrink's rows (Qwen3-0.6B), 4 rows: 65 tiles x 4 slices
    (16, 1024 + 48, 2048, 8),  # o_proj at 16 rows: 17 tiles x 8 slices
    (16, 6144 + 96, 1024, 2),  # gate_up: 97 tiles x 2
    (4, 1024 + 48, 3072, 8),   # down_proj
    (3, 130, 384, 2),          # rows, features and K off the blocks
    (16, 8448, 256, 1),        # 132 tiles fill the SMs: one slice, no counters
])
def test_the_kernel_sums_every_slice_once_in_order(rows, features, inner, splits):
    from rollout_lib.backends import skinny_gemm

    assert skinny_gemm.splits_for(features, inner, 132) == splits
    skinny_gemm.prepare(DEVICE)
    generator = torch.Generator().manual_seed(rows * features + inner)
    wide = _exact((rows, inner + 64), generator, 0.125)
    x = wide[:, :inner]  # a strided view: rows further apart than K
    weight = _exact((features, inner), generator, 0.25)
    got = skinny_gemm.skinny_mm_float32(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, features)
    assert torch.equal(got.double(), _reference(x, weight))
    assert int(skinny_gemm._LOCKS[device_key(DEVICE)].abs().sum()) == 0, "every counter back at zero"
    assert torch.equal(skinny_gemm.skinny_mm_float32(x, weight), got), "a second launch: the same sums"


@pytest.mark.parametrize("config", [
    {"block_n": 32, "block_k": 64, "splits": 4}, {"block_n": 128, "block_k": 256, "warps": 8, "stages": 3},
    {"block_n": 16, "block_k": 128, "splits": 8, "warps": 2}, {"block_n": 64, "block_k": 32, "splits": 1}])
def test_every_launch_configuration_the_bench_sweeps_sums_exactly(config):
    """`launch` under other configurations than the engine's (the GEMM bench's sweep): the same exact sums, on
    shapes off every block (features, K and rows), the counters back at zero."""
    from rollout_lib.backends import skinny_gemm

    skinny_gemm.prepare(DEVICE)
    generator = torch.Generator().manual_seed(7)
    x, weight = _exact((5, 320), generator, 0.125), _exact((200, 320), generator, 0.25)
    got = skinny_gemm.launch(x, weight, skinny_gemm.Launch(**config))
    assert torch.equal(got.double(), _reference(x, weight))
    assert int(skinny_gemm._LOCKS[device_key(DEVICE)].abs().sum()) == 0


def test_on_any_values_the_kernel_is_within_float32_rounding_and_repeats_itself():
    """Random operands: the kernel's float32 sums in its own order, within float32 rounding of the exact sums
    (|error| <= K * eps * sum |products|), and the same bits on every launch: the last program to arrive adds the
    slices in slice order whichever it is."""
    from rollout_lib.backends import skinny_gemm
    from rollout_lib.models.actor import mm_float32

    skinny_gemm.prepare(DEVICE)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(16, 2048, generator=generator).bfloat16().to(DEVICE)
    weight = (torch.randn(1072, 2048, generator=generator) * 0.02).bfloat16().to(DEVICE)
    got = skinny_gemm.skinny_mm_float32(x, weight)
    bound = 2048 * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().t())
    assert ((got.double() - _reference(x, weight)).abs() <= bound).all()
    assert ((got - mm_float32(x, weight.t())).abs() <= bound.float()).all()
    for _ in range(3):
        assert torch.equal(skinny_gemm.skinny_mm_float32(x, weight), got)


def test_more_rows_than_a_program_holds_go_to_the_float32_gemm(monkeypatch):
    from rollout_lib.backends import skinny_gemm
    from rollout_lib.models.actor import mm_float32

    skinny_gemm.prepare(DEVICE)
    monkeypatch.setattr(skinny_gemm, "_OP", lambda *args: pytest.fail("the kernel ran for a prefill's rows"))
    generator = torch.Generator().manual_seed(3)
    x, weight = _exact((17, 256), generator, 0.5), _exact((128, 256), generator, 0.5)
    assert torch.equal(skinny_gemm.skinny_mm_float32(x, weight), mm_float32(x, weight.t()))


def test_a_bf16_engine_with_the_skinny_gemm_serves_the_policy_and_its_tokens(smoke_study, snapshot_cache):
    """The kernel inside the engine's compiled decode pieces (an opaque op: inductor calls it as it calls cuBLAS),
    with the shrink in the base GEMM as the picked engines run it: the synced policy's identity is the default
    engine's; decode steps' projections went through it (on a CPU: at most MAX_ROWS rows each, no prefill's; on a
    GPU: its kernel's launches, which CUDA graphs replay without calling the op, lease 33); and the bf16 tokens
    and log-probabilities are those of the same engine on cuBLAS's GEMM (`mm_float32`): the same float32 sums of
    exact products, in another order, whose bf16 roundings part now and then and carry through the layers: log-
    probabilities within 0.05 (the Triton expand's bf16 smoke run: 0.039) and tokens apart only after that."""
    from rollout_lib.backends import skinny_gemm

    policy, runs = run_engines(smoke_study, snapshot_cache, ({"LORA_SHRINK": "in_base_gemm"}, {
        "LORA_SHRINK": "in_base_gemm", "GEMM_KERNEL": "triton_skinny"}), "rollout::skinny_mm_float32",
        "skinny_gemm_kernel")
    (default_identity, default, none), (identity, got, used) = runs
    assert identity == default_identity == policy.identity
    assert none == [] and used
    if DEVICE == "cpu":  # a prefill's rows went to cuBLAS's GEMM (on a GPU: the unit test above)
        rows = [event.input_shapes[0][0] for event in used if event.input_shapes and event.input_shapes[0]]
        assert rows and set(rows) <= set(range(1, skinny_gemm.MAX_ROWS + 1))
    assert_parts_only_after_close_logprobs(default, got)



def test_the_o_and_down_variant_takes_those_two_projections_only(smoke_study, snapshot_cache):
    """GEMM_KERNEL "triton_skinny_o_down": the kernel for the o and down projections' decode GEMMs only (their
    weights with the shrink's rows appended: hidden + 3 rank outputs each), cuBLAS for qkv's and gate_up's (on a
    CPU: the op's calls by their weights' shapes; on a GPU: its launches); the synced identity is the default
    engine's and tokens and log-probabilities as the all-projections test above allows."""
    from rollout_lib.study.workload import Workload

    policy, runs = run_engines(smoke_study, snapshot_cache, ({"LORA_SHRINK": "in_base_gemm"}, {
        "LORA_SHRINK": "in_base_gemm", "GEMM_KERNEL": "triton_skinny_o_down"}), "rollout::skinny_mm_float32",
        "skinny_gemm_kernel")
    (default_identity, default, none), (identity, got, used) = runs
    assert identity == default_identity == policy.identity
    assert none == [] and used
    if DEVICE == "cpu":
        outputs = {event.input_shapes[1][0] for event in used if len(event.input_shapes) > 1 and event.input_shapes[1]}
        assert outputs == {Workload(smoke_study).arch.hidden_size + 3 * smoke_study.actor.lora.rank}
    assert_parts_only_after_close_logprobs(default, got)

def test_a_captured_graph_replays_the_kernel_with_new_rows():
    """In a decode step's CUDA graph: the captured launches (their slices' partial buffers from the graph's pool,
    the counters from the buffer `prepare` zeroed) replay with new operand values to the eager result, bit for
    bit, the counters zero after every replay."""
    from rollout_lib.backends import skinny_gemm

    if DEVICE != "cuda":
        pytest.skip("CUDA graphs: on a GPU only (the interpreter has no graphs)")
    skinny_gemm.prepare(DEVICE)
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(4, 2048, generator=generator).bfloat16().to(DEVICE)
    weight = (torch.randn(1072, 2048, generator=generator) * 0.02).bfloat16().to(DEVICE)
    skinny_gemm.skinny_mm_float32(x, weight)  # warmed up (compiled) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_gemm.skinny_mm_float32(x, weight)
    for seed in (1, 2, 3):
        x.copy_(torch.randn(4, 2048, generator=torch.Generator().manual_seed(seed)).bfloat16().to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, skinny_gemm.skinny_mm_float32(x, weight)), seed
        assert int(skinny_gemm._LOCKS[device_key(DEVICE)].abs().sum()) == 0
