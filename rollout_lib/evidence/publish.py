"""Publish a campaign's aggregate, or check that it re-derives byte for byte.

    rollout publish --campaign h200-v1                  # writes outputs/aggregate/h200-v1.json
    rollout check --campaign h200-v1                    # re-derives and compares

Before anything is computed, the calculator file's SHA-256 must equal the preregistration's pin
(`calculator.sha256`); a placeholder or a different file is refused. `--check` also refuses a raw
or evidence file whose SHA-256 differs from the aggregate's record, and prints a readable diff.

Raw files are accepted when bound to this preregistration. A file bound to the same
preregistration text before the calculator was pinned (the `sha256:` line then read `pending`) is
accepted too and labelled `pre-pin`: every measurement-relevant byte was the same.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
from pathlib import Path
from typing import Any

import yaml

from rollout_lib.core import OUTPUTS_DIR, REPO_ROOT, canonical_json_bytes, sha256_bytes, sha256_file
from rollout_lib.measure.runner import read_raw
from rollout_lib.study.prereg import CALCULATOR_PENDING, Preregistration


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


def accepted_bindings(study: Preregistration) -> dict[str, str]:
    """Preregistration hashes a raw file may be bound to -> label."""
    out = {study.sha256: "pinned"}
    text = Path(study.source_path).read_text()
    line = f"sha256: {study.calculator.sha256}"
    if study.calculator.sha256 != CALCULATOR_PENDING and text.count(line) == 1:
        out[sha256_bytes(text.replace(line, f"sha256: {CALCULATOR_PENDING}").encode())] = "pre-pin"
    return out


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def collect_inputs(study: Preregistration, campaign: str, output_dir: Path) -> dict[str, Any]:
    bindings = accepted_bindings(study)
    raw_files = []
    for path in sorted((output_dir / "raw" / campaign).glob("*/*.jsonl")):
        records, torn = read_raw(path)
        header = records[0] if records else {}
        bound = header.get("environment", {}).get("preregistration_sha256")
        entry = {"path": _rel(path), "sha256": sha256_file(path), "backend": header.get("backend", path.parent.name),
                 "run_id": header.get("run_id", path.stem), "records": records, "accepted": bound in bindings,
                 "binding": bindings.get(bound)}
        if not entry["accepted"]:
            entry["excluded_reason"] = f"bound to preregistration {bound}, not this one"
        if torn:
            entry["accepted"] = False
            entry["excluded_reason"] = f"torn last line ({len(torn)} bytes): resume the run to repair it"
        raw_files.append(entry)
    evidence = []
    for path in sorted((output_dir / "conformance").glob("*.json")):
        report = json.loads(path.read_text())
        evidence.append({"path": _rel(path), "sha256": sha256_file(path), "kind": report.get("kind", "unknown"),
                         "backend": report.get("backend", report.get("candidate")),
                         "accepted": report.get("preregistration_sha256") in bindings,
                         "verdict": report.get("verdict", {})})
    return {"raw_files": raw_files, "evidence": evidence}


def derive(study: Preregistration, campaign: str, output_dir: Path) -> tuple[bytes, dict[str, Any]]:
    calculator, calculator_sha = verified_calculator(study)
    prereg = yaml.safe_load(Path(study.source_path).read_text())
    inputs = collect_inputs(study, campaign, output_dir)
    aggregate = calculator.compute_aggregate(prereg, campaign=campaign, preregistration_sha256=study.sha256,
                                             calculator_sha256=calculator_sha, **inputs)
    return canonical_json_bytes(aggregate), aggregate


def aggregate_path(output_dir: Path, campaign: str) -> Path:
    return output_dir / "aggregate" / f"{campaign}.json"


def publish(study: Preregistration, campaign: str, output_dir: Path = OUTPUTS_DIR) -> Path:
    data, _ = derive(study, campaign, output_dir)
    path = aggregate_path(output_dir, campaign)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # derived, re-derivable: replaced as raw evidence grows
    return path


def check(study: Preregistration, campaign: str, output_dir: Path = OUTPUTS_DIR) -> None:
    path = aggregate_path(output_dir, campaign)
    if not path.exists():
        raise PublishCheckFailed(f"{path} does not exist: publish first")
    stored_bytes = path.read_bytes()
    stored = json.loads(stored_bytes)
    verified_calculator(study)
    if stored.get("calculator_sha256") != study.calculator.sha256:
        raise PublishCheckFailed(f"aggregate was made by calculator {stored.get('calculator_sha256')}, "
                                 f"the preregistration pins {study.calculator.sha256}")
    problems = []
    for entry in stored.get("raw_files", []) + stored.get("evidence_files", []):
        file = REPO_ROOT / entry["path"] if not Path(entry["path"]).is_absolute() else Path(entry["path"])
        if not file.exists():
            problems.append(f"{entry['path']}: listed in the aggregate but missing")
        elif sha256_file(file) != entry["sha256"]:
            problems.append(f"{entry['path']}: sha256 {sha256_file(file)}, the aggregate records {entry['sha256']}")
    if problems:
        raise PublishCheckFailed("evidence files changed:\n  " + "\n  ".join(problems))
    derived, _ = derive(study, campaign, output_dir)
    if derived != stored_bytes:
        new = json.dumps(json.loads(derived), indent=1, sort_keys=True).splitlines()
        old = json.dumps(stored, indent=1, sort_keys=True).splitlines()
        diff = "\n".join(list(difflib.unified_diff(old, new, "aggregate (stored)", "aggregate (re-derived)",
                                                   lineterm=""))[:80])
        raise PublishCheckFailed(f"{path} does not re-derive byte for byte:\n{diff}")
