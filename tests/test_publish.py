"""publish --check: passes on untouched files, fails on a flipped raw byte and on a changed calculator."""

from __future__ import annotations

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
