"""WEIGHT_PREFETCH (issue 43 candidate): the regions a layer's prefetch asks for are exactly the memory its kernels
read after its attention, in that order; on a GPU (the `gpu` tests) an engine that prefetches serves the same bits
as one that does not. Its kernel's code for sm_90a: test_kernel_codegen.py."""

from __future__ import annotations

import pytest
import torch

from rollout_lib.backends import create_backend, weight_prefetch


def test_a_region_covers_a_tensors_elements_in_whole_16_byte_units():
    base = torch.zeros(64, 48, dtype=torch.bfloat16)
    assert weight_prefetch.region(base) == (base.data_ptr(), 64 * 48 * 2)
    # a column-major view spans the same bytes; a view from the 3rd element starts in the unit that holds it
    assert weight_prefetch.region(base.t()) == weight_prefetch.region(base)
    tail = base.view(-1)[3:1003]
    start, size = weight_prefetch.region(tail)
    assert start % 16 == 0 and size % 16 == 0
    assert start <= tail.data_ptr() < start + 16 and tail.data_ptr() + 1000 * 2 <= start + size < tail.data_ptr() + 2016
    # a strided view: from its first element to its last, the rows between included
    rows = base[::8]
    assert weight_prefetch.region(rows) == (base.data_ptr(), (7 * 8 * 48 + 48) * 2)


def test_a_plan_takes_programs_enough_for_its_largest_region():
    per_program = weight_prefetch.THREADS * weight_prefetch.CHUNK_BYTES
    large = torch.empty(3 * per_program + 16, dtype=torch.uint8)
    small = torch.empty(100, dtype=torch.float32)
    plan = weight_prefetch.plan([small, None, large], "cpu")
    assert plan.programs == 4 and plan.regions == 2
    assert plan.table.tolist() == [list(weight_prefetch.region(small)), list(weight_prefetch.region(large))]
    assert int(plan.table[:, 1].sum()) == 400 + 3 * per_program + 16
    # the bulk prefetch's size is 16-bit in 16-byte units (ptxas encodes it so): a thread's chunk stays under it
    assert weight_prefetch.CHUNK_BYTES // weight_prefetch.ALIGN < 2 ** 16
    with pytest.raises(ValueError, match="at least one tensor with elements"):
        weight_prefetch.plan([None, torch.empty(0)], "cpu")


def test_a_narrower_chunk_takes_more_programs_for_the_same_table():
    """WEIGHT_PREFETCH_BY side_stream_wide: the same regions, each thread's chunk 4 KB instead of 32, so 8x the
    programs (at Qwen3-0.6B's gate_up, 12.6 MB: 24 instead of 3); a chunk that is not a positive multiple of the
    bulk prefetch's 16-byte unit is refused by name."""
    gate_up = torch.empty(2 * 3072 * 1024 * 2, dtype=torch.uint8)
    narrow = weight_prefetch.plan([gate_up], "cpu", weight_prefetch.WIDE_CHUNK_BYTES)
    default = weight_prefetch.plan([gate_up], "cpu")
    assert (default.programs, narrow.programs) == (3, 24)
    assert narrow.table.tolist() == default.table.tolist()
    for bad in (0, 24, 4096.0):
        with pytest.raises(ValueError, match=rf"^WEIGHT_PREFETCH: chunk_bytes {bad!r}; allowed: a positive multiple "
                                             "of 16$"):
            weight_prefetch.plan([gate_up], "cpu", bad)


