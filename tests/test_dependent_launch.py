"""DEPENDENT_LAUNCH "epilogues" (issue 43 candidate): the o/down and gate_up epilogue kernels launched with
programmatic dependent launch, their LoRA B (and o/down's norm weight) loaded before they wait for the GEMM. Where
the wait sits in each kernel (PTX and SASS for sm_90a): tests/test_kernel_codegen.py; where it is refused (a CPU, no
O_EPILOGUE triton) and left out (float32): tests/test_fast_path.py. Here, on an sm_90 GPU (the `gpu` tests): an
engine with it serves the same bits as one without, and its epilogue kernels run."""

from __future__ import annotations

import pytest


@pytest.mark.gpu
def test_an_engine_with_dependent_launch_serves_the_same_bits(smoke_study, snapshot_cache):
    """The same operations on the same values, only launched earlier: the compiled graphs serve the same tokens
    and log-probabilities, bit for bit, as without (both engines with REDUCTION_LAUNCH fewest_programs, so inductor
    draws no launch that could order a sum otherwise), and every decode step runs the o/down epilogue kernel."""
    import torch

    from tests.triton_here import run_engines

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip(f"needs compute capability 9.0 or later (PDL); {torch.cuda.get_device_name()} is "
                    f"{torch.cuda.get_device_capability()}")
    base = {"LORA_SHRINK": "in_base_gemm", "O_EPILOGUE": "triton", "DOWN_EPILOGUE": "triton",
            "GATE_UP_EPILOGUE": "triton", "REDUCTION_LAUNCH": "fewest_programs"}
    policy, runs = run_engines(smoke_study, snapshot_cache, (base, {**base, "DEPENDENT_LAUNCH": "epilogues"}),
                               "rollout::residual_norm_epilogue", "residual_norm_epilogue_kernel")
    (base_identity, want, before), (identity, got, launched) = runs
    assert base_identity == identity == policy.identity
    assert before and len(launched) == len(before), (len(before), len(launched))
    for cell in want:
        for a, b in zip(want[cell], got[cell], strict=True):
            assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs), (cell, a.request_id)
