"""`rollout campaign scaling`: how long a whole campaign takes on N GPUs, from its measured cells (issue 45's
estimate). A hand-made campaign whose every cell has known seconds checks the schedule's arithmetic; the
committed h200-v2 campaign checks the properties any estimate must have; the CLI refuses bad input in one line."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from rollout_lib.campaign.scaling import campaign_scaling, raw_files_by_backend
from rollout_lib.core import OUTPUTS_DIR, REPO_ROOT
from rollout_lib.study.prereg import load
from rollout_lib.study.workload import Workload

SMOKE = REPO_ROOT / "params" / "profiles" / "smoke.yaml"


def _write_campaign(root, study, backend: str, walls: dict[str, float], cold_start_s: float) -> None:
    """One raw file: header, a measured cold start, then each cell's warmup and measured repetitions."""
    folder = root / "raw" / "scaling-test" / backend
    folder.mkdir(parents=True)
    records = [{"record": "header", "backend": backend, "campaign": "scaling-test", "run_id": "20261204T000000Z",
                "measurement_identity_sha256": "ab" * 32},
               {"record": "cold_start", "cold_start_s": {"seconds": cold_start_s, "status": "measured"}}]
    for cell_id, wall_s in walls.items():
        for index in range(study.protocol.warmup_repetitions + study.protocol.measured_repetitions):
            records.append({"record": "repetition", "cell_id": cell_id, "wall_s": wall_s,
                            "warmup": index < study.protocol.warmup_repetitions})
    (folder / "20261204T000000Z-g0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_sixteen_equal_cells_divide_evenly_and_the_longest_cell_bounds_the_rest(tmp_path):
    study = load(SMOKE)
    cells = Workload(study).cell_ids()
    assert len(cells) == 16 and study.protocol.warmup_repetitions + study.protocol.measured_repetitions == 4
    # every cell 1 s per repetition (4 s per cell) except one of 5 s per repetition (20 s)
    walls = {cell: 1.0 for cell in cells} | {cells[0]: 5.0}
    _write_campaign(tmp_path, study, "hf_cached", walls, cold_start_s=10.0)
    result = campaign_scaling(study, "scaling-test", raw_files_by_backend(tmp_path, "scaling-test"), (1, 2, 4, 8))
    (backend,) = result["backends"]
    assert backend["backend"] == "hf_cached" and backend["cells_measured"] == 16
    assert backend["cold_start_source"].startswith("measured")
    # 1 GPU: 10 + 20 + 15 x 4 = 90. 2 GPUs: 20 on one, the fifteen 4 s cells fill the other to 20 first, then
    # alternate: 20 + 4 x 5 = 40 and 4 x 10 = 40 -> 50. 4 GPUs: total 80 = 20 x 4 -> 30. 8 GPUs: the 20 s cell
    # alone bounds it -> 30 (the other 60 s fit on seven GPUs in 12 s each).
    assert backend["makespan_s"] == {"1": 90.0, "2": 50.0, "4": 30.0, "8": 30.0}
    assert backend["bound_s"] == 30.0 and backend["longest_cell"] == cells[0]
    assert result["speedup"] == {"1": 1.0, "2": 1.8, "4": 3.0, "8": 3.0}
    assert result["efficiency"]["8"] == pytest.approx(3.0 / 8, abs=0.01)
    assert result["backends_not_measured"] == ["hf_reference", "vllm"]


def test_the_measured_campaign_scales_no_better_than_its_bound():
    study = load(REPO_ROOT / "params" / "rollout-runtime-v2.yaml")
    result = campaign_scaling(study, "h200-v2", raw_files_by_backend(OUTPUTS_DIR, "h200-v2"), (1, 2, 3, 4, 8))
    assert [b["backend"] for b in result["backends"]] == ["hf_reference", "hf_cached", "vllm"]
    for backend in result["backends"]:
        spans = [backend["makespan_s"][str(n)] for n in (1, 2, 3, 4, 8)]
        assert spans[0] == pytest.approx(backend["serial_s"], abs=0.1)
        assert all(a >= b for a, b in itertools.pairwise(spans)), spans  # more GPUs never slower
        assert spans[-1] >= backend["bound_s"] - 0.1
        assert backend["cells_measured"] == backend["cells"] == 24  # the campaign is complete
    assert all(0 < e <= 1.0 for e in result["efficiency"].values())


def _rollout(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_lib.cli", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "0,2"], "gpus: '0,2' is not allowed; comma-separated whole numbers from 1 to 9999"),
    (["--gpus", "two"], "gpus: 'two' is not allowed"),
])
def test_bad_gpu_counts_are_refused_in_one_line(args, message):
    done = _rollout("campaign", "scaling", "--campaign", "h200-v2", *args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_campaign_without_raw_files_is_refused_and_json_is_written_once(tmp_path):
    done = _rollout("campaign", "scaling", "--campaign", "nothing-here", "--output-dir", str(tmp_path))
    assert done.returncode == 2 and "has no raw files" in done.stderr
    out = tmp_path / "scaling.json"
    done = _rollout("campaign", "scaling", "--campaign", "h200-v2", "--gpus", "1,2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "campaign h200-v2" in done.stdout and json.loads(out.read_text())["gpu_counts"] == [1, 2]
    again = _rollout("campaign", "scaling", "--campaign", "h200-v2", "--json", str(out))
    assert again.returncode == 2 and "exists" in again.stderr