@pytest.mark.parametrize("shrink", ["reductions", "in_base_gemm"])
def test_each_layers_plan_names_what_its_kernels_read_after_attention(smoke_study, snapshot_cache, shrink):
    """The engine's plans: per layer the o, gate_up and down GEMMs' weights (with the shrink's rows in them under
    LORA_SHRINK in_base_gemm; else each followed by its A), each followed by its B, then ("through_next_qkv") the
    next layer's qkv weight and B; the last layer's plan stops at its down projection."""
    backend = create_backend("hf_cached", smoke_study, device="cpu", compute_dtype="bfloat16", decode="graphs",
                             cache_dir=snapshot_cache, engine={"LORA_SHRINK": shrink})
    backend.cold_start()
    try:
        engine = backend.engine
        for setting in ("rest_of_layer", "through_next_qkv"):
            engine.weight_prefetch = setting
            plans = engine._weight_prefetch_plans()
            assert len(plans) == len(engine.layers)
            for index, (layer, plan) in enumerate(zip(engine.layers, plans, strict=True)):
                read = ["o", "gate_up", "down"]
                if setting == "through_next_qkv" and index + 1 < len(engine.layers):
                    read.append(("qkv", engine.layers[index + 1]))
                want = []
                for entry in read:
                    fused, owner = entry if isinstance(entry, tuple) else (entry, layer)
                    linear = owner.proj[fused]
                    if shrink == "in_base_gemm":
                        assert linear.weight_cat is not None
                        want += [linear.weight_cat, linear.lora_b]
                    else:
                        want += [linear.weight, linear.lora_a, linear.lora_b]
                regions = [list(weight_prefetch.region(t)) for t in want if t is not None]
                assert plan.table.tolist() == regions, (setting, index)
    finally:
        backend.teardown()


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["rest_of_layer", "through_next_qkv"])
def test_an_engine_that_prefetches_serves_the_same_bits(smoke_study, snapshot_cache, setting):
    """A prefetch writes nothing: with it, the compiled graphs serve the same tokens and log-probabilities, bit for
    bit, as without (both engines with REDUCTION_LAUNCH fewest_programs, so inductor draws no launch that could
    order a sum otherwise), and each decode step launches the prefetch kernel once a layer (prefills none)."""
    from rollout_lib.study.workload import Workload
    from tests.triton_here import run_engines

    base = {"ATTENTION_BACKEND": "triton", "REDUCTION_LAUNCH": "fewest_programs"}
    policy, runs = run_engines(smoke_study, snapshot_cache, (base, {**base, "WEIGHT_PREFETCH": setting}),
                               "rollout::weight_prefetch", "l2_prefetch_kernel")
    (base_identity, want, none), (identity, got, launched) = runs
    assert base_identity == identity == policy.identity
    layers = Workload(smoke_study).arch.num_hidden_layers
    assert none == [] and launched and len(launched) % layers == 0, (len(launched), layers)
    for cell in want:
        for a, b in zip(want[cell], got[cell], strict=True):
            assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs), (cell, a.request_id)


@pytest.mark.gpu
@pytest.mark.parametrize("issuer", ["attention", "side_stream_wide"])
def test_an_engine_that_issues_the_prefetch_otherwise_serves_the_same_bits(smoke_study, snapshot_cache, issuer):
    """WEIGHT_PREFETCH_BY attention: `attend`'s kernel asks the L2 for the layer's plan, so where it runs (every
    decode step of these cells: no shared prompt) no prefetch kernel is launched; side_stream_wide: the side
    stream's kernel as often as before, with more programs. The tokens and log-probabilities are the side stream's,
    bit for bit (a prefetch writes nothing)."""
    from tests.triton_here import run_engines

    base = {"ATTENTION_BACKEND": "triton", "REDUCTION_LAUNCH": "fewest_programs", "WEIGHT_PREFETCH": "through_next_qkv"}
    policy, runs = run_engines(smoke_study, snapshot_cache, (base, {**base, "WEIGHT_PREFETCH_BY": issuer}),
                               "rollout::weight_prefetch", "l2_prefetch_kernel")
    (base_identity, want, by_stream), (identity, got, launched) = runs
    assert base_identity == identity == policy.identity
    assert by_stream and len(launched) == (0 if issuer == "attention" else len(by_stream)), (len(by_stream),
                                                                                            len(launched))
    for cell in want:
        for a, b in zip(want[cell], got[cell], strict=True):
            assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs), (cell, a.request_id)
