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


@pytest.mark.parametrize(("argv", "message"), [
    (["--out", "x.json", "--rows", "0"], "--rows: [0] is not allowed; allowed: row counts from 1 to 16"),
    (["--out", "x.json", "--repeats", "0"], "--calls/--repeats: 56/0 is not allowed; allowed: integers >= 1"),
    (["--out", "x.json", "--layers", "57"], "--layers: 57 is not allowed; allowed: 1 to --calls (56)"),
    (["--out", "x.json", "--params", "nowhere.yaml"], "--params: nowhere.yaml is not allowed; allowed: a "
                                                      "preregistration file that exists"),
])
def test_bad_input_is_refused_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_an_existing_out_is_refused_and_left_as_it_was(tmp_path, capsys):
    out = tmp_path / "x.json"
    out.write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(out)])
    assert exit_info.value.code == 2 and f"--out: {out} exists; allowed: a new file" in capsys.readouterr().err
    assert out.read_text() == "{}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the tool runs instead of refusing")
def test_without_a_gpu_it_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x.json")])
    assert "a CUDA GPU is needed" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


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
