"""tools/lab/merge_device_outputs.py: what a device call brings back is merged append-only; a returned file
that would overwrite checked-in bytes stops the whole merge before anything is written."""

from __future__ import annotations

import io
import tarfile

import pytest

from tools.lab import merge_device_outputs


def _archive(path, files: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture()
def checkout(tmp_path):
    repo = tmp_path / "repo"
    (repo / "outputs" / "raw" / "c").mkdir(parents=True)
    (repo / "outputs" / "raw" / "c" / "SEALS.jsonl").write_bytes(b'{"seal": 1}\n')
    (repo / "outputs" / "raw" / "c" / "old.jsonl").write_bytes(b"header\nrecord\n")
    (repo / "outputs" / "raw" / "c" / "later.jsonl").write_bytes(b"a\nb\nc\n")
    return repo


def test_new_grown_unchanged_and_behind_files_merge(tmp_path, checkout):
    archive = _archive(tmp_path / "queue.tgz", {
        "outputs/raw/c/SEALS.jsonl": b'{"seal": 1}\n{"seal": 2}\n',  # grew on the device
        "outputs/raw/c/old.jsonl": b"header\nrecord\n",  # unchanged
        "outputs/raw/c/later.jsonl": b"a\nb\n",  # an older copy: the checkout holds more
        "outputs/raw/c/new.jsonl": b"header\n",
        "outputs/raw/c/new.jsonl.lock": b"pid",
        "logs/job.log": b"ran\n", "state/jobs": b"job exit 0\n", "state/queue.tsv": b"job\t1\ttrue\n",
        "state/host.json": b'{"cpu_model": "x"}\n'})
    plan = merge_device_outputs.merge(archive, checkout, logs_to=checkout / "outputs" / "perf" / "q")
    assert plan.new == ["outputs/raw/c/new.jsonl"] and plan.grown == ["outputs/raw/c/SEALS.jsonl"]
    assert plan.behind == ["outputs/raw/c/later.jsonl"] and plan.same == ["outputs/raw/c/old.jsonl"]
    assert (checkout / "outputs/raw/c/SEALS.jsonl").read_bytes().count(b"seal") == 2
    assert (checkout / "outputs/raw/c/later.jsonl").read_bytes() == b"a\nb\nc\n"
    assert not (checkout / "outputs/raw/c/new.jsonl.lock").exists()
    assert sorted(p.name for p in (checkout / "outputs" / "perf" / "q").iterdir()) == [
        "host.json", "job.log", "jobs.txt", "queue.tsv"]


def test_a_conflict_writes_nothing(tmp_path, checkout, capsys):
    archive = _archive(tmp_path / "queue.tgz", {"outputs/raw/c/old.jsonl": b"header\nREWRITTEN\n",
                                                "outputs/raw/c/new.jsonl": b"header\n"})
    assert merge_device_outputs.main([str(archive), "--repo", str(checkout)]) == 1
    assert "CONFLICT outputs/raw/c/old.jsonl" in capsys.readouterr().out
    assert (checkout / "outputs/raw/c/old.jsonl").read_bytes() == b"header\nrecord\n"
    assert not (checkout / "outputs/raw/c/new.jsonl").exists()


def test_dry_run_writes_nothing_and_unsafe_paths_are_refused(tmp_path, checkout):
    archive = _archive(tmp_path / "queue.tgz", {"outputs/raw/c/new.jsonl": b"header\n"})
    assert merge_device_outputs.main([str(archive), "--repo", str(checkout), "--dry-run"]) == 0
    assert not (checkout / "outputs/raw/c/new.jsonl").exists()
    evil = _archive(tmp_path / "evil.tgz", {"../outside.txt": b"x"})
    with pytest.raises(ValueError, match="points outside the archive"):
        merge_device_outputs.merge(evil, checkout)


def test_logs_grow_with_a_later_poll_and_another_machines_logs_conflict(tmp_path, checkout, capsys):
    """The second poll of one queue extends its logs; a second machine of the same lease writes other
    logs under the same names: that is a conflict (nothing written, not even its new evidence), and the
    same archive merges into the folder the message asks for (lease 19 lost its first machine's logs)."""
    logs = checkout / "outputs" / "perf" / "q"
    first = _archive(tmp_path / "poll1.tgz", {"logs/job.log": b"start\n", "state/jobs": b"job running 1\n",
                                              "state/host.json": b'{"launch": 6.6}\n'})
    merge_device_outputs.merge(first, checkout, logs_to=logs)
    second = _archive(tmp_path / "poll2.tgz", {"logs/job.log": b"start\nend\n",
                                               "state/jobs": b"job running 1\njob exit 0 9\n",
                                               "state/host.json": b'{"launch": 6.6}\n'})
    plan = merge_device_outputs.merge(second, checkout, logs_to=logs)
    assert not plan.conflicts
    assert (logs / "job.log").read_bytes() == b"start\nend\n"
    assert (logs / "jobs.txt").read_bytes() == b"job running 1\njob exit 0 9\n"
    other = _archive(tmp_path / "machine2.tgz", {"outputs/raw/c/new.jsonl": b"header\n",
                                                 "logs/job.log": b"another start\n",
                                                 "state/host.json": b'{"launch": 6.1}\n'})
    assert merge_device_outputs.main([str(other), "--repo", str(checkout), "--logs-to", str(logs)]) == 1
    out = capsys.readouterr().out
    assert "CONFLICT outputs/perf/q/job.log (another queue's log" in out
    assert "CONFLICT outputs/perf/q/host.json" in out
    assert (logs / "job.log").read_bytes() == b"start\nend\n"
    assert not (checkout / "outputs/raw/c/new.jsonl").exists()
    assert merge_device_outputs.main([str(other), "--repo", str(checkout), "--logs-to", str(logs / "machine-2")]) == 0
    assert (logs / "machine-2" / "job.log").read_bytes() == b"another start\n"
    assert (checkout / "outputs/raw/c/new.jsonl").exists()
