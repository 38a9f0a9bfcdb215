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

from rollout_lib.core import OUTPUTS_DIR, REPO_ROOT, canonical_json_bytes, sha256_bytes
from rollout_lib.evidence.admission import (
    ALLOWLIST_PATH,
    after_the_fact_entry,
    after_the_fact_exclusion,
    allowlist_binding,
    load_allowlist,
    record_problem,
)
from rollout_lib.measure.rawfile import (
    RawFileError,
    SealError,
    exclusive,
    live_holder,
    manifest_path,
    parse_raw,
    read_raw,
    read_seals,
)
from rollout_lib.safe_read import UnsafeInput, is_regular, loads_json, read_bytes, read_json, read_text
from rollout_lib.safe_write import write_bytes_atomic
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
    actual = sha256_bytes(read_bytes(path, kind="calculator"))
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
    text = read_text(study.source_path, kind="preregistration")
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
                   ) -> tuple[dict[Path, str], dict[Path, bytes], list[str], dict[str, dict[str, Any]]]:
    """Seal state of each file (`sealed` or `in progress: ...`), the bytes of each sealed file (read
    once, through safe_read: a regular file inside `folder`, within its size limit), the refusals,
    each naming the file and the expected and found hashes, and the seal entries."""
    try:
        seals = read_seals(folder)
    except (SealError, RawFileError) as exc:
        return {}, {}, [str(exc)], {}
    kind = "raw" if what == "raw file" else "evidence"
    states, contents, problems = {}, {}, []
    present = set()
    for path in files:
        relative = path.relative_to(folder).as_posix()
        present.add(relative)
        seal = seals.get(relative)
        if seal is not None:
            try:
                data = read_bytes(path, kind=kind, root=folder)
            except (UnsafeInput, OSError) as exc:
                problems.append(f"{_rel(path)}: {exc}")
                continue
            found = sha256_bytes(data)
            if found != seal["sha256"]:
                problems.append(f"{_rel(path)}: sealed with sha256 {seal['sha256']}, found {found}: the {what} "
                                "changed after its run ended")
            else:
                states[path], contents[path] = "sealed", data
            continue
        if not is_regular(path):
            problems.append(f"{_rel(path)}: not a regular file (a symlink, FIFO, device or socket); only regular "
                            f"files are evidence")
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
    return states, contents, problems, seals


class EvidenceRefused(RuntimeError):
    """Raw or evidence files fail their seals or identity: nothing is computed from them."""


def read_sealed_raw(folder: Path, allowlist: dict[str, dict[str, str]] | None = None
                    ) -> tuple[list[tuple[Path, list[dict[str, Any]], bytes, str, str | None]], list[str],
                               dict[Path, str], list[dict[str, Any]]]:
    """The raw files `<folder>/<backend>/*.jsonl` whose seal holds or whose writer is live:
    (path, records, torn bytes, state, sha256), every refusal (tampered, missing, unsealed,
    unreadable), each naming the file, then the files not admitted with the reason (a record that
    breaks a number rule, or an after-the-fact seal not in the allowlist), and the after-the-fact rows."""
    paths = sorted(folder.glob("*/*.jsonl")) if folder.is_dir() else []
    states, contents, problems, seals = _verify_sealed(folder, paths, "raw file") if folder.is_dir() \
        else ({}, {}, [], {})
    out, excluded, after = [], {}, []
    for path in paths:
        if path not in states:
            continue
        try:
            data = contents.get(path)
            records, torn = parse_raw(data, path) if data is not None else read_raw(path, root=folder)
        except RawFileError as exc:
            problems.append(str(exc))
            continue
        digest = sha256_bytes(data) if data is not None else None
        out.append((path, records, torn, states[path], digest))
        problem = record_problem(records)
        if problem:
            excluded[path] = f"invalid record: {problem}"
        seal = seals.get(path.relative_to(folder).as_posix())
        if seal is not None and seal.get("ended") == "after_the_fact":
            row = after_the_fact_entry(_rel(path), seal, allowlist or {})
            after.append(row)
            if not row["allowlisted"]:
                excluded.setdefault(path, after_the_fact_exclusion(row))
    return out, problems, excluded, after


