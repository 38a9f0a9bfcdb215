"""Publish a cycle campaign: verified seals -> the frozen cycle calculator -> canonical aggregate.

`outputs/cycles/raw/<campaign>/<backend>/*.jsonl` (sealed in that folder's SEALS.jsonl) ->
`outputs/cycles/aggregate/<campaign>.json`. The calculator is imported from its file only after its
SHA-256 matches the cycle study's pin; a raw file bound to another cycle study is excluded (named).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import yaml

from rollout_lib.core import OUTPUTS_DIR, REPO_ROOT, canonical_json_bytes, sha256_bytes
from rollout_lib.evidence.admission import ALLOWLIST_PATH, allowlist_binding, load_allowlist
from rollout_lib.evidence.publish import (
    CalculatorHashMismatch,
    EvidenceRefused,
    publish_lock_target,
    read_sealed_raw,
    require_raw_files,
)
from rollout_lib.measure.cycle import failure_where
from rollout_lib.measure.rawfile import exclusive
from rollout_lib.safe_read import UnsafeInput, read_bytes, read_text
from rollout_lib.safe_write import write_bytes_atomic
from rollout_lib.study.cycle import CycleStudy


def verified_cycle_calculator(study: CycleStudy):
    path = REPO_ROOT / study.calculator.path
    actual = sha256_bytes(read_bytes(path, kind="calculator"))
    if actual != study.calculator.sha256:
        raise CalculatorHashMismatch(f"cycle calculator {study.calculator.path} has sha256 {actual}; the cycle study "
                                     f"pins {study.calculator.sha256}: refusing to compute with a calculator that "
                                     "differs")
    spec = importlib.util.spec_from_file_location("rollout_frozen_cycle_calculator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, actual


def collect_cycle_inputs(study: CycleStudy, campaign: str, output_dir: Path,
                         allowlist: dict[str, dict[str, str]] | None = None
                         ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    files, problems, excluded, after = read_sealed_raw(output_dir / "cycles" / "raw" / campaign, allowlist)
    raw_files = []
    for path, records, torn, state, digest in files:
        header = records[0] if records else {}
        relative = path.relative_to(output_dir).as_posix()
        reason = None
        if state != "sealed":
            reason = state
        elif torn:
            reason = f"torn last line ({len(torn)} bytes)"
        elif header.get("cycle_study_sha256") != study.sha256:
            reason = f"bound to cycle study {header.get('cycle_study_sha256')}, not this one"
        elif header.get("backend") != path.parent.name:
            reason = f"header backend {header.get('backend')!r}, its place says {path.parent.name!r}"
        elif not any(r.get("record") == "cycle" for r in records):
            reason = "no cycle record: " + ended_before_first_cycle(records)
        elif path in excluded:
            reason = excluded[path]
        entry = {"path": relative, "sha256": digest, "records": records,
                 "accepted": reason is None}
        if reason is not None:
            entry["excluded_reason"] = reason
        raw_files.append(entry)
    if problems:
        raise EvidenceRefused(f"{len(problems)} evidence problem(s), nothing computed:\n  " + "\n  ".join(problems))
    return raw_files, after


def ended_before_first_cycle(records: list[dict[str, Any]]) -> str:
    """How a run without one cycle record ended, in the file's own words: its failure record (the
    phase, cycle and exception), else the reason of its seal without teardown, else its last record."""
    kinds = {r.get("record"): r for r in records}
    if "failure" in kinds:
        failure = kinds["failure"]
        return f"failed in {failure_where(failure)}: {failure.get('error')}"
    if "sealed_without_teardown" in kinds:
        sealed = kinds["sealed_without_teardown"]
        return f"sealed without teardown ({sealed.get('ended')}): {sealed.get('reason')}"
    return f"ended after its {records[-1].get('record') if records else 'nothing'} record"


def derive_cycles(study: CycleStudy, campaign: str, output_dir: Path = OUTPUTS_DIR,
                  allowlist_path: Path | None = None) -> tuple[bytes, dict[str, Any]]:
    calculator, calculator_sha = verified_cycle_calculator(study)
    data = yaml.safe_load(read_text(study.source_path, kind="preregistration")) \
        if Path(study.source_path).is_file() else _as_plain(study)
    allowlist_path = ALLOWLIST_PATH if allowlist_path is None else allowlist_path
    allowlist, allowlist_sha = load_allowlist(allowlist_path)
    raw_files, after = collect_cycle_inputs(study, campaign, output_dir, allowlist)
    aggregate = calculator.compute_cycle_aggregate(data, campaign=campaign, cycle_study_sha256=study.sha256,
                                                   calculator_sha256=calculator_sha, raw_files=raw_files)
    if after:  # only then: a cycle aggregate without hand-sealed inputs keeps its earlier bytes
        aggregate["sealed_after_the_fact"] = after
        aggregate["evidence_allowlist"] = allowlist_binding(after, allowlist_sha, allowlist_path)
    return canonical_json_bytes(aggregate), aggregate


def _as_plain(study: CycleStudy) -> dict[str, Any]:
    return {f.name: getattr(study, f.name) for f in dataclasses.fields(study) if f.init} | {
        "algorithms": dataclasses.asdict(study.algorithms), "memory": dataclasses.asdict(study.memory)}


def aggregate_path(output_dir: Path, campaign: str) -> Path:
    return output_dir / "cycles" / "aggregate" / f"{campaign}.json"


def publish_cycles(study: CycleStudy, campaign: str, output_dir: Path = OUTPUTS_DIR,
                   allowlist_path: Path | None = None) -> Path:
    require_raw_files(output_dir / "cycles" / "raw" / campaign, campaign)
    path = aggregate_path(output_dir, campaign)
    with exclusive(publish_lock_target(output_dir, f"cycle-publish-{campaign}"), what=f"cycle publish of {campaign}"):
        data, _ = derive_cycles(study, campaign, output_dir, allowlist_path)
        write_bytes_atomic(path, data)  # derived, not evidence: re-derivable from the raw files
    return path


def check_cycles(study: CycleStudy, campaign: str, output_dir: Path = OUTPUTS_DIR) -> None:
    """Re-derive the published cycle aggregate from the raw files; raise when a byte differs."""
    path = aggregate_path(output_dir, campaign)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: publish the cycle campaign first")
    data, _ = derive_cycles(study, campaign, output_dir)
    try:
        stored = read_bytes(path, kind="aggregate", root=output_dir)
    except UnsafeInput as exc:
        raise EvidenceRefused(str(exc)) from None
    if data != stored:
        raise EvidenceRefused(f"{path} does not re-derive from the sealed cycle raw files (sha256 "
                              f"{sha256_bytes(stored)} published, a re-derivation differs)")
