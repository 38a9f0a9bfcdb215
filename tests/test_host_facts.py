"""tools/lab/host_facts.py: the host record each device queue writes beside its logs."""

from __future__ import annotations

import json
import subprocess
import sys

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
