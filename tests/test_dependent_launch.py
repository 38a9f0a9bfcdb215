"""DEPENDENT_LAUNCH "epilogues" (issue 43 candidate): the o/down and gate_up epilogue kernels launched with
programmatic dependent launch, their LoRA B (and o/down's norm weight) loaded before they wait for the GEMM. Where
the wait sits in each kernel (PTX and SASS for sm_90a): tests/test_kernel_codegen.py; where it is refused (a CPU, no
O_EPILOGUE triton) and left out (float32): tests/test_fast_path.py. Here: which calls each value launches with
PDL (its rows, its kernel; on any machine), and on an sm_90 GPU (the `gpu` tests) an engine with it serves the same
bits as one without, and its epilogue kernels run."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("value, norm_rows, gate_up_rows, qkv_rows", [
    ("off", (), (), ()), ("epilogues", (4, 16), (4, 16), ()), ("norm_epilogues", (4, 16), (), ()),
    ("epilogues_from_16_rows", (16,), (16,), ()), ("epilogues_and_qkv_from_16_rows", (16,), (16,), (16,))])
def test_each_value_launches_with_pdl_the_calls_it_names(monkeypatch, value, norm_rows, gate_up_rows, qkv_rows):
    """The engine passes each epilogue op its fewest rows (PDL_FROM_ROWS); the op, which sees each call's rows (one
    per graph bucket), asks its kernel's launch for PDL only from there: a spy in place of each module's `launch`
    records what a call of 4 and one of 16 rows asked for."""
    import torch

    from rollout_lib.backends import mlp_epilogue, norm_epilogue, qkv_epilogue
    from rollout_lib.backends.compact_qwen3 import DEPENDENT_LAUNCH_ALLOWED, PDL_FROM_ROWS

    assert set(PDL_FROM_ROWS) == set(DEPENDENT_LAUNCH_ALLOWED)
    asked: dict[str, list[int]] = {"norm": [], "gate_up": [], "qkv": []}

    def norm_spy(both, lora_b, h, weight, scaling, eps, oracle_rounding=False, slices=False, pdl=False):
        if pdl:
            asked["norm"].append(both.shape[-2])
        return torch.zeros((2, *h.shape), dtype=torch.bfloat16)

    def gate_up_spy(both, lora_b, scaling, inter, oracle_rounding=False, pdl=False):
        if pdl:
            asked["gate_up"].append(both.shape[0])
        return torch.zeros((both.shape[0], inter), dtype=torch.bfloat16)

    def qkv_spy(both, lora_b, q_norm, k_norm, cos, sin, cache_k, cache_v, write, heads, length, scaling, eps,
                oracle_rounding=False, pdl=False):
        if pdl:
            asked["qkv"].append(both.shape[0])
        batch, kv_heads, _, head_dim = cache_k.shape
        return torch.zeros((batch, kv_heads, heads // kv_heads * length, head_dim), dtype=torch.bfloat16)

    monkeypatch.setattr(norm_epilogue, "launch", norm_spy)
    monkeypatch.setattr(mlp_epilogue, "launch", gate_up_spy)
    monkeypatch.setattr(qkv_epilogue, "launch", qkv_spy)
    norm_from, gate_up_from, qkv_from = PDL_FROM_ROWS[value]
    hidden, rank, inter, heads, kv_heads, head_dim = 8, 2, 4, 4, 2, 4
    for rows in (4, 16):
        norm_epilogue.residual_and_norm(torch.zeros(rows, hidden + 3 * rank), torch.zeros(hidden, rank),
                                        torch.zeros(rows, hidden, dtype=torch.bfloat16),
                                        torch.ones(hidden, dtype=torch.bfloat16), 2.0, 1e-6, pdl_from_rows=norm_from)
        mlp_epilogue.gate_up_activation(torch.zeros(rows, 2 * inter + 3 * 2 * rank), torch.zeros(2 * inter, 2 * rank),
                                        2.0, inter, pdl_from_rows=gate_up_from)
        features = (heads + 2 * kv_heads) * head_dim
        cache = torch.zeros(rows, kv_heads, 8, head_dim, dtype=torch.bfloat16)
        qkv_epilogue.queries_and_cache_write(torch.zeros(rows, 1, features + 9 * rank), torch.zeros(features, 3 * rank),
                                             torch.ones(head_dim), torch.ones(head_dim),
                                             torch.zeros(rows, 1, head_dim), torch.zeros(rows, 1, head_dim), cache,
                                             cache.clone(), torch.zeros(1, dtype=torch.long), heads, 2.0, 1e-6,
                                             pdl_from_rows=qkv_from)
    assert asked == {"norm": list(norm_rows), "gate_up": list(gate_up_rows), "qkv": list(qkv_rows)}


@pytest.mark.gpu
@pytest.mark.parametrize("setting, value, op, kernel", [
    ("DEPENDENT_LAUNCH", "epilogues", "rollout::residual_norm_epilogue", "residual_norm_epilogue_kernel"),
    ("DEPENDENT_LAUNCH", "epilogues_and_qkv_from_16_rows", "rollout::qkv_epilogue", "qkv_epilogue_kernel"),
    ("ATTENTION_DEPENDENT_LAUNCH", "prefetch_kv", "rollout::decode_attention", "decode_attention_kernel")])
def test_an_engine_with_dependent_launch_serves_the_same_bits(smoke_study, snapshot_cache, monkeypatch, setting,
                                                              value, op, kernel):
    """The same operations on the same values, only launched earlier (the attention's k/v asked of the L2 first):
    the compiled graphs serve the same tokens and log-probabilities, bit for bit, as without (both engines with
    REDUCTION_LAUNCH fewest_programs, so inductor draws no launch that could order a sum otherwise), and every
    decode step runs the kernel. DEPENDENT_LAUNCH's rows threshold is lowered to 1 here, so the smoke cells' few
    rows launch every epilogue with PDL."""
    import torch

    from rollout_lib.backends import compact_qwen3
    from tests.triton_here import run_engines

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip(f"needs compute capability 9.0 or later (PDL); {torch.cuda.get_device_name()} is "
                    f"{torch.cuda.get_device_capability()}")
    if setting == "DEPENDENT_LAUNCH":
        monkeypatch.setitem(compact_qwen3.PDL_FROM_ROWS, value,
                            tuple(1 if rows else 0 for rows in compact_qwen3.PDL_FROM_ROWS[value]))
    base = {"LORA_SHRINK": "in_base_gemm", "O_EPILOGUE": "triton", "DOWN_EPILOGUE": "triton",
            "GATE_UP_EPILOGUE": "triton", "QKV_EPILOGUE": "triton", "ATTENTION_BACKEND": "triton",
            "REDUCTION_LAUNCH": "fewest_programs"}
    policy, runs = run_engines(smoke_study, snapshot_cache, (base, {**base, setting: value}), op, kernel)
    (base_identity, want, before), (identity, got, launched) = runs
    assert base_identity == identity == policy.identity
    assert before and len(launched) == len(before), (len(before), len(launched))
    for cell in want:
        for a, b in zip(want[cell], got[cell], strict=True):
            assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs), (cell, a.request_id)
