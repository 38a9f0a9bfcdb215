"""Where the hand-written Triton kernels' tests run (test_lora_expand_triton.py, test_skinny_gemm.py): on a CUDA GPU
there; on a CPU in Triton's interpreter where Triton is installed; skipped, saying so, where neither is (the CPU
CI has no Triton). A test module takes `DEVICE`, `MARKS` as its `pytestmark`, and the autouse fixture."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if torch.cuda.is_available():
    DEVICE, MARKS = "cuda", []
elif importlib.util.find_spec("triton") is not None:
    DEVICE, MARKS = "cpu", []
else:
    DEVICE = "cpu"
    MARKS = [pytest.mark.skip(reason="needs a CUDA GPU, or Triton for its CPU interpreter (not installed here)")]


@pytest.fixture(autouse=True)
def interpreter_on_a_cpu(monkeypatch):
    """On a CPU, Triton's interpreter (read when a kernel is first defined, on first use), for these tests only."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