def evidence_campaign(path: Path, campaigns: list[str]) -> str | None:
    """The campaign an evidence file's name gives it to (`<kind>-<campaign>[-...].json`, one of
    `campaigns`; the longest if several match), or None: shared by every campaign of the output dir."""
    named = [c for c in campaigns if re.search(rf"(^|-){re.escape(c)}(-|$)", path.stem)]
    return max(named, key=len) if named else None


def collect_inputs(study: Preregistration, campaign: str, output_dir: Path,
                   allowlist: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """The calculator's inputs (raw files and evidence, each admitted or excluded with its reason); the
    allowlist defaults to params/evidence-allowlist.yaml."""
    if allowlist is None:
        allowlist, _ = load_allowlist(ALLOWLIST_PATH)
    return collect_admitted_inputs(study, campaign, output_dir, allowlist)[0]


def collect_admitted_inputs(study: Preregistration, campaign: str, output_dir: Path,
                            allowlist: dict[str, dict[str, str]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The calculator's inputs (raw files and evidence, each admitted or excluded with its reason) and
    the after-the-fact rows of the aggregate."""
    raw_dir = output_dir / "raw" / campaign
    files, problems, excluded, after = read_sealed_raw(raw_dir, allowlist)
    states = {path: state for path, _, _, state, _ in files}
    raw_files = []
    for path, records, torn, _, digest in files:
        header = records[0] if records else {}
        for key, expected in (("campaign", campaign), ("backend", path.parent.name), ("run_id", path.stem)):
            if header.get(key) != expected and states[path] == "sealed":  # in-progress files are not used
                problems.append(f"{_rel(path)}: header {key} is {header.get(key)!r}, its place says {expected!r}")
        environment = header.get("environment") if isinstance(header.get("environment"), dict) else {}
        prereg_meta = header.get("preregistration") if isinstance(header.get("preregistration"), dict) else {}
        bound = environment.get("preregistration_sha256")
        binding = binding_label(study, bound, prereg_meta.get("calculator_pin"))
        entry = {"path": _rel(path), "sha256": digest or _sha_of(path, "raw", raw_dir), "backend": path.parent.name,
                 "run_id": path.stem, "records": records, "accepted": binding is not None, "binding": binding}
        if binding is None:
            entry["excluded_reason"] = f"bound to preregistration {bound}, not this one"
        if states[path] != "sealed":
            entry["accepted"] = False
            entry["excluded_reason"] = states[path] + " (never published as complete)"
        elif torn:
            entry["accepted"] = False
            entry["excluded_reason"] = f"torn last line ({len(torn)} bytes)"
        elif path in excluded and binding is not None:
            entry["accepted"] = False
            entry["excluded_reason"] = excluded[path]
        raw_files.append(entry)
    evidence_dir = output_dir / "conformance"
    evidence_paths = sorted(evidence_dir.glob("*.json")) if evidence_dir.is_dir() else []
    evidence_states, evidence_contents, evidence_problems, evidence_seals = (
        _verify_sealed(evidence_dir, evidence_paths, "evidence file") if evidence_dir.is_dir() else ({}, {}, [], {}))
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
            data = evidence_contents.get(path)
            report = loads_json(data, _rel(path)) if data is not None else \
                read_json(path, kind="evidence", root=evidence_dir)
        except (UnsafeInput, OSError) as exc:
            problems.append(f"{_rel(path)}: {exc}")
            continue
        if not isinstance(report, dict):
            problems.append(f"{_rel(path)}: not an evidence report (a JSON object)")
            continue
        prereg_meta = report.get("preregistration") if isinstance(report.get("preregistration"), dict) else {}
        binding = binding_label(study, report.get("preregistration_sha256"), prereg_meta.get("calculator_pin"))
        accepted = binding is not None and evidence_states[path] == "sealed"
        verdict = report.get("verdict", {})
        problem = record_problem([report]) or (None if isinstance(verdict, dict) else
                                                f"verdict = {verdict!r} must be a JSON object")
        if problem:
            accepted = False
        seal = evidence_seals.get(path.relative_to(evidence_dir).as_posix())
        if seal is not None and seal.get("ended") == "after_the_fact":
            row = after_the_fact_entry(_rel(path), seal, allowlist or {})
            after.append(row)
            accepted = accepted and row["allowlisted"]
        evidence.append({"path": _rel(path), "sha256": sha256_bytes(data) if data is not None else
                         _sha_of(path, "evidence", evidence_dir),
                         "kind": report.get("kind", "unknown"),
                         "backend": report.get("backend", report.get("candidate")),
                         "accepted": accepted, "verdict": verdict if isinstance(verdict, dict) else {}})
    if problems:
        raise EvidenceRefused(f"{len(problems)} evidence problem(s), nothing computed:\n  " + "\n  ".join(problems))
    return {"raw_files": raw_files, "evidence": evidence}, sorted(after, key=lambda r: r["file"])


def _sha_of(path: Path, kind: str, root: Path) -> str:
    return sha256_bytes(read_bytes(path, kind=kind, root=root))


class NoRawFiles(ValueError):
    """Publish was asked for a campaign without one raw file: bad input, nothing is written."""


def derive(study: Preregistration, campaign: str, output_dir: Path,
           allowlist_path: Path | None = None) -> tuple[bytes, dict[str, Any]]:
    calculator, calculator_sha = verified_calculator(study)
    prereg = yaml.safe_load(read_text(study.source_path, kind="preregistration"))
    allowlist_path = ALLOWLIST_PATH if allowlist_path is None else allowlist_path
    allowlist, allowlist_sha = load_allowlist(allowlist_path)
    inputs, after = collect_admitted_inputs(study, campaign, output_dir, allowlist)
    aggregate = calculator.compute_aggregate(prereg, campaign=campaign, preregistration_sha256=study.sha256,
                                             calculator_sha256=calculator_sha, **inputs)
    # beside the frozen calculator's output: which inputs were sealed by hand, and under which allowlist
    aggregate["sealed_after_the_fact"] = after
    aggregate["evidence_allowlist"] = allowlist_binding(after, allowlist_sha, allowlist_path)
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


def publish_lock_target(output_dir: Path, name: str) -> Path:
    """Where a publisher's lock lives: `<output-dir>/.locks/`, never inside a committed evidence folder."""
    return output_dir / ".locks" / name


def require_raw_files(raw_dir: Path, campaign: str) -> None:
    if not raw_dir.is_dir() or not any(raw_dir.glob("*/*.jsonl")):
        raise NoRawFiles(f"campaign: {campaign!r} has no raw files under {_rel(raw_dir)}; publish needs at least one "
                         "(measure first); nothing written")


def publish(study: Preregistration, campaign: str, output_dir: Path = OUTPUTS_DIR,
            allowlist_path: Path | None = None) -> Path:
    path = aggregate_path(output_dir, campaign)
    require_raw_files(output_dir / "raw" / campaign, campaign)
    lock = publish_lock_target(output_dir, f"publish-{campaign}")
    with exclusive(lock, what=f"publish of campaign {campaign}"):  # one publisher per campaign
        data, _ = derive(study, campaign, output_dir, allowlist_path)
        write_bytes_atomic(path, data)  # derived, re-derivable: replaced as raw evidence grows
    return path


def check(study: Preregistration, campaign: str, output_dir: Path = OUTPUTS_DIR,
          allowlist_path: Path | None = None) -> None:
    """Re-derive the aggregate and compare byte for byte; every refusal says what differs and where."""
    path = aggregate_path(output_dir, campaign)
    if not path.exists():
        raise PublishCheckFailed(f"{_rel(path)} does not exist: publish first")
    try:
        stored_bytes = read_bytes(path, kind="aggregate", root=output_dir)
    except UnsafeInput as exc:
        raise PublishCheckFailed(str(exc)) from None
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
    # refuses tampered, missing or unsealed raw files first
    derived, _ = derive(study, campaign, output_dir, allowlist_path)
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
