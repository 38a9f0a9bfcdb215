"""GPU-marked: the vllm backend with vLLM 0.26.0 on the H200, full-size synthetic actor.

Staging: ../shared/device/README.md (three transfers, then `eval "$(bash /tmp/stage/install-vllm.sh)"`,
PYTHONPATH=/tmp/site, VLLM_USE_FLASHINFER_SAMPLER=0). Skipped where vLLM does not import.
"""

from __future__ import annotations

import importlib.util

import pytest

from rollout_lib.backends import create_backend
from rollout_lib.checks.conformance import ConformanceSettings, vllm_conformance
from rollout_lib.checks.refresh import run_refresh

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_part3,  # docs/reliability.md: GPU suite parts
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable here")]


@pytest.fixture(autouse=True, scope="module")
def _servers_die_with_this_process():
    """A test killed at its time limit must not leave its vLLM server holding GPU memory (issue 40): the
    reaper kills this process's descendants when it dies (rollout_lib/lifetime.py)."""
    from rollout_lib.lifetime import start_reaper

    start_reaper()


def test_eight_refreshes_and_teardown_proof_full_size(prereg_study, tmp_path):
    report = run_refresh(prereg_study, create_backend("vllm", prereg_study))
    checks = report["verdict"]["checks"]
    assert checks["unique_identities"] and checks["served_exactly"], report["errors"]
    assert checks["port_closed_after_teardown"] and checks["no_child_left"]
    assert checks["probe_changed_between_versions"]
    assert checks["no_monotonic_memory_growth"], report["memory_series_bytes"]
    assert report["backend_environment"]["kv_cache_memory_bytes"] == prereg_study.memory.budget_bytes // 4


def test_vllm_conformance_full_size_runs(prereg_study):
    report = vllm_conformance(prereg_study, ConformanceSettings(prompt_tokens=(128,), response_tokens=(64,)),
                              create_backend("vllm", prereg_study), device="cuda")
    assert report["teacher_forced"]["positions"] == 4 * 64
    assert report["verdict"]["checks"]["d_identity_exact"]
    assert report["sampled_logprob"]["max_abs_diff"] is not None  # pass or fail is the evidence, not the test
