"""Publish a campaign's aggregate, or check that it re-derives byte for byte.

    rollout publish --campaign h200-v1                  # writes outputs/aggregate/h200-v1.json
    rollout check --campaign h200-v1                    # re-derives and compares

Before anything is computed, the calculator file's SHA-256 must equal the preregistration's pin
(`calculator.sha256`); a placeholder or a different file is refused. `--check` also refuses a raw
or evidence file whose SHA-256 differs from the aggregate's record, and prints a readable diff.

Before anything is computed, every raw file and evidence file is checked against its seal
(`SEALS.jsonl`): a sealed file whose bytes changed, a sealed file that is missing, a file with
neither a seal nor a live writer, or a header whose campaign/backend/run id disagrees with its place
refuses the whole publish, naming each file with the expected and found hashes. A file still being
written is listed as in progress and never used.

Raw files are accepted when bound to this preregistration, or to the same text with another
calculator pin (`pending` before the pin: `pre-pin`; or the pin the file recorded): every
measurement-relevant byte is the same.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import yaml

from rollout_lib.core import OUTPUTS_DIR, REPO_ROOT, canonical_json_bytes, sha256_bytes, sha256_file
from rollout_lib.measure.rawfile import (
    RawFileError,
    SealError,
    exclusive,
    live_holder,
    manifest_path,
    read_raw,
    read_seals,
)
from rollout_lib.study.prereg import CALCULATOR_PENDING, Preregistration, text_with_calculator_pin
from rollout_lib.study.workload import Workload


class CalculatorHashMismatch(RuntimeError):
    pass


class PublishCheckFailed(RuntimeError):
    pass


def verified_calculator(study: Preregistration):
    """Import the calculator from its file after checking its SHA-256 against the pin."""
    pinned = study.require_calculator_pinned()
    path = REPO_ROOT / study.calculator.path
    actual = sha256_file(path)
    if actual != pinned:
        raise CalculatorHashMismatch(f"calculator {study.calculator.path} has sha256 {actual}; the preregistration "
                                     f"pins {pinned}: refusing to compute with a calculator that differs")
    spec = importlib.util.spec_from_file_location("rollout_frozen_calculator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, actual


def binding_label(study: Preregistration, bound_sha: str | None, recorded_pin: str | None) -> str | None:
    """How a file bound to preregistration `bound_sha` relates to this study, or None if unrelated.

    `pinned`: the same bytes. `pre-pin`: the same text with the calculator pin reading `pending`.
    `earlier calculator pin X`: the same text with the pin the file recorded. In every accepted case
    every measurement-relevant byte is the same; only the analysis's calculator hash differs.
    """
    if bound_sha is None:
        return None
    if bound_sha == study.sha256:
        return "pinned"
    text = Path(study.source_path).read_text()
    for pin, label in ((CALCULATOR_PENDING, "pre-pin"),
                       (recorded_pin, f"earlier calculator pin {(recorded_pin or '')[:12]}")):
        if pin and sha256_bytes(text_with_calculator_pin(text, study.calculator.sha256, pin)) == bound_sha:
            return label
    return None


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _verify_sealed(folder: Path, files: list[Path], what: str
                   ) -> tuple[dict[Path, str], dict[Path, str], list[str]]:
    """Seal state of each file (`sealed` or `in progress: ...`), the SHA-256 of each sealed file (read
    once), and the refusals, each naming the file and the expected and found hashes."""
    try:
        seals = read_seals(folder)
    except (SealError, RawFileError) as exc:
        return {}, {}, [str(exc)]
    states, digests, problems = {}, {}, []
    present = set()
    for path in files:
        relative = path.relative_to(folder).as_posix()
        present.add(relative)
        seal = seals.get(relative)
        if seal is not None:
            found = sha256_file(path)
            if found != seal["sha256"]:
                problems.append(f"{_rel(path)}: sealed with sha256 {seal['sha256']}, found {found}: the {what} "
                                "changed after its run ended")
            else:
                states[path], digests[path] = "sealed", found
            continue
        holder = live_holder(path)
        if holder is not None:
            states[path] = f"in progress: being written by pid {holder.get('pid')} on host {holder.get('host')}"
        else:
            problems.append(f"{_rel(path)}: no seal in {_rel(manifest_path(folder))} and no live writer: not "
                            f"the output of a run that ended (resume its run id to finish it, or `rollout seal`)")
    for relative, seal in sorted(seals.items()):
        if relative not in present and not relative.endswith(".lock"):
            problems.append(f"{_rel(folder / relative)}: sealed with sha256 {seal['sha256']} but missing")
    return states, digests, problems


class EvidenceRefused(RuntimeError):
    """Raw or evidence files fail their seals or identity: nothing is computed from them."""


def read_sealed_raw(folder: Path) -> tuple[list[tuple[Path, list[dict[str, Any]], bytes, str, str | None]], list[str]]:
    """The raw files `<folder>/<backend>/*.jsonl` whose seal holds or whose writer is live:
    (path, records, torn bytes, state, sha256), plus every refusal (tampered, missing, unsealed,
    unreadable), each naming the file."""
    paths = sorted(folder.glob("*/*.jsonl"))
    states, digests, problems = _verify_sealed(folder, paths, "raw file") if folder.exists() else ({}, {}, [])
    out = []
    for path in paths:
        if path not in states:
            continue
        try:
            records, torn = read_raw(path)
        except RawFileError as exc:
            problems.append(str(exc))
            continue
        out.append((path, records, torn, states[path], digests.get(path)))
    return out, problems


def evidence_campaign(path: Path, campaigns: list[str]) -> str | None:
    """The campaign an evidence file's name gives it to (`<kind>-<campaign>[-...].json`, one of
    `campaigns`; the longest if several match), or None: shared by every campaign of the output dir."""
    named = [c for c in campaigns if re.search(rf"(^|-){re.escape(c)}(-|$)", path.stem)]
    return max(named, key=len) if named else None


def collect_inputs(study: Preregistration, campaign: str, output_dir: Path) -> dict[str, Any]:
    files, problems = read_sealed_raw(output_dir / "raw" / campaign)
    states = {path: state for path, _, _, state, _ in files}
    digests = {path: digest for path, _, _, _, digest in files if digest}
    raw_files = []
    for path, records, torn, _, _ in files:
        header = records[0] if records else {}
        for key, expected in (("campaign", campaign), ("backend", path.parent.name), ("run_id", path.stem)):
            if header.get(key) != expected and states[path] == "sealed":  # in-progress files are not used
                problems.append(f"{_rel(path)}: header {key} is {header.get(key)!r}, its place says {expected!r}")
        bound = header.get("environment", {}).get("preregistration_sha256")
        binding = binding_label(study, bound, (header.get("preregistration") or {}).get("calculator_pin"))
        entry = {"path": _rel(path), "sha256": digests.get(path) or sha256_file(path), "backend": path.parent.name,
                 "run_id": path.stem, "records": records, "accepted": binding is not None, "binding": binding}
        if binding is None:
            entry["excluded_reason"] = f"bound to preregistration {bound}, not this one"
        if states[path] != "sealed":
            entry["accepted"] = False
            entry["excluded_reason"] = states[path] + " (never published as complete)"
        elif torn:
            entry["accepted"] = False
            entry["excluded_reason"] = f"torn last line ({len(torn)} bytes)"
        raw_files.append(entry)
    evidence_dir = output_dir / "conformance"
    evidence_paths = sorted(evidence_dir.glob("*.json"))
    evidence_states, evidence_digests, evidence_problems = (
        _verify_sealed(evidence_dir, evidence_paths, "evidence file") if evidence_dir.exists() else ({}, {}, []))
    problems += evidence_problems
    # every file's seal is checked; a file whose name gives it to another campaign is not this one's
    raw_root = output_dir / "raw"
    known = {p.name for p in raw_root.iterdir() if p.is_dir()} if raw_root.is_dir() else set()
    campaigns = sorted(known | {campaign})
    evidence = []
    for path in evidence_paths:
        if path not in evidence_states or evidence_campaign(path, campaigns) not in (None, campaign):
            continue
        try:
            report = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            problems.append(f"{_rel(path)}: not valid JSON ({exc})")
            continue
        binding = binding_label(study, report.get("preregistration_sha256"),
                                (report.get("preregistration") or {}).get("calculator_pin"))
        evidence.append({"path": _rel(path), "sha256": evidence_digests.get(path) or sha256_file(path),
                         "kind": report.get("kind", "unknown"),
                         "backend": report.get("backend", report.get("candidate")),
                         "accepted": binding is not None and evidence_states[path] == "sealed",
                         "verdict": report.get("verdict", {})})
    if problems:
        raise EvidenceRefused(f"{len(problems)} evidence problem(s), nothing computed:\n  " + "\n  ".join(problems))
    return {"raw_files": raw_files, "evidence": evidence}


def derive(study: Preregistration, campaign: str, output_dir: Path) -> tuple[bytes, dict[str, Any]]:
    calculator, calculator_sha = verified_calculator(study)
    prereg = yaml.safe_load(Path(study.source_path).read_text())
    inputs = collect_inputs(study, campaign, output_dir)
    aggregate = calculator.compute_aggregate(prereg, campaign=campaign, preregistration_sha256=study.sha256,
                                             calculator_sha256=calculator_sha, **inputs)
    return canonical_json_bytes(aggregate), aggregate


def campaign_cells(study: Preregistration, campaign: str, output_dir: Path = OUTPUTS_DIR
                   ) -> dict[str, dict[str, list[str]]]:
    """Per backend: cells `valid`, `invalid`, `missing` and `to_measure` (invalid + missing, in workload
    order), by the frozen calculator's own definition: the same derive as publish, so `missing` and
    the report always agree."""
    _, aggregate = derive(study, campaign, Path(output_dir))
    order = Workload(study).cell_ids()
    out = {}
    for backend in sorted(aggregate["missing_cells"]):
        invalid, missing = aggregate["invalid_cells"][backend], aggregate["missing_cells"][backend]
        valid = [c["cell_id"] for c in aggregate["cells"] if c["backend"] == backend and c["valid"]]
        out[backend] = {"valid": valid, "invalid": invalid, "missing": missing,
                        "to_measure": [c for c in order if c in set(invalid) | set(missing)]}
    return out


def aggregate_path(output_dir: Path, campaign: str) -> Path:
    return output_dir / "aggregate" / f"{campaign}.json"


def publish(study: Preregistration, campaign: str, output_dir: Path = OUTPUTS_DIR) -> Path:
    path = aggregate_path(output_dir, campaign)
    with exclusive(path, what=f"publish of campaign {campaign}"):  # one publisher per campaign
        data, _ = derive(study, campaign, output_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # derived, re-derivable: replaced as raw evidence grows
    return path


def check(study: Preregistration, campaign: str, output_dir: Path = OUTPUTS_DIR) -> None:
    """Re-derive the aggregate and compare byte for byte; every refusal says what differs and where."""
    path = aggregate_path(output_dir, campaign)
    if not path.exists():
        raise PublishCheckFailed(f"{_rel(path)} does not exist: publish first")
    stored_bytes = path.read_bytes()
    try:
        stored = json.loads(stored_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PublishCheckFailed(f"{_rel(path)} is not valid JSON ({exc}): it was truncated or edited; "
                                 "publish again") from None
    if not isinstance(stored, dict):
        raise PublishCheckFailed(f"{_rel(path)} is not an aggregate (a JSON object)")
    verified_calculator(study)
    if stored.get("calculator_sha256") != study.calculator.sha256:
        raise PublishCheckFailed(f"{_rel(path)} was made by calculator {stored.get('calculator_sha256')}, "
                                 f"the preregistration pins {study.calculator.sha256}")
    derived, _ = derive(study, campaign, output_dir)  # refuses tampered, missing or unsealed raw files first
    fresh = json.loads(derived)
    now = {e["path"]: e["sha256"] for e in fresh.get("raw_files", []) + fresh.get("evidence_files", [])}
    problems = []
    for entry in stored.get("raw_files", []) + stored.get("evidence_files", []):
        if entry.get("path") not in now:
            problems.append(f"{entry.get('path')}: listed in {_rel(path)} but no longer an input")
        elif now[entry["path"]] != entry.get("sha256"):
            problems.append(f"{entry['path']}: {_rel(path)} records sha256 {entry.get('sha256')}, the file and its "
                            f"seal have {now[entry['path']]}: the aggregate was edited or is stale (publish again)")
    if problems:
        raise PublishCheckFailed("the aggregate's file records disagree with the sealed files:\n  "
                                 + "\n  ".join(problems))
    if derived != stored_bytes:
        if fresh == stored:
            raise PublishCheckFailed(f"{_rel(path)} has the same content as the re-derived aggregate but not its "
                                     "canonical bytes (it was reformatted): publish again")
        new = json.dumps(fresh, indent=1, sort_keys=True).splitlines()
        old = json.dumps(stored, indent=1, sort_keys=True).splitlines()
        diff = "\n".join(list(difflib.unified_diff(old, new, "aggregate (stored)", "aggregate (re-derived)",
                                                   lineterm=""))[:80])
        raise PublishCheckFailed(f"{_rel(path)} does not re-derive byte for byte:\n{diff}")
