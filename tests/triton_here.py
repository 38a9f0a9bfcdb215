"""Where the hand-written Triton kernels' tests run (test_lora_expand_triton.py, test_skinny_gemm.py,
test_mlp_epilogue.py): on a CUDA GPU there; on a CPU in Triton's interpreter where Triton is installed; skipped,
saying so, where neither is (the CPU CI has no Triton). A test module takes `DEVICE`, `MARKS` as its `pytestmark`,
and the autouse fixture; an engine-level test, `run_engines` and `assert_parts_only_after_close_logprobs`."""

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


ENGINE_CELLS = ("p48-r24-n2-greedy", "p16-r24-n2-stochastic")


def run_engines(study, cache_dir, engines, op_name: str, kernel_prefix: str):
    """Each `engine` option of `engines` as a bf16 hf_cached on the compiled graphs path, serving the study's policy
    version 2 and generating ENGINE_CELLS: (policy, [(its identity, its results per cell, the op's calls)]). The
    calls: on a CPU the op's profiler events (their input shapes recorded; the interpreter runs each call as it
    comes), on a GPU its kernel's launches (CUDA graphs replay them without calling the op)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from rollout_lib.backends import create_backend
    from rollout_lib.models.policy import policy_versions
    from rollout_lib.study.workload import Workload

    workload = Workload(study)
    policy = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, 2)[-1]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE != "cpu" else [])
    runs = []
    for engine in engines:
        torch._dynamo.reset()
        backend = create_backend("hf_cached", study, device=DEVICE, compute_dtype="bfloat16", decode="graphs",
                                 step_compile="inductor", cache_dir=cache_dir, engine=engine)
        backend.cold_start()
        try:
            identity = backend.sync_policy(policy)
            with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
                results = {c: backend.generate(workload.requests(workload.cell(c))).results for c in ENGINE_CELLS}
            if DEVICE == "cpu":
                calls = [event for event in prof.events() if event.name == op_name]
            else:
                calls = [event for event in prof.events() if event.device_type == DeviceType.CUDA
                         and event.name.startswith(kernel_prefix)]
            runs.append((identity, results, calls))
        finally:
            backend.teardown()
    return policy, runs


def assert_parts_only_after_close_logprobs(default, got, tolerance: float = 0.05) -> None:
    """Per cell and request of ENGINE_CELLS: the log-probabilities of the tokens both engines chose alike within
    `tolerance`, and tokens apart only after the first (where two float32 orders' bf16 roundings put two tokens
    near a tie)."""
    for cell in ENGINE_CELLS:
        for a, b in zip(default[cell], got[cell], strict=True):
            same = 0
            while same < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[same] == b.token_ids[same]:
                same += 1
            assert max(abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same], strict=True)) < tolerance
            if same < len(a.token_ids):
                assert same > 0 and a.request_id == b.request_id


def exact_values(shape, generator, scale: float) -> torch.Tensor:
    """Small integers (-3..3) times `scale` (a power of two), float32 on the CPU: products and their sums stay
    exact, so a kernel's summation order cannot hide a wrong term."""
    return torch.randint(-3, 4, shape, generator=generator).float() * scale


def truncated_or_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 `got` is `want`, or (Triton's CPU interpreter truncates float32 -> bf16 conversions where the GPU rounds
    to nearest even) its neighbour one bf16 step toward zero."""
    step = torch.finfo(torch.bfloat16).eps * want.float().abs()
    apart = got.float() - want.float()
    return bool(((apart == 0) | ((apart.abs() <= step) & (got.float().abs() < want.float().abs()))).all())
