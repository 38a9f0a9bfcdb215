"""tools/profile_standin_training.py on the tiny stand-in on CPU: every setup phase and every step phase is
timed per variant (the product's own kernel choices), each variant gets its Chrome trace and its determinism
check, bad input is refused by name."""

from __future__ import annotations

import json

import pytest

from tools.profile_standin_training import gradients_repeat, main, parse_variant


def test_the_tiny_training_step_is_profiled_per_phase_and_variant(tmp_path):
    variants = ["eager", "sdpa+nofill+fused+chunked", "eager+batch16"]
    assert main(["--arch", "tiny", "--device", "cpu", "--variants", ",".join(variants), "--warmup", "1",
                 "--steps", "2", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["setup_s"]) == {"build_initial_snapshot", "token_streams"}
    assert list(summary["variants"]) == variants
    for name, row in summary["variants"].items():
        assert row["steps"] == 2 and row["tokens_per_s"] > 0
        phases = row["median_s"]
        assert set(phases) == {"forward_s", "loss_s", "backward_s", "clip_s", "optimizer_s", "step_s"}
        assert phases["step_s"] >= phases["forward_s"] > 0 and phases["backward_s"] > 0
        assert row["top_ops_by_self_time_us"], "the profiled step's top operators"
        assert json.loads((tmp_path / f"trace-{name}.json").read_text())["traceEvents"]
        assert row["gradients_repeat"]["identical"] is True and row["gradients_repeat"]["tensors"] > 20
    rows = summary["variants"]
    assert "init_heldout_metrics_s" in rows["eager"] and rows["eager"]["tokens_per_s_over_first"] == 1.0
    assert rows["sdpa+nofill+fused+chunked"]["kernels"] == {
        "attention": "sdpa", "loss": "chunked", "optimizer": "fused", "fill_uninitialized": False,
        "step": "eager", "sdpa_backend": "flash_attention", "loss_chunk_tokens": 1024, "graph_warmup_steps": None}
    assert rows["eager+batch16"]["tokens_per_step"] == 2 * rows["eager"]["tokens_per_step"]


def test_a_step_whose_gradients_change_when_repeated_is_reported(monkeypatch):
    import torch

    from rollout_lib.models import train_standin
    from rollout_lib.models.train_standin import TrainKernels

    model = torch.nn.Linear(3, 1, bias=False)
    passes = iter(range(10))
    # a stand-in for a nondeterministic backward: each pass scales the output a little differently
    monkeypatch.setattr(train_standin, "forward_for_loss",
                        lambda m, inputs, kernels, autocast: m.weight * (1.0 + 1e-3 * next(passes)))
    monkeypatch.setattr(train_standin, "loss_of", lambda m, out, targets, kernels, autocast: out.sum())
    result = gradients_repeat(model, torch.zeros(1, 2, dtype=torch.long), TrainKernels(), False)
    assert result["identical"] is False and result["loss_identical"] is False
    assert result["tensors"] == 1 and result["tensors_differing"] == 1
    assert abs(result["max_abs_grad_diff"] - 1e-3) < 1e-6


def test_variants_parse_to_the_products_kernel_choices():
    kernels, factor = parse_variant("sdpa+fused")
    assert (kernels.attention, kernels.loss, kernels.optimizer, kernels.fill_uninitialized, factor) == \
        ("sdpa", "full", "fused", True, 1)
    with pytest.raises(ValueError, match="modifier 'fused'; allowed once each"):
        parse_variant("eager+fused+fused")


def test_bad_input_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--variants", "flash", "--out", str(tmp_path)])
    assert "--variants: 'flash': attention 'flash'; allowed: eager, sdpa" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--variants", "eager+compiled", "--out", str(tmp_path)])
    assert "modifier 'compiled'; allowed once each: chunked, fused, nofill, graph, batch16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--arch", "tiny", "--device", "cpu", "--variants", "eager,sdpa+graph", "--out", str(tmp_path / "g")])
    assert "--variants: 'sdpa+graph': step: 'graph' captures a CUDA graph, not on device 'cpu'" in \
        capsys.readouterr().err
    assert not (tmp_path / "g").exists()
    with pytest.raises(SystemExit):
        main(["--arch", "qwen9", "--device", "cpu", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_a_failing_variant_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    from rollout_lib.models import train_standin

    real = train_standin.make_optimizer

    def make_optimizer(model, recipe, kernels):
        if kernels.optimizer == "fused":
            raise RuntimeError("fused AdamW refused (simulated)")
        return real(model, recipe, kernels)

    monkeypatch.setattr(train_standin, "make_optimizer", make_optimizer)
    assert main(["--arch", "tiny", "--device", "cpu", "--variants", "eager,eager+fused,sdpa", "--warmup", "1",
                 "--steps", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["variants"]
    assert rows["eager+fused"]["error"] == "RuntimeError: fused AdamW refused (simulated)"
    assert "tokens_per_s" not in rows["eager+fused"] and rows["sdpa"]["tokens_per_s"] > 0
    assert rows["sdpa"]["tokens_per_s_over_first"] > 0 and rows["eager"]["tokens_per_s_over_first"] == 1.0
