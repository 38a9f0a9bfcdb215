"""tools/lab/pdl_bench.py (issue 43: PDL between a GEMM and its epilogue, GPU only): its model epilogue computes
what the bench says it models (the LoRA add, the residual, the row's RMS norm), and bad input is refused in one
line before anything runs. Where the wait sits in each mode: tests/test_kernel_codegen.py (sm_90a's PTX and SASS);
the interpreter cannot run `griddepcontrol.wait`, so only `off` runs here."""

from __future__ import annotations

import pytest
import torch

from tests.triton_here import (  # noqa: F401 (an autouse fixture: Triton's interpreter on a CPU)
    DEVICE,
    MARKS,
    exact_values,
    interpreter_on_a_cpu,
)
from tools.lab import pdl_bench


@pytest.mark.skipif(bool(MARKS), reason="needs a CUDA GPU, or Triton for its CPU interpreter (not installed here)")
def test_the_model_epilogue_is_the_lora_add_the_residual_and_the_norm():
    """On exact values (small integers times powers of two: every float32 sum the same in any order), per row:
    o = bf16(bf16(y) + (a0 + a1 + a2) B), h' = bf16(h + o) exactly; x = bf16(w bf16(h' rsqrt(mean h'^2 + eps)))
    within a rounding (Triton's rsqrt)."""
    features, rank, rows = pdl_bench.FEATURES, pdl_bench.RANK, 4
    generator = torch.Generator().manual_seed(4)
    y = exact_values((rows, features + pdl_bench.PARTS * rank), generator, 0.25)
    b = exact_values((rank, features), generator, 0.125)
    w = (1 + exact_values((features,), generator, 0.0625)).bfloat16()
    h = exact_values((rows, features), generator, 1.0).bfloat16()
    h_out = torch.empty(rows, features, dtype=torch.bfloat16)
    x_out = torch.empty(rows, features, dtype=torch.bfloat16)
    on = [t.to(DEVICE) for t in (y, b, w, h, h_out, x_out)]
    pdl_bench.epilogue(*on, "off")
    xa = (y[:, features:features + rank] + y[:, features + rank:features + 2 * rank]) + y[:, features + 2 * rank:]
    o = (y[:, :features].bfloat16().float() + xa @ b).bfloat16()
    want_h = (h.float() + o.float()).bfloat16()
    stream = want_h.float()
    normed = (stream * torch.rsqrt(stream.pow(2).mean(dim=1, keepdim=True) + 1e-6)).bfloat16()
    want_x = (w.float() * normed.float()).bfloat16()
    assert torch.equal(on[4].cpu(), want_h)
    assert torch.allclose(on[5].cpu().float(), want_x.float(), rtol=2 * torch.finfo(torch.bfloat16).eps)
    assert want_h.abs().sum() > 0 and want_x.abs().sum() > 0


def test_bad_input_is_refused_in_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        pdl_bench.main(["--out", "x.json", "--layers", "57"])
    assert exit_info.value.code == 2
    assert "--layers: 57 is not allowed; allowed: 1 to --calls (56)" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_its_help_says_what_it_times(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pdl_bench.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "Programmatic dependent launch (PDL) between a decode step's cuBLAS GEMM" in " ".join(out.split())
    assert "--layers" in out and "--rows" in out
