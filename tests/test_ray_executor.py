"""The Ray executor on a local Ray cluster with fake GPU resources (two slots on the CPU): the smoke campaign
over two workers, published and re-derived byte for byte; a worker killed mid-cell, its cell continued by a
replacement with nothing lost or duplicated; refusals (another measurement identity, no shared filesystem,
bad options); Ray never imported by the local path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout_lib.evidence.publish import campaign_cells
from rollout_lib.measure.rawfile import read_raw, read_seals
from rollout_lib.study.prereg import load

from .conftest import REPO, SMOKE

ray = pytest.importorskip("ray", reason="ray: not installed (pip install ray==2.60.0, requirements/cpu.txt)")

SLOW_CELL = "p48-r24-n2-stochastic"  # the oracle's slowest smoke cell: about 1 s per repetition on 2 cores


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the module: 2 CPUs, 2 fake GPUs, no dashboard; token auth left on."""
    if ray.is_initialized():
        ray.shutdown()
    environment = dict(os.environ)  # ray.init exports RAY_AUTH_MODE, PYTHONBREAKPOINT, ...: not for later tests
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 1024 ** 2)
    yield ray
    ray.shutdown()
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture()
def fast_polls(monkeypatch):
    monkeypatch.setattr("rollout_lib.campaign.driver.POLL_S", 0.2)


def _state(out: Path, campaign: str) -> dict:
    (path,) = sorted((out / "campaigns" / campaign).glob("*-driver-*.json"))
    return json.loads(path.read_text())


def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_lib.cli", *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env=env)


def test_the_smoke_campaign_over_two_ray_workers_publishes_and_rederives(ray_cluster, fast_polls, tmp_path, capsys):
    from rollout_lib.campaign import driver

    study = load(SMOKE)
    out = tmp_path / "out"
    assert driver.run_campaign(study, "rsmoke", "hf_cached", out, gpus=None, deadline_s=600, executor="ray",
                               progress=False) == 0
    state = _state(out, "rsmoke")
    assert state["executor"] == "ray" and state["ray"]["nodes"] == 1
    workers = state["workers"]
    assert [w["gpu"] for w in workers] == [0, 1], "the cluster's two GPU slots, one worker each"
    assert sorted(w["gpu_ids"][0] for w in workers) == ["0", "1"], "Ray gave each worker its own GPU"
    # every cell measured exactly once, each worker its own raw file, sealed by its writer
    cells = campaign_cells(study, "rsmoke", out)["hf_cached"]
    assert cells["to_measure"] == [] and len(cells["valid"]) == 16
    seals = read_seals(out / "raw" / "rsmoke")
    completed = []
    for worker in workers:
        raw = Path(worker["raw_file"])
        records, _ = read_raw(raw)
        assert records[0]["run_id"] == worker["run_id"] and records[-1]["record"] == "teardown"
        assert f"hf_cached/{raw.name}" in seals
        completed += [r["cell_id"] for r in records if r["record"] == "cell_complete"]
        # the worker record: node, GPU and executor of this raw file (the frozen header is not extended)
        record = json.loads(Path(worker["record"]).read_text())
        assert record["executor"] == "ray" and record["raw_file"] == raw.name and record["returncode"] == 0
        assert record["hostname"] and record["node_id"] and record["cuda_visible_devices"] == worker["gpu_ids"][0]
    assert sorted(completed) == sorted(cells["valid"])
    # published, then re-derived byte for byte by the CLI
    published = _cli("publish", "--campaign", "rsmoke", "--params", str(SMOKE), "--output-dir", str(out))
    assert published.returncode == 0, published.stderr
    checked = _cli("check", "--campaign", "rsmoke", "--params", str(SMOKE), "--output-dir", str(out))
    assert checked.returncode == 0 and "re-derives byte for byte" in checked.stdout, checked.stderr
    # status names the executor, the cluster and each worker's node and GPU
    text = driver.status(study, "rsmoke", out, "hf_cached")
    assert "executor ray: cluster " in text and "1 node(s); dashboard none" in text, text
    for worker in workers:
        assert f"GPU {worker['gpu']} [ray on " in text and f"GPU {worker['gpu_ids'][0]}] pid " in text, text
    assert text.count("exited 0: 8/8 cells ended (8 completed)") == 2, text


