"""publish --check: passes on untouched files, fails on a flipped raw byte and on a changed calculator."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_lib.core import sha256_file
from rollout_lib.evidence.publish import (
    CalculatorHashMismatch,
    EvidenceRefused,
    PublishCheckFailed,
    aggregate_path,
    check,
    publish,
)
from rollout_lib.measure.runner import run, validate_parameters
from rollout_lib.study.prereg import load

from .conftest import REPO, SMOKE
from .test_runner import _OOMOnceBackend


@pytest.fixture()
def campaign(tmp_path, scratch_calculator):
    """Raw files from the runner (a fast test backend) and a scratch copy of the calculator."""
    calc = scratch_calculator
    params = tmp_path / "smoke.yaml"
    params.write_text(SMOKE.read_text())
    study = load(params)
    assert study.calculator.sha256 == sha256_file(calc)
    out = tmp_path / "outputs"
    for backend in ("hf_reference", "hf_cached"):
        spec, _, workload = validate_parameters(backend=backend, params=str(params), campaign="pub",
                                                cells=["p16-r24-n2-greedy", "p48-r24-n1-stochastic"],
                                                output_dir=str(out), run_id="r1")
        list(run(spec, study, workload, backend_factory=lambda: _OOMOnceBackend(study)))
    return study, out, calc


def test_publish_then_check_passes(campaign):
    study, out, _ = campaign
    path = publish(study, "pub", out)
    assert path == aggregate_path(out, "pub")
    check(study, "pub", out)
    import json

    aggregate = json.loads(path.read_text())
    assert {"preregistration_sha256", "calculator_sha256", "raw_files", "cells", "speedups", "gates",
            "selection"} <= set(aggregate)
    assert len(aggregate["raw_files"]) == 2 and all(f["accepted"] for f in aggregate["raw_files"])
    assert {(c["backend"], c["cell_id"]) for c in aggregate["cells"]} == {
        (b, c) for b in ("hf_reference", "hf_cached") for c in ("p16-r24-n2-greedy", "p48-r24-n1-stochastic")}


def test_check_fails_on_one_flipped_byte(campaign):
    study, out, _ = campaign
    publish(study, "pub", out)
    raw = next((out / "raw" / "pub" / "hf_cached").glob("*.jsonl"))
    data = bytearray(raw.read_bytes())
    index = data.index(b'"wall_s":') + len(b'"wall_s":') + 2
    data[index] = ord("7") if data[index] != ord("7") else ord("3")
    raw.write_bytes(bytes(data))
    with pytest.raises(EvidenceRefused,
                       match=r"hf_cached/r1\.jsonl: sealed with sha256 [0-9a-f]{64}, found [0-9a-f]{64}"):
        check(study, "pub", out)


def test_check_fails_on_a_one_character_calculator_change(campaign):
    study, out, calc = campaign
    publish(study, "pub", out)
    text = calc.read_text()
    changed = text.replace("CALCULATOR_VERSION = ", "CALCULATOR_VERSION = 1 + ", 1)
    assert changed != text
    calc.write_text(changed)
    with pytest.raises(CalculatorHashMismatch, match="refusing"):
        check(study, "pub", out)
    with pytest.raises(CalculatorHashMismatch):
        publish(study, "pub", out)


def test_check_fails_when_the_aggregate_was_edited(campaign):
    study, out, _ = campaign
    path = publish(study, "pub", out)
    path.write_text(path.read_text().replace('"campaign":"pub"', '"campaign":"pubx"'))
    with pytest.raises(PublishCheckFailed, match="does not re-derive"):
        check(study, "pub", out)


def test_the_committed_calculator_matches_the_preregistration(prereg_study, smoke_study):
    assert sha256_file(REPO / prereg_study.calculator.path) == prereg_study.calculator.sha256
    assert smoke_study.calculator.sha256 == prereg_study.calculator.sha256


def test_evidence_named_for_a_campaign_belongs_to_that_campaign_only():
    from pathlib import Path

    from rollout_lib.evidence.publish import evidence_campaign

    campaigns = ["h200", "h200-v1", "h200-v2", "smoke"]
    assert evidence_campaign(Path("conformance-h200-v1.json"), campaigns) == "h200-v1"
    assert evidence_campaign(Path("refresh-h200-v2-hf_cached-20261201T054100Z.json"), campaigns) == "h200-v2"
    assert evidence_campaign(Path("refresh-h200-hf_cached.json"), campaigns) == "h200"
    assert evidence_campaign(Path("refresh-hf_cached-20261201T070341Z.json"), campaigns) is None  # shared
    assert evidence_campaign(Path("conformance-h200-v10.json"), ["h200-v1", "smoke"]) is None  # not h200-v1


@pytest.mark.parametrize("name", ["h200-v1", "h200-v2"])
def test_the_committed_campaigns_re_derive(prereg_study, name):
    """The committed evidence stays valid: each committed aggregate re-derives byte for byte from the
    committed raw and evidence files (a later campaign's evidence must not change an earlier one)."""
    check(prereg_study, name, REPO / "outputs")


# ------------------------------------------------------------------------------------------
# Issue 40: after-the-fact seals and the allowlist, the manifest's chain, the record rules
# ------------------------------------------------------------------------------------------

def _after_the_fact_copy(out, run_id="r9"):
    """A copy of a genuine raw file under a new run id, sealed after the fact (as `rollout seal
    --after-the-fact` does)."""
    import json

    from rollout_lib.measure.rawfile import seal_abandoned

    source = out / "raw" / "pub" / "hf_cached" / "r1.jsonl"
    records = [json.loads(line) for line in source.read_text().splitlines()]
    records[0]["run_id"] = run_id
    target = source.with_name(f"{run_id}.jsonl")
    target.write_text("".join(json.dumps(r) + "\n" for r in records))
    seal_abandoned(target, reason="an older file, found later", ended="after_the_fact")
    return target


def _allowlist(path, entries):
    body = "".join(f"  - file: {f}\n    sha256: {s}\n    reason: \"{r}\"\n" for f, s, r in entries)
    path.write_text("allowlist_version: 1\nentries:" + ("\n" + body if entries else " []\n"))
    return path


def test_an_after_the_fact_file_counts_only_when_the_allowlist_names_its_hash(campaign, tmp_path):
    import json

    study, out, _ = campaign
    target = _after_the_fact_copy(out)
    empty = _allowlist(tmp_path / "empty.yaml", [])
    aggregate = json.loads(publish(study, "pub", out, allowlist_path=empty).read_bytes())
    row = next(r for r in aggregate["raw_files"] if r["run_id"] == "r9")
    assert row["accepted"] is False and "sealed after the fact" in row["excluded_reason"]
    [marked] = aggregate["sealed_after_the_fact"]
    assert marked["sha256"] == sha256_file(target) and marked["allowlisted"] is False
    assert marked["reason"] == "an older file, found later" and marked["sealed_at"]
    assert aggregate["evidence_allowlist"] == {"status": "bound", "path": str(empty), "sha256": sha256_file(empty)}
    check(study, "pub", out, allowlist_path=empty)

    listed = _allowlist(tmp_path / "listed.yaml",
                        [("r9.jsonl", sha256_file(target), "re-measured copy, reviewed by hand")])
    aggregate = json.loads(publish(study, "pub", out, allowlist_path=listed).read_bytes())
    row = next(r for r in aggregate["raw_files"] if r["run_id"] == "r9")
    assert row["accepted"] is True
    assert aggregate["sealed_after_the_fact"][0]["allowlist_reason"] == "re-measured copy, reviewed by hand"
    import shutil

    shutil.copy(empty, listed)  # the allowlist edited after publish: the aggregate no longer re-derives
    with pytest.raises(PublishCheckFailed, match="does not re-derive byte for byte"):
        check(study, "pub", out, allowlist_path=listed)


@pytest.mark.parametrize("text, needle", [
    ("allowlist_version: 2\nentries: []\n", "allowlist_version: 1"),
    ("allowlist_version: 1\nentries:\n  - {file: x, sha256: abc, reason: long enough reason}\n", "not a lowercase hex"),
    ("allowlist_version: 1\nentries:\n  - {file: x, sha256: " + "a" * 64 + ", reason: short}\n", "10 characters"),
    ("allowlist_version: 1\nentries:\n  - {file: x, sha256: " + "a" * 64 + "}\n", "exactly the keys"),
])
def test_a_malformed_allowlist_is_refused_with_the_entry_named(tmp_path, text, needle):
    from rollout_lib.evidence.admission import AllowlistError, load_allowlist

    path = tmp_path / "allowlist.yaml"
    path.write_text(text)
    with pytest.raises(AllowlistError, match=needle):
        load_allowlist(path)


def test_the_committed_allowlist_names_exactly_the_h200_v1_pilot_seals():
    import json

    from rollout_lib.evidence.admission import load_allowlist

    allowlist, _ = load_allowlist()
    sealed = {}
    for manifest in (REPO / "outputs").rglob("SEALS.jsonl"):
        for line in manifest.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("ended") == "after_the_fact":
                sealed[entry["sha256"]] = entry["path"]
    assert set(allowlist) == set(sealed) and len(sealed) == 4
    assert all(Path(REPO / row["file"]).name == Path(sealed[sha]).name for sha, row in allowlist.items())


def test_every_committed_seal_manifest_still_verifies_and_chains_on(tmp_path):
    """Legacy manifests verify as they are; a new seal appends an anchor over their lines, then any
    edit of a legacy line is named against the anchor."""
    import shutil

    from rollout_lib.measure.rawfile import SealError, read_manifest, read_seals, seal_file

    manifests = sorted((REPO / "outputs").rglob("SEALS.jsonl"))
    assert len(manifests) >= 5
    for manifest in manifests:
        assert read_seals(manifest.parent)
    copy = tmp_path / "raw" / "c" / "SEALS.jsonl"
    copy.parent.mkdir(parents=True)
    shutil.copy(REPO / "outputs" / "raw" / "h200-v2" / "SEALS.jsonl", copy)
    legacy = copy.read_bytes()
    new = copy.parent / "b" / "new.jsonl"
    new.parent.mkdir()
    new.write_text('{"record":"header"}\n')
    seal_file(new, copy.parent, ended="teardown")
    assert copy.read_bytes().startswith(legacy)  # the committed lines keep their bytes
    entries = read_manifest(copy.parent)
    assert entries[-2]["record"] == "chain_anchor" and len(entries[-2]["legacy_line_sha256"]) == legacy.count(b"\n")
    lines = copy.read_bytes().splitlines(keepends=True)
    lines[4] = lines[4].replace(b'"teardown"', b'"complete"')
    copy.write_bytes(b"".join(lines))
    with pytest.raises(SealError, match=r"line 5: does not match the chain anchor"):
        read_seals(copy.parent)


def test_a_fifo_in_a_raw_folder_does_not_hang_publish(campaign):
    import os
    import time

    study, out, _ = campaign
    os.mkfifo(out / "raw" / "pub" / "hf_cached" / "x.jsonl")
    started = time.monotonic()
    with pytest.raises(EvidenceRefused, match=r"x\.jsonl: not a regular file"):
        publish(study, "pub", out)
    assert time.monotonic() - started < 10
    assert not (out / "aggregate").exists()


def test_a_record_breaking_a_number_rule_excludes_its_file_with_the_reason(campaign):
    import json

    from rollout_lib.evidence.admission import record_problem

    _, out, _ = campaign
    records = [json.loads(line) for line in (out / "raw" / "pub" / "hf_cached" / "r1.jsonl").read_text().splitlines()]
    assert record_problem(records) is None
    number = next(i for i, r in enumerate(records) if r.get("record") == "repetition")
    records[number]["wall_s"] = 0
    assert record_problem(records) == (f"record {number + 1} (repetition): wall_s = 0 must be a finite number > 0 "
                                       "(seconds; at least 1e-09)")


def test_writer_locks_live_outside_the_committed_evidence_folders(tmp_path):
    """A raw file's, a cycle raw file's, a conformance file's and a seal manifest's lock go to
    <output-dir>/.locks/ (issue 40: lock files live outside the committed evidence folders); the lock still
    refuses a second writer and names the live holder."""
    import pytest as _pytest

    from rollout_lib.measure.rawfile import FileLock, WriterBusy, live_holder, lock_path

    out = tmp_path / "outputs"
    cases = {out / "raw" / "c" / "hf_cached" / "r.jsonl": out / ".locks" / "raw" / "c" / "hf_cached" / "r.jsonl.lock",
             out / "cycles" / "raw" / "c" / "vllm" / "x.jsonl": out / ".locks" / "cycles" / "raw" / "c" / "vllm"
             / "x.jsonl.lock",
             out / "conformance" / "SEALS.jsonl": out / ".locks" / "conformance" / "SEALS.jsonl.lock",
             tmp_path / "elsewhere" / "f.jsonl": tmp_path / "elsewhere" / "f.jsonl.lock"}
    for target, expected in cases.items():
        assert lock_path(target) == expected
    target = out / "raw" / "c" / "hf_cached" / "r.jsonl"
    with FileLock(target, what="raw"):
        assert live_holder(target)["pid"] > 0
        with _pytest.raises(WriterBusy, match="second raw writer"):
            FileLock(target, what="raw").acquire()
        assert not list((out / "raw").rglob("*.lock")), "no lock file inside the evidence folder"
    assert live_holder(target) is None
