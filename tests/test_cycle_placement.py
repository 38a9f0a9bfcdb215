"""`rollout cycle --placement ray` (issue 44, item 5) on a local Ray instance on CPU: the backend in one Ray
actor and the trainer in another measure the same cycles as one process does (same losses, gradient norms,
policy versions and rollout log-probabilities), the raw file names both processes, and bad input is refused
before Ray starts anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rollout_lib.core import REPO_ROOT
from rollout_lib.measure.cycle import run_cycles
from rollout_lib.measure.rawfile import read_raw
from rollout_lib.study.cycle import load

ray = pytest.importorskip("ray", reason="ray: not installed (pip install ray==2.60.0, requirements/cpu.txt)")

SMOKE_CYCLE = REPO_ROOT / "params" / "profiles" / "smoke-cycle.yaml"
CELL = "p16-r24-n2-stochastic"


@pytest.fixture(scope="module")
def ray_one_gpu():
    """A local Ray instance: 2 CPUs, one fake GPU (the two actors share it, as on one H200)."""
    if ray.is_initialized():
        ray.shutdown()
    environment = dict(os.environ)
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 1024 ** 2)
    yield ray
    ray.shutdown()
    os.environ.clear()
    os.environ.update(environment)


def _cycles(path):
    records, torn = read_raw(path)
    assert not torn and records[-1]["record"] == "teardown"
    return records[0], [r for r in records if r["record"] == "cycle"]


def test_two_actors_measure_the_same_cycles_as_one_process(ray_one_gpu, tmp_path):
    from rollout_lib.campaign.cycle_placement import run_cycles_on_ray

    cache = str(tmp_path / "cache")
    common = {"device": "cpu", "cache_dir": cache, "cycles": 2}
    alone = run_cycles(load(SMOKE_CYCLE), "hf_cached", "pg_k1", CELL, "one-process", run_id="a",
                       output_dir=tmp_path, **common)
    placed = run_cycles_on_ray(str(SMOKE_CYCLE), "hf_cached", "pg_k1", CELL, "two-actors", run_id="b",
                               output_dir=tmp_path, **common)
    assert placed == (tmp_path / "cycles" / "raw" / "two-actors" / "hf_cached" / f"pg_k1-{CELL}-b.jsonl").resolve()
    header_alone, cycles_alone = _cycles(alone)
    header, cycles = _cycles(placed)
    assert "placement" not in header_alone
    placement = header["placement"]
    assert placement["kind"] == "ray" and placement["gpu_share_each"] == 0.5
    assert placement["rollout_actor"]["pid"] != placement["trainer"]["pid"] != os.getpid()
    assert len(cycles) == len(cycles_alone) == 2
    for a, b in zip(cycles_alone, cycles, strict=True):
        for key in ("loss", "grad_norm", "policy_identity", "next_policy_identity", "generated_tokens",
                    "mean_reward", "sync_exact"):
            assert a[key] == b[key], key
        assert a["mismatch"] == b["mismatch"]  # the rollout's log-probabilities against the trainer's


def test_the_command_refuses_bad_placement_input_before_starting_ray(tmp_path):
    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "rollout_lib.cli", "cycle", "--params", str(SMOKE_CYCLE),
                               "--algorithm", "pg_k1", "--cell", CELL, "--campaign", "x", "--output-dir",
                               str(tmp_path), *argv], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)

    result = cli("--backend", "hf_cached", "--placement", "rays")
    assert result.returncode == 2
    assert "--placement: invalid choice: 'rays' (choose from 'process', 'ray')" in result.stderr
    result = cli("--backend", "hf_cached", "--address", "auto")
    assert result.returncode == 2 and "address: only with --placement ray" in result.stderr
    result = cli("--backend", "sglang", "--placement", "ray")
    assert result.returncode == 2 and "backend 'sglang' is not in the cycle study" in result.stderr
    assert not (tmp_path / "cycles").exists(), "nothing written"
