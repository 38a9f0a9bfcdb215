"""Runner: timing against ground truth, invalidation rules, OOM, crash + resume, identity drift."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rollout_lib.backends.base import BatchResult, RequestResult
from rollout_lib.measure.rawfile import RawWriter, read_raw
from rollout_lib.measure.runner import (
    ParameterError,
    RawIdentityDrift,
    _same_run,
    check_repetition,
    run,
    validate_parameters,
)
from rollout_lib.measure.timing import PhaseTimer

from .conftest import REPO, SMOKE
from .fakes import FakeBackend


@pytest.mark.parametrize("seconds", [0.05, 0.2])
def test_phase_timer_matches_sleep(seconds):
    # bounded by the sleep and by the wall around the block: a busy CPU (two test workers) may wake the
    # sleep late, which the timer must count, not hide
    outer_start = time.perf_counter()
    with PhaseTimer(torch.device("cpu")) as timer:
        time.sleep(seconds)
    outer_s = time.perf_counter() - outer_start
    assert seconds <= timer.seconds <= outer_s


def test_validate_parameters_names_the_bad_one(tmp_path):
    common = dict(params=str(SMOKE), campaign="smoke", output_dir=str(tmp_path))
    with pytest.raises(ParameterError, match=r"backend: unknown backend 'vllm2'; known backends: hf_cached, hf_ref"):
        validate_parameters(backend="vllm2", **common)
    with pytest.raises(ParameterError, match=r"cells: unknown cell id 'p1-r1-n1-greedy'; valid cell ids: p16-r8"):
        validate_parameters(backend="hf_cached", cells=["p1-r1-n1-greedy"], **common)
    with pytest.raises(ParameterError, match="profile_cell"):
        validate_parameters(backend="hf_cached", profile_cell="nope", **common)
    with pytest.raises(ParameterError, match="campaign"):
        validate_parameters(backend="hf_cached", params=str(SMOKE), campaign="Bad Name!")
    with pytest.raises(ParameterError, match="device"):
        validate_parameters(backend="hf_cached", device="tpu", **common)
    spec, _, _ = validate_parameters(backend="hf_cached", cells="p16-r8-n1-greedy,p48-r24-n2-stochastic", **common)
    assert spec.cells == ("p16-r8-n1-greedy", "p48-r24-n2-stochastic")


def _requests(smoke_study, cell_id="p16-r8-n1-greedy"):
    from rollout_lib.study.workload import Workload

    work = Workload(smoke_study)
    return work.requests(work.cell(cell_id))


def _batch(requests, lengths, identity="id", stop="length"):
    results = [RequestResult(r.request_id, tuple([1] * n), stop, None, identity)
               for r, n in zip(requests, lengths, strict=True)]
    return BatchResult(results, 0.1, {})


def test_invalidation_rules(smoke_study):
    requests = _requests(smoke_study)
    ok = _batch(requests, [8] * 4)
    assert check_repetition(smoke_study, requests, ok, 0.1, "id", 10, [], None) == []
    short = _batch(requests, [8, 8, 5, 8])
    assert [r["rule"] for r in check_repetition(smoke_study, requests, short, 0.1, "id", 10, [], None)] == [
        "INV-TOKEN-COUNT"]
    eos_short = _batch(requests, [8, 8, 5, 8], stop="eos")
    assert check_repetition(smoke_study, requests, eos_short, 0.1, "id", 10, [], None) == []
    rules = {r["rule"] for r in check_repetition(smoke_study, requests, _batch(requests, [8] * 4, identity="other"),
                                                  float("nan"), "id", 2**40, [4242], None)}
    assert rules == {"INV-IDENTITY", "INV-TIME", "INV-BUDGET", "INV-FOREIGN-GPU-PROCESS"}
    oom = check_repetition(smoke_study, requests, None, None, "id", None, [], torch.OutOfMemoryError("boom"))
    assert [r["rule"] for r in oom] == ["INV-OOM"]


class _OOMOnceBackend(FakeBackend):
    """Raises CUDA OOM on its first cell; serves full-length outputs otherwise."""

    name = "fake_oom"

    def before_generate(self, requests) -> float:
        if requests[0].request_id.startswith("p16-r8-n1-greedy"):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return 0.01


def test_oom_is_recorded_and_the_run_continues(smoke_study, tmp_path):
    spec, study, workload = validate_parameters(backend="hf_cached", params=str(SMOKE), campaign="oom",
                                                cells=["p16-r8-n1-greedy", "p16-r8-n2-greedy"],
                                                output_dir=str(tmp_path), run_id="r1")
    summaries = list(run(spec, study, workload, backend_factory=lambda: _OOMOnceBackend(study)))
    assert [s.status for s in summaries] == ["failed", "completed"]
    records, _ = read_raw(spec.path)
    reps = [r for r in records if r["record"] == "repetition"]
    assert reps[0]["invalid_reasons"][0]["rule"] == "INV-OOM" and reps[0]["valid"] is False
    assert [r["status"] for r in records if r["record"] == "cell_complete"] == ["failed", "completed"]
    assert len([r for r in reps if r["cell_id"] == "p16-r8-n2-greedy"]) == 4  # 1 warmup + 3 measured
    assert records[-1]["record"] == "teardown"


def _runner_cmd(tmp_path, run_id):
    return [sys.executable, "-m", "rollout_lib.cli", "measure", "--direct", "--backend", "hf_cached",
            "--campaign", "crash",
            "--params", str(SMOKE), "--run-id", run_id, "--output-dir", str(tmp_path), "--device", "cpu"]


def test_crash_then_resume_loses_and_duplicates_nothing(tmp_path):
    path = tmp_path / "raw" / "crash" / "hf_cached" / "r1.jsonl"
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    proc = subprocess.Popen(_runner_cmd(tmp_path, "r1"), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if path.exists() and path.read_text().count('"record":"cell_complete"') >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = path.read_bytes()
    records, torn = read_raw(path)
    done_before = [r["cell_id"] for r in records if r["record"] == "cell_complete"]
    assert 3 <= len(done_before) < 16, "the kill must land mid-run"
    with open(path, "ab") as handle:  # a torn record, as if the kill hit a write
        handle.write(b'{"record":"repetition","cell_id":"p48')
    out = subprocess.run(_runner_cmd(tmp_path, "r1"), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    after = path.read_bytes()
    assert after.startswith(before), "earlier records must never be rewritten"
    records, torn = read_raw(path)
    assert torn == b""
    assert (path.parent / "r1.jsonl.torn-1").read_bytes() == b'{"record":"repetition","cell_id":"p48'
    completes = [r["cell_id"] for r in records if r["record"] == "cell_complete"]
    assert sorted(completes) == sorted(set(completes)) and len(completes) == 16
    assert completes[:len(done_before)] == done_before
    assert any(r["record"] == "repair" for r in records) and any(r["record"] == "resume" for r in records)
    # an interrupted cell restarts as a new attempt; its old records stay
    restarted = [r for r in records if r["record"] == "cell_start" and r["attempt"] == 1]
    for start in restarted:
        assert any(r["record"] == "cell_start" and r["cell_id"] == start["cell_id"] and r["attempt"] == 0
                   for r in records)


def test_resume_refuses_identity_drift(smoke_study, tmp_path):
    spec, study, workload = validate_parameters(backend="hf_cached", params=str(SMOKE), campaign="drift",
                                                cells=["p16-r8-n1-greedy"], output_dir=str(tmp_path), run_id="r1")
    list(run(spec, study, workload, backend_factory=lambda: _OOMOnceBackend(study)))
    records, _ = read_raw(spec.path)
    header = records[0]
    header["environment"]["gpu"] = {"status": "measured", "name": "NVIDIA GeForce RTX 4080", "driver": "596.49",
                                    "cuda_runtime": "13.0"}
    drifted = tmp_path / "raw" / "drift" / "hf_cached" / "drifted.jsonl"
    drifted.write_text(json.dumps(header) + "\n")
    new_header = dict(records[0])
    from rollout_lib.measure.identity import environment_identity

    new_header["environment"] = environment_identity(
        model_digests={"actor": study.actor.payload_digest, "teacher": study.teacher.payload_digest},
        preregistration_sha256=study.sha256)
    with pytest.raises(RawIdentityDrift, match="RTX 4080"):
        RawWriter(drifted).open(new_header, same_run=_same_run)
    assert drifted.read_text() == json.dumps(header) + "\n"  # untouched


def test_a_profile_replaces_its_trace_whole_and_a_failed_one_leaves_the_previous(tmp_path, smoke_study, monkeypatch):
    """profile_cell writes its gzipped Chrome trace under a temporary name and renames it over the target: a second
    profile replaces the first whole; one whose export fails leaves the first as it was and no temporary file."""
    import gzip

    from rollout_lib.measure import runner
    from rollout_lib.study.workload import Workload

    backend = FakeBackend(smoke_study)
    backend.sync_policy(type("Policy", (), {"identity": "v1"})())
    requests = Workload(smoke_study).requests(Workload(smoke_study).cell("p16-r8-n1-greedy"))
    target = tmp_path / "profiles" / "run-p16-r8-n1-greedy.trace.json.gz"
    _table, path = runner.profile_cell(backend, requests, target)  # a fake backend runs no operator: no table
    assert path == target and "traceEvents" in gzip.decompress(target.read_bytes()).decode()
    first = target.read_bytes()

    def broken_export(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gzip, "open", broken_export)  # profile_cell imports gzip where it runs
    with pytest.raises(OSError, match="No space left"):
        runner.profile_cell(backend, requests, target)
    assert target.read_bytes() == first
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
