"""The full RL cycle on the GPU (issue 15): one cycle of the preregistered cycle study on hf_cached,
with every phase's memory measured over the process tree and inside the budget."""

from __future__ import annotations

import pytest

from rollout_lib.core import REPO_ROOT
from rollout_lib.measure.cycle import PHASES, run_cycles
from rollout_lib.measure.rawfile import read_raw
from rollout_lib.study.cycle import load

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("algorithm", "cell"), [("direct_gkd", "p128-r256-n4-stochastic"),
                                                 ("pg_k1", "p128-r256-n4-stochastic"),
                                                 ("pg_k1", "p512-r512-n4-stochastic")])  # lease 11: OOM here
def test_one_hf_cached_cycle_measures_every_phase_within_budget(tmp_path, algorithm, cell):
    study = load(REPO_ROOT / "params" / "rollout-runtime-v2-cycle.yaml")
    path = run_cycles(study, "hf_cached", algorithm, cell, "gpu-test", run_id=f"{algorithm}-{cell}",
                      output_dir=tmp_path, cycles=2)
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
