"""tools/profile_standin_training.py on the tiny stand-in on CPU: every setup phase and every step phase is
timed, each attention implementation gets its Chrome trace, bad input is refused by name."""

from __future__ import annotations

import json

import pytest

from tools.profile_standin_training import main


def test_the_tiny_training_step_is_profiled_per_phase_and_attention(tmp_path):
    assert main(["--arch", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["setup_s"]) == {"build_initial_snapshot", "token_streams"}
    assert set(summary["attention"]) == {"eager", "sdpa"}
    for attention, row in summary["attention"].items():
        assert row["steps"] == 2 and row["tokens_per_s"] > 0
        phases = row["median_s"]
        assert set(phases) == {"forward_s", "loss_s", "backward_s", "clip_s", "optimizer_s", "step_s"}
        assert phases["step_s"] >= phases["forward_s"] > 0 and phases["backward_s"] > 0
        assert row["top_ops_by_self_time_us"], "the profiled step's top operators"
        assert json.loads((tmp_path / f"trace-{attention}.json").read_text())["traceEvents"]
    assert "init_heldout_metrics_s" in summary["attention"]["eager"]


def test_bad_input_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--attention", "flash", "--out", str(tmp_path)])
    assert "--attention: 'flash'; allowed: eager, sdpa" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--arch", "qwen9", "--device", "cpu", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