def test_a_worker_killed_mid_cell_is_sealed_and_its_cell_continued(ray_cluster, fast_polls, tmp_path):
    """SIGKILL to the Ray worker process after the cell's first measured repetition: its measuring process dies
    with it, the driver seals the dead raw file and a replacement continues the cell (a segment): every
    measured index exactly once, nothing lost, nothing measured twice."""
    from rollout_lib.campaign import driver

    study = load(SMOKE)
    out = tmp_path / "out"
    backend_dir = out / "raw" / "fault" / "hf_reference"
    seen: dict = {}

    def kill_after_first_measured_repetition():
        give_up = time.time() + 240
        while time.time() < give_up:
            for raw in backend_dir.glob("*-g0.jsonl"):
                try:
                    records, _ = read_raw(raw)
                except Exception:
                    continue
                if any(r.get("record") == "repetition" and r.get("measured_index") == 0 for r in records):
                    record = json.loads((out / "campaigns" / "fault" / "workers" / f"hf_reference-{raw.stem}.json")
                                        .read_text())
                    seen["status"] = driver.status(study, "fault", out, "hf_reference")
                    os.kill(record["worker_pid"], signal.SIGKILL)  # the Ray worker this test's cluster started
                    seen["killed"] = raw.stem
                    return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_after_first_measured_repetition, daemon=True)
    killer.start()
    code = driver.run_campaign(study, "fault", "hf_reference", out, gpus=1, deadline_s=600, executor="ray",
                               cells=[SLOW_CELL], progress=False)
    killer.join(timeout=5)
    assert "killed" in seen, "the worker was never seen mid-cell"
    # while it ran, status said which worker held which cell and how far it was
    assert " running: 0/1 cells ended; now p48-r24-n2-stochastic rep " in seen["status"], seen["status"]
    assert code == 0
    lost, replacement = _state(out, "fault")["workers"]
    assert lost["run_id"] == seen["killed"] and lost["lost"] and lost["replaced_by"] == replacement["run_id"]
    assert lost["sealed"].startswith("sealed abandoned by the driver")
    assert replacement["replaces"] == lost["run_id"] and replacement["returncode"] == 0
    first, _ = read_raw(Path(lost["raw_file"]))
    measured_first = [r["measured_index"] for r in first if r["record"] == "repetition" and not r["warmup"]]
    assert measured_first and first[-1]["record"] == "sealed_without_teardown"
    second, _ = read_raw(Path(replacement["raw_file"]))
    start = next(r for r in second if r["record"] == "cell_start")
    assert start["continues"] == [{"run_id": lost["run_id"], "attempt": 0, "measured_indices": measured_first}]
    measured_second = [r["measured_index"] for r in second if r["record"] == "repetition" and not r["warmup"]]
    assert sorted(measured_first + measured_second) == [0, 1, 2], "every index exactly once"
    assert campaign_cells(study, "fault", out)["hf_reference"]["valid"] == [SLOW_CELL]
    assert _cli("publish", "--campaign", "fault", "--params", str(SMOKE), "--output-dir", str(out)).returncode == 0
    aggregate = json.loads((out / "aggregate" / "fault.json").read_text())
    (cell,) = [c for c in aggregate["cells"] if c["cell_id"] == SLOW_CELL and c["backend"] == "hf_reference"]
    assert cell["valid"] and cell["measured_repetitions"] == 3
    assert [s["run_id"] for s in cell["segments"]] == [lost["run_id"]]
    checked = _cli("check", "--campaign", "fault", "--params", str(SMOKE), "--output-dir", str(out))
    assert checked.returncode == 0, checked.stderr


def test_a_worker_with_another_measurement_identity_is_refused(ray_cluster, fast_polls, tmp_path, monkeypatch):
    """The plan was made for an identity (here: the worker's own with another torch) that the worker does not
    have: the worker refuses before its measuring process starts, and no raw file is written."""
    from rollout_lib.campaign import driver, executors
    from rollout_lib.measure.identity import identity_sha256

    real_probe = executors.RayExecutor.probe_identity

    def planned_elsewhere(self):
        found = real_probe(self)
        key = json.loads(json.dumps(found["key"]))
        key["packages"]["torch"] = "9.9.9"
        return found | {"key": key, "sha256": identity_sha256(key)}

    monkeypatch.setattr(executors.RayExecutor, "probe_identity", planned_elsewhere)
    study = load(SMOKE)
    out = tmp_path / "out"
    code = driver.run_campaign(study, "other", "hf_cached", out, gpus=2, deadline_s=600, executor="ray",
                               cells=["p16-r8-n1-greedy", "p16-r8-n2-greedy"], progress=False)
    assert code == 1
    for worker in _state(out, "other")["workers"]:
        assert "differs from the plan's" in worker["refused"] and "packages.torch: 9.9.9 -> " in worker["refused"]
    assert not list((out / "raw").rglob("*.jsonl")), "a refused worker writes no raw file"
    assert "refused (measurement identity" in driver.status(study, "other", out)


