"""The stand-in's faster training kernels on the GPU (issue 42's budget): FlashAttention-2 through SDPA with
its deterministic backward, the chunked head and loss, the fused AdamW and no NaN fill, in bf16 autocast as
`rollout models train --device cuda` runs them. Two trainings give one digest; the flash kernel is the one
that ran (the SDPA pin raises otherwise); the reference kernels on the GPU give the digest they gave before."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

FAST = dict(attention="sdpa", loss="chunked", optimizer="fused", fill_uninitialized=False)


def _train(tmp_path, name, **kernels):
    from rollout_lib.models.train_standin import TrainKernels, plan_training, train_standin

    plan = plan_training("tiny", role="actor", device="cuda", kernels=TrainKernels(**kernels))
    return train_standin(plan, tmp_path / name)


def test_the_fast_kernels_train_twice_to_one_digest_on_the_gpu(tmp_path):
    first = _train(tmp_path, "a", **FAST)
    second = _train(tmp_path, "b", **FAST)
    assert first["payload_digest"] == second["payload_digest"]
    assert first["compute_dtype"] == "bfloat16" and first["deterministic"]["warn_only"] is False
    assert first["deterministic"]["nondeterminism_warnings"] == []
    reference = _train(tmp_path, "ref")
    assert abs(first["final_metrics"]["heldout_loss_nats"] - reference["final_metrics"]["heldout_loss_nats"]) < 0.15


def test_the_pinned_sdpa_runs_the_flash_kernel_forward_and_backward():
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rollout_lib.models.train_standin import TrainKernels, deterministic_kernels, forward_for_loss, loss_of
    from rollout_lib.study.arch import get_architecture

    arch = get_architecture("qwen3-0.6b")
    config = Qwen3Config(vocab_size=4096, hidden_size=arch.hidden_size, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_key_value_heads,
                         head_dim=arch.head_dim, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().train()
    kernels = TrainKernels(**FAST)
    batch = torch.randint(0, 4096, (2, 257), device="cuda")
    with deterministic_kernels("cuda", kernels), profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss = loss_of(model, forward_for_loss(model, batch[:, :-1], kernels, True), batch[:, 1:], kernels, True)
        loss.backward()
        torch.cuda.synchronize()
    names = [e.key.lower() for e in prof.key_averages()]
    assert any("flash" in n and "bwd" in n for n in names), names[:40]
    assert any("flash" in n and "fwd" in n for n in names), names[:40]


def test_the_step_captured_as_one_cuda_graph_trains_like_the_eager_step(tmp_path):
    """TrainKernels(step="graph"): three eager steps, one capture, then a replay per step. Two trainings give one
    digest, and the held-out loss stays the eager sdpa step's (the same kernels, the capturable AdamW)."""
    graph = dict(attention="sdpa", loss="chunked", optimizer="fused", fill_uninitialized=False, step="graph")
    first = _train(tmp_path, "g1", **graph)
    second = _train(tmp_path, "g2", **graph)
    assert first["payload_digest"] == second["payload_digest"]
    assert first["kernels"]["step"] == "graph" and first["kernels"]["graph_warmup_steps"] == 3
    eager = _train(tmp_path, "e", **FAST)
    assert abs(first["final_metrics"]["heldout_loss_nats"] - eager["final_metrics"]["heldout_loss_nats"]) < 0.05
    losses = first["train_loss_every_step"]
    assert len(set(losses[3:10])) > 1, "the replays train: their losses move"


def test_the_profile_replays_a_captured_step_bit_for_bit(tmp_path):
    import json

    from tools.profile_standin_training import main

    assert main(["--arch", "tiny", "--device", "cuda", "--variants", "sdpa+fused,sdpa+fused+graph", "--warmup", "2",
                 "--steps", "3", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["variants"]
    assert "error" not in rows["sdpa+fused+graph"], rows["sdpa+fused+graph"].get("error")
    assert rows["sdpa+fused+graph"]["gradients_repeat"]["identical"] is True
    assert set(rows["sdpa+fused+graph"]["median_s"]) == {"step_s"}
