from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PREREG = REPO / "params" / "rollout-runtime-v2.yaml"
SMOKE = REPO / "params" / "profiles" / "smoke.yaml"


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# The files that take minutes on a 2-core CPU (a real vLLM engine started a dozen times, Ray clusters, training
# loops, executed notebooks), longest first. `make test` runs two pytest-xdist workers a file at a time: started
# first, these overlap the many short files instead of running alone at the end.
LONG_FILES = ("test_vllm_engine.py", "test_ray_executor.py", "test_fast_training.py", "test_notebooks.py",
              "test_fast_path.py", "test_campaign.py", "test_runner.py", "test_report.py")


def _long_first(item) -> int:
    name = Path(str(item.fspath)).name
    return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)


# The files whose processes listen on ports the kernel picks (bind to port 0): Ray's clusters (their gRPC servers)
# and the managed servers (vLLM's, the stand-in's). The frozen `backends/server.py` picks a free port, closes it,
# and the child binds it seconds later; a listener on the other worker took it in between once (CI of stop 72:
# the health check read an HTTP/2 frame, Ray's gRPC). One worker runs these files one after another.
SHARE_PICKED_PORTS = ("test_vllm_engine.py", "test_ray_executor.py", "test_cycle_placement.py",
                      "test_vllm_managed.py", "test_lifetime.py")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """`--dist=loadfile` with the SHARE_PICKED_PORTS files as one work unit (one worker, in collection order)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileSharingPickedPorts(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "files sharing picked ports" if Path(scope).name in SHARE_PICKED_PORTS else scope

    return LoadFileSharingPickedPorts(config, log)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_long_first)  # stable: each file keeps its own order
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA GPU; torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smoke_study():
    from rollout_lib.study.prereg import load

    return load(SMOKE)


@pytest.fixture(scope="session")
def prereg_study():
    from rollout_lib.study.prereg import load

    return load(PREREG)


@pytest.fixture(scope="session")
def snapshot_cache(tmp_path_factory) -> str:
    """One synthetic-snapshot cache per test session (tiny snapshots build in well under a second)."""
    return os.environ.get("ROLLOUT_TEST_CACHE") or str(tmp_path_factory.mktemp("snapshots"))


@pytest.fixture()
def scratch_calculator(tmp_path, smoke_study, monkeypatch):
    """A copy of the frozen calculator that publish reads (its repository root points at a scratch
    tree, so a test may edit the copy without touching the real one); returns the copy's path."""
    import shutil

    calc = tmp_path / "repo" / smoke_study.calculator.path
    calc.parent.mkdir(parents=True)
    shutil.copy(REPO / smoke_study.calculator.path, calc)
    monkeypatch.setattr("rollout_lib.evidence.publish.REPO_ROOT", tmp_path / "repo")
    return calc


def started_backends(study, policy, specs, **common):
    """Backends cold-started and synced to `policy`, by key: `specs` are (key, backend name, options),
    `common` the options every one of them gets (device, compute_dtype, cache_dir)."""
    from rollout_lib.backends import create_backend

    backends = {}
    for key, name, options in specs:
        backend = create_backend(name, study, **common, **options)
        backend.cold_start()
        backend.sync_policy(policy)
        backends[key] = backend
    return backends


def oracle_rollout(rollout, cache_dir: str, cell_id: str):
    """The float32 CPU oracle (hf_reference) cold-started on the study's first policy version, and one
    rollout of `cell_id` by it: (backend, workload, start policy, requests, batch, rows of (prompt, response))."""
    from rollout_lib.backends import create_backend
    from rollout_lib.models.policy import policy_versions
    from rollout_lib.study.workload import Workload

    backend = create_backend("hf_reference", rollout, device="cpu", compute_dtype="float32", cache_dir=cache_dir)
    backend.cold_start()
    workload = Workload(rollout)
    start = policy_versions(workload.arch, rollout.actor.lora, rollout.actor.payload_digest, 1)[0]
    backend.sync_policy(start)
    requests = workload.requests(workload.cell(cell_id))
    batch = backend.generate(requests)
    rows = [(r.prompt_token_ids, tuple(res.token_ids)) for r, res in zip(requests, batch.results, strict=True)]
    return backend, workload, start, requests, batch, rows


def copy_as_local_snapshot(spec, target: Path, cache_dir: str | None = None):
    """A synthetic model's snapshot copied to `target`, a directory a user would name in `source: snapshot`,
    without the synthetic marker (a hub snapshot has none). Returns the synthetic snapshot's info."""
    import shutil

    from rollout_lib.models.synthetic import ensure_snapshot

    info = ensure_snapshot(spec.architecture.name, spec.synthetic_seed, spec.logit_scale, spec.payload_digest,
                           cache_dir=cache_dir)
    shutil.copytree(info.path, target)
    (target / "rollout_synthetic.json").unlink()
    return info


def snapshot_source_study(base: Path, study_dir: Path, path, **changes):
    """`base`'s study with its actor as `source: snapshot` at `path` (relative to the study file, or
    absolute), written to study_dir/study.yaml and loaded; `changes` are further actor keys."""
    import yaml

    from rollout_lib.study.prereg import load

    data = yaml.safe_load(base.read_text())
    for key in ("synthetic_seed", "logit_scale", "logit_calibration"):
        data["actor"].pop(key)
    data["actor"].update({"source": "snapshot", "path": str(path)} | changes)
    study_file = study_dir / "study.yaml"
    study_file.write_text(yaml.safe_dump(data, sort_keys=False))
    return load(study_file)
