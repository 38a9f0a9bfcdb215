"""The fused-mirror training path on the GPU (issue 41): Liger Kernel's fused linear cross-entropy with
reduction="none" against autograd at the preregistered vocabulary (its per-token backward is where users
have reported bugs), and the fast path against the reference trainer on the full-size actor in float32."""

from __future__ import annotations

import gc
import sys

import pytest

from rollout_lib.core import REPO_ROOT

pytestmark = pytest.mark.gpu


def test_liger_per_token_logprobs_and_their_backward_match_autograd():
    import torch

    from rollout_lib.models.fast_training import Head, fused_logprobs, liger_unavailable_reason

    device = torch.device("cuda")
    reason = liger_unavailable_reason(device)
    assert reason is None, reason
    generator = torch.Generator(device=device).manual_seed(3)
    tokens, hidden_size, vocab = 3000, 1024, 151936
    weight = torch.randn(vocab, hidden_size, device=device, generator=generator) * 0.05
    hidden = torch.randn(tokens, hidden_size, device=device, generator=generator)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    upstream = torch.randn(tokens, device=device, generator=generator)  # per-token grad_output, not all ones
    fused_input = hidden.clone().requires_grad_(True)
    fused = fused_logprobs(fused_input, Head(weight), targets, "liger")
    (fused * upstream).sum().backward()
    reference_input = hidden.double().clone().requires_grad_(True)
    logits = reference_input @ weight.double().T
    reference = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    (reference * upstream.double()).sum().backward()
    assert float((fused.detach().double() - reference.detach()).abs().max()) <= 1e-4
    grad, expected = fused_input.grad.double().flatten(), reference_input.grad.flatten()
    assert float(torch.nn.functional.cosine_similarity(grad, expected, dim=0)) >= 0.99999
    assert float((grad - expected).norm() / expected.norm()) <= 1e-4


def test_bf16_operand_logprobs_on_tensor_cores_match_the_float32_head_and_its_backward():
    """Float32 sums of exact bf16 products (cuBLAS bf16 GEMM, float32 out) against the float32 head
    computed in float64 on the same (bf16-exact) operands, forward and per-token backward."""
    import torch

    from rollout_lib.models.fast_training import Head, fused_logprobs

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(5)
    tokens, hidden_size, vocab = 1300, 1024, 151936  # 1,300: the 512-token chunks end short
    weight = (torch.randn(vocab, hidden_size, device=device, generator=generator) * 0.05).bfloat16()
    hidden = torch.randn(tokens, hidden_size, device=device, generator=generator).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    upstream = torch.randn(tokens, device=device, generator=generator)
    fused_input = hidden.clone().requires_grad_(True)
    fused = fused_logprobs(fused_input, Head(weight.float(), weight), targets, "bf16_operands")
    (fused * upstream).sum().backward()
    reference_input = hidden.double().requires_grad_(True)
    reference = torch.log_softmax(reference_input @ weight.double().T, dim=-1).gather(-1, targets[:, None])[:, 0]
    (reference * upstream.double()).sum().backward()
    assert float((fused.detach().double() - reference.detach()).abs().max()) <= 1e-4
    grad, expected = fused_input.grad.double().flatten(), reference_input.grad.flatten()
    assert fused_input.grad.dtype == torch.bfloat16
    assert float(torch.nn.functional.cosine_similarity(grad, expected, dim=0)) >= 0.9999
    assert float((grad - expected).norm() / expected.norm()) <= 4e-3  # bf16 rounding of the result


def test_the_fast_path_matches_the_reference_trainer_at_full_size_in_float32():
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from fast_training_exactness import THRESHOLDS, compare

    result = compare("float32", "p128-r256-n4-stochastic",
                     str(REPO_ROOT / "params" / "rollout-runtime-v2-cycle.yaml"), rows_limit=4)
    limits = THRESHOLDS["float32"]
    # the issue's absolute 1e-5 is below float32's floor at these magnitudes (|log p| ~ 28 on random-token
    # rows): lease 21 measured 7.6e-5 for the reference against itself in another batch shape, and exactly
    # that for the fast path. The fast path must stay within that floor (and 1e-5 where the floor is lower).
    floor = max(limits["max_abs_logprob_diff"], result["reference_self_batching_max_abs_logprob_diff"])
    assert result["max_abs_logprob_diff"] <= 1.5 * floor, result
    assert result["abs_loss_diff"] <= 1e-7 * abs(result["loss_reference"]) + limits["abs_loss_diff"], result
    assert result["grad_cosine"] >= limits["grad_cosine_min"], result
    assert result["grad_relative_norm_diff"] <= limits["grad_relative_norm_diff"], result


def test_the_teacher_without_its_float32_head_copy_scores_bit_for_bit_the_same_and_holds_less():
    """The preregistered 1.7B teacher in bf16 on the GPU: with the tied bf16 embedding as its head
    (rollout-runtime-v2-cycle-fast-shared-head.yaml) the fused path's teacher scores equal those with the
    float32 copy bit for bit, and the GPU holds the copy's 1.24 GB less."""
    import torch

    from rollout_lib.models.actor import use_bf16_operand_head, use_float32_lm_head
    from rollout_lib.models.fast_training import score_rows
    from rollout_lib.models.local_snapshot import resolve_model_snapshot
    from rollout_lib.models.synthetic import load_causal_lm
    from rollout_lib.study.cycle import load

    study = load(REPO_ROOT / "params" / "rollout-runtime-v2-cycle-fast-shared-head.yaml")
    spec = study.rollout.teacher
    snapshot = resolve_model_snapshot(spec, study_path=study.rollout.source_path)
    generator = torch.Generator().manual_seed(11)
    rows = [(tuple(torch.randint(0, 151643, (128,), generator=generator).tolist()),
             tuple(torch.randint(0, 151643, (256,), generator=generator).tolist())) for _ in range(16)]
    scores, held = {}, {}
    for name, apply_head in (("copy", use_float32_lm_head), ("shared", use_bf16_operand_head)):
        # lease 23: run after two failed tests, tensors their tracebacks still held were collected during
        # the first load, so "copy" seemed to hold less than "shared": collect before the baseline
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        teacher = load_causal_lm(snapshot.path, torch.bfloat16, "cuda")
        apply_head(teacher)
        held[name] = torch.cuda.memory_allocated() - before
        scores[name] = score_rows(teacher, rows, torch.device("cuda"), 151643, 8192, "bf16_operands")
        del teacher
    assert all(torch.equal(a, b) for a, b in zip(scores["copy"], scores["shared"], strict=True))
    # the copy's bytes, plus what the first load allocates once (lease 22: 1.5 MiB more; the copy is loaded first)
    assert 0 <= (held["copy"] - held["shared"]) - 151936 * 2048 * 4 <= 8 * 2**20, held