def test_a_worker_that_cannot_see_the_output_directory_is_refused(ray_cluster, fast_polls, tmp_path, monkeypatch):
    from rollout_lib.campaign import driver, executors

    def token_elsewhere(folder):  # as on a node that mounts no shared storage: the token is not there
        return Path(folder) / "workers" / ".shared-fs-token-absent", "0" * 32

    monkeypatch.setattr(executors, "shared_fs_token", token_elsewhere)
    study = load(SMOKE)
    out = tmp_path / "out"
    assert driver.run_campaign(study, "nofs", "hf_cached", out, gpus=1, deadline_s=600, executor="ray",
                               cells=["p16-r8-n1-greedy"], progress=False) == 1
    (worker,) = _state(out, "nofs")["workers"]
    assert worker["refused"].startswith(f"output-dir: {out} is not visible from node ")
    assert "same path" in worker["refused"]
    assert not list((out / "raw").rglob("*.jsonl"))


def test_more_than_one_gpu_means_ray_and_bad_options_are_refused_in_one_line(tmp_path):
    base = ["campaign", "run", "--campaign", "opts", "--params", str(SMOKE), "--output-dir", str(tmp_path / "o"),
            "--backend", "hf_cached"]
    for extra, needle in ((["--executor", "local", "--gpus", "2"], "gpus: 2 with --executor local is not allowed"),
                          (["--gpus", "1", "--address", "auto"], "address: only with --executor ray"),
                          (["--executor", "ray", "--address", "not an address"], "address: 'not an address' is "
                                                                                 "not allowed; auto or HOST:PORT"),
                          (["--executor", "slurm"], "invalid choice: 'slurm'")):
        done = _cli(*base, *extra)
        assert done.returncode == 2, (extra, done.stdout, done.stderr)
        assert needle in done.stderr, (extra, done.stderr)
        if "invalid choice" not in needle:
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "o").exists(), "refused before anything is written"


def test_the_local_path_never_imports_ray_and_a_missing_ray_is_named():
    code = ("import sys; sys.modules['ray'] = None\n"  # as if ray were not installed
            "from rollout_lib.cli import main\n"
            "import rollout_lib.campaign.driver, rollout_lib.campaign.executors\n"
            "from rollout_lib.campaign.executors import ExecutorError, import_ray\n"
            "try:\n    import_ray()\nexcept ExecutorError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("executor: ray is not installed here; `pip install ray==2.60.0` (or use "
                                   "--executor local with one GPU)")
    loaded = subprocess.run([sys.executable, "-c", "import sys, rollout_lib.cli, rollout_lib.campaign.driver; "
                             "print('ray' in sys.modules)"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert loaded.stdout.strip() == "False", loaded.stderr


def test_the_command_joins_a_running_cluster_by_address(ray_cluster, tmp_path):
    """`rollout campaign run --executor ray --address HOST:PORT` from another process joins this module's
    cluster (token authentication on: the token file this user's cluster wrote), measures, and leaves the
    cluster running; `campaign status` names the executor and the cluster."""
    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "out"
    base = ["--campaign", "joined", "--params", str(SMOKE), "--output-dir", str(out)]
    env = dict(os.environ, TQDM_DISABLE="1")
    env.pop("RAY_ADDRESS", None)
    done = _cli("campaign", "run", *base, "--backend", "hf_cached", "--deadline-s", "600", "--executor", "ray",
                "--address", address, "--cells", "p16-r8-n1-greedy,p16-r8-n2-greedy", env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("(ray on ") == 2 and done.stdout.count("): exit 0; raw file ") == 2, done.stdout
    assert ray_cluster.is_initialized() and ray_cluster.cluster_resources().get("GPU") == 2, "the cluster stays up"
    status = _cli("campaign", "status", *base, env=env)
    assert status.returncode == 0, status.stderr
    assert f"executor ray: cluster {address}, 1 node(s); dashboard " in status.stdout, status.stdout
    assert "hf_cached: 2 valid, 14 to measure" in status.stdout, status.stdout
