"""The fused-mirror training path on the GPU (issue 41): Liger Kernel's fused linear cross-entropy with
reduction="none" against autograd at the preregistered vocabulary (its per-token backward is where users
have reported bugs), and the fast path against the reference trainer on the full-size actor in float32."""

from __future__ import annotations

import sys

import pytest

from rollout_lib.core import REPO_ROOT

pytestmark = pytest.mark.gpu


def test_liger_per_token_logprobs_and_their_backward_match_autograd():
    import torch

    from rollout_lib.models.fast_training import fused_logprobs, liger_unavailable_reason

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
    fused = fused_logprobs(fused_input, weight, targets, "liger")
    (fused * upstream).sum().backward()
    reference_input = hidden.double().clone().requires_grad_(True)
    logits = reference_input @ weight.double().T
    reference = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    (reference * upstream.double()).sum().backward()
    assert float((fused.double() - reference).abs().max()) <= 1e-4
    grad, expected = fused_input.grad.double().flatten(), reference_input.grad.flatten()
    assert float(torch.nn.functional.cosine_similarity(grad, expected, dim=0)) >= 0.99999
    assert float((grad - expected).norm() / expected.norm()) <= 1e-4


def test_the_fast_path_matches_the_reference_trainer_at_full_size_in_float32():
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from fast_training_exactness import THRESHOLDS, compare

    result = compare("float32", "p128-r256-n4-stochastic",
                     str(REPO_ROOT / "params" / "rollout-runtime-v2-cycle.yaml"), rows_limit=4)
    limits = THRESHOLDS["float32"]
    assert result["max_abs_logprob_diff"] <= limits["max_abs_logprob_diff"], result
    assert result["abs_loss_diff"] <= limits["abs_loss_diff"], result
    assert result["grad_cosine"] >= limits["grad_cosine_min"], result
    assert result["grad_relative_norm_diff"] <= limits["grad_relative_norm_diff"], result
