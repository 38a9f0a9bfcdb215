"""The full RL cycle on the GPU (issue 15): two cycles of the preregistered cycle study on hf_cached,
with every phase's memory measured over the process tree and inside the budget.

Each case runs `rollout cycle` in its own process, as the study does: the process-tree peak is the
evidence, and a second teacher + trainer in one pytest process would count the first one's cached
allocator blocks (lease 6's float32 engines ran out of memory that way)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rollout_lib.core import REPO_ROOT
from rollout_lib.measure.cycle import PHASES, cycle_raw_dir
from rollout_lib.measure.rawfile import read_raw
from rollout_lib.study.cycle import load

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_part2]  # docs/reliability.md: GPU suite parts


@pytest.mark.parametrize(("algorithm", "cell"), [("direct_gkd", "p128-r256-n4-stochastic"),
                                                 ("pg_k1", "p128-r256-n4-stochastic"),
                                                 ("pg_k1", "p512-r512-n4-stochastic")])  # lease 11: OOM here
def test_one_hf_cached_cycle_measures_every_phase_within_budget(tmp_path, algorithm, cell):
    params = REPO_ROOT / "params" / "rollout-runtime-v2-cycle.yaml"
    study = load(params)
    subprocess.run([sys.executable, "-m", "rollout_lib.cli", "cycle", "--params", str(params),
                    "--backend", "hf_cached", "--algorithm", algorithm, "--cell", cell, "--campaign", "gpu-test",
                    "--run-id", "gpu-test", "--cycles", "2", "--output-dir", str(tmp_path)],
                   cwd=REPO_ROOT, check=True, timeout=540,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                                  os.environ.get("PYTHONPATH")]))})
    [path] = (cycle_raw_dir(tmp_path, "gpu-test") / "hf_cached").glob(f"{algorithm}-{cell}-gpu-test.jsonl")
    records = read_raw(path)[0]
    cycles = [r for r in records if r["record"] == "cycle"]
    assert len(cycles) == 2
    for cycle in cycles:
        assert set(cycle["phases"]) == set(PHASES)
        for name in PHASES:
            nvml = cycle["memory"][name]["nvml"]
            assert nvml["status"] == "measured", (name, nvml)
            assert 0 < nvml["peak_process_tree_bytes"] < study.memory.budget_bytes, (name, nvml)
        assert cycle["sync_exact"] and cycle["mismatch"]["status"] == "measured"
        assert cycle["full_cycle_tokens_per_s"] < cycle["rollout_tokens_per_s"]
