"""tools/lab/host_facts.py: the host record each device queue writes beside its logs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollout_lib.core import REPO_ROOT
from rollout_lib.measure import host


def test_cpu_model_is_read_from_cpuinfo():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480C\nflags\t: fpu\n"
    assert host.cpu_model(text) == "Intel(R) Xeon(R) Platinum 8480C"
    assert host.cpu_model("processor\t: 0\n") is None


def test_host_facts_on_a_cpu_machine_say_what_they_could_not_measure():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "lab" / "host_facts.py")],
                            capture_output=True, text=True, check=True, timeout=120)
    facts = json.loads(result.stdout)
    assert facts["logical_cpus"] >= 1 and facts["python_loop_ns_per_iteration"] > 0
    launch = facts["eager_launch_us_per_op"]
    import torch

    if torch.cuda.is_available():
        assert launch["status"] == "measured" and launch["value"] > 0
    else:
        assert launch == {"status": "not_measured", "reason": "no CUDA device"}
        assert facts["gpu"]["status"] == "not_measured" and facts["gpu"]["reason"]


def test_a_job_for_one_card_is_skipped_on_another_with_the_reason(monkeypatch):
    """`--gpu-is NAME` (a queue job measured only on one card): the name matched case-insensitively inside NVML's
    name; another card, or none, is a no with the reason naming what was found."""
    sys.path.insert(0, str(REPO_ROOT))
    from tools.lab import host_facts

    monkeypatch.setattr(host_facts, "gpu_facts", lambda: {"name": "NVIDIA H100 80GB HBM3", "driver": "580"})
    assert host_facts.gpu_is("h100") == (True, "")
    assert host_facts.gpu_is("H200") == (False, "the GPU is NVIDIA H100 80GB HBM3, not H200: skipped")
    monkeypatch.setattr(host_facts, "gpu_facts", lambda: {"status": "not_measured", "reason": "no NVML"})
    assert host_facts.gpu_is("H200") == (False, "no GPU name to compare with 'H200': no NVML")


def test_the_card_check_prints_nothing_and_exits_3_without_that_card():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: its own card decides the answer (the unit test above covers both)")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "lab" / "host_facts.py"), "--gpu-is", "H200"],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (3, "")
    assert result.stderr.startswith("host_facts --gpu-is: no GPU name to compare with 'H200'")
