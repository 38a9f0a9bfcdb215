"""tools/lab/epilogue_bench.py (issue 43: the epilogue kernels' launch configurations, GPU only): every
configuration it times computes what the module's default computes, the default is among them, and bad input is
refused in one line before anything runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.triton_here import (  # noqa: F401 (an autouse fixture: Triton's interpreter on a CPU)
    DEVICE,
    MARKS,
    exact_values,
    interpreter_on_a_cpu,
)
from tools.lab.epilogue_bench import _call, configs, default_config, main


@pytest.mark.parametrize("kernel", ["o_down", "gate_up"])
def test_the_modules_default_configuration_is_among_those_timed(kernel):
    assert default_config(kernel) in configs(kernel)


@pytest.mark.parametrize("kernel", ["o_down", "gate_up"])
@pytest.mark.parametrize("rows", [4, 16])
@pytest.mark.skipif(bool(MARKS), reason="needs a CUDA GPU, or Triton for its CPU interpreter (not installed here)")
def test_every_configuration_computes_what_the_default_computes(kernel, rows):
    """On exact values (small integers times powers of two) the float32 sums are the same in any order, so every
    launch configuration gives the default's bits: the bench times one computation, not several."""
    generator = torch.Generator().manual_seed(rows)
    hidden, inner, rank = 64, 96, 4
    if kernel == "o_down":
        operands = {"both": exact_values((rows, hidden + 3 * rank), generator, 0.25),
                    "lora_b": exact_values((rank, hidden), generator, 0.125).t(),
                    "h": exact_values((rows, hidden), generator, 1.0).bfloat16(),
                    "weight": (1 + exact_values((hidden,), generator, 0.0625)).bfloat16()}
    else:
        operands = {"both": exact_values((rows, 2 * inner + 6 * rank), generator, 0.25),
                    "lora_b": exact_values((2 * rank, 2 * inner), generator, 0.125).t(), "inter": inner}
    operands = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                for name, value in operands.items()}
    want = _call(kernel, operands, default_config(kernel))
    for config in configs(kernel):
        got = _call(kernel, operands, config)
        if kernel == "o_down":  # the norm's sum of squares: float32 in each configuration's order
            assert torch.equal(got[0], want[0]), config
            assert torch.allclose(got[1].float(), want[1].float(), rtol=2 * torch.finfo(torch.bfloat16).eps), config
        else:
            assert torch.equal(got, want), config


def test_bad_input_is_refused_by_the_benches_shared_check_naming_its_own_option(tmp_path, monkeypatch, capsys):
    """gemm_bench.refuse_bad_input (its tests: every field, an existing --out, no GPU) with --layers named."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "x.json", "--layers", "57"])
    assert exit_info.value.code == 2
    assert "--layers: 57 is not allowed; allowed: 1 to --calls (56)" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_its_operands_have_the_engines_shapes_and_b_rank_major():
    from tools.lab.epilogue_bench import _operands

    arch = SimpleNamespace(hidden_size=64, intermediate_size=96)
    generator = torch.Generator().manual_seed(0)
    o_down = _operands("o_down", arch, 4, 16, generator)
    assert tuple(o_down["both"].shape) == (16, 64 + 12) and tuple(o_down["lora_b"].shape) == (64, 4)
    assert o_down["lora_b"].stride() == (1, 64)  # rank-major: a rank term's features contiguous
    gate_up = _operands("gate_up", arch, 4, 4, generator)
    assert tuple(gate_up["both"].shape) == (4, 2 * 96 + 24) and tuple(gate_up["lora_b"].shape) == (192, 8)
    assert gate_up["lora_b"].stride() == (1, 192) and gate_up["inter"] == 96
