"""What a sealed file must satisfy before the frozen calculators see it.

Two rules, applied by publish (raw and evidence files) and cycle-publish (cycle raw files):

1. **Every number is valid before arithmetic.** The calculators are frozen and trust their records,
   so the loader checks each record first: times (`wall_s`) finite and > 0 (at least MIN_WALL_S); other seconds
   (`seconds`, `*_s`) finite and >= 0; token counts (`*_tokens`) and memory (`*_bytes`) integers
   >= 0; no NaN or Infinity anywhere; the fields the calculator indexes present with their types.
   The first record that breaks a rule makes its file not accepted, with the reason named
   (record number, field, value); the calculator then lists the file as excluded with that reason.
2. **After-the-fact evidence is marked and cannot decide a gate unless allowlisted.** A file sealed
   with `rollout seal --after-the-fact` (seal `ended: after_the_fact`) was sealed by hand, not by the
   run that wrote it: its bytes were never seen by a writer of this project. It is listed in the
   aggregate under `sealed_after_the_fact` (file, sha256, when, why) and counts toward a gate only
   when `params/evidence-allowlist.yaml` names its SHA-256 with a reason. The allowlist is its own
   file (never a frozen preregistration) and its SHA-256 is bound into every aggregate that uses it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rollout_lib.core import REPO_ROOT, sha256_bytes
from rollout_lib.safe_read import UnsafeInput, read_bytes

ALLOWLIST_PATH = REPO_ROOT / "params" / "evidence-allowlist.yaml"
_HEX = set("0123456789abcdef")
# No repetition runs in less than a nanosecond (below any clock's resolution): a smaller wall time
# (1e-300) is a unit error or a fabricated record, and would make a rate without bound.
MIN_WALL_S = 1e-9


class AllowlistError(ValueError):
    """The evidence allowlist is malformed."""


# ------------------------------------------------------------------------------------------
# Numbers
# ------------------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _field_problem(key: str, value: Any) -> str | None:
    """Why `value` is not allowed under the field name `key`, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be finite"
    if value is None:
        return None
    if key == "wall_s":
        if not _is_number(value) or not value >= MIN_WALL_S:
            return f"must be a finite number > 0 (seconds; at least {MIN_WALL_S:g})"
    elif key == "seconds" or key.endswith("_s"):
        if not _is_number(value) or value < 0:
            return "must be a finite number >= 0 (seconds)"
    elif key.endswith("_bytes"):
        if not _is_int(value) or value < 0:
            return "must be an integer >= 0 (bytes)"
    elif (key.endswith("_tokens") or key == "tokens") and (not _is_int(value) or value < 0):
        return "must be an integer >= 0 (tokens)"
    return None


def _walk(value: Any, path: str) -> tuple[str, Any, str] | None:
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if not isinstance(item, (dict, list)):
                problem = _field_problem(str(key), item)
                if problem:
                    return where, item, problem
            found = _walk(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, float) and not math.isfinite(item):
                return f"{path}[{index}]", item, "must be finite"
            found = _walk(item, f"{path}[{index}]")
            if found:
                return found
    return None


_STRUCTURE: dict[str, tuple[tuple[str, Any, str], ...]] = {
    "cell_start": (("cell_id", str, "a string"), ("attempt", int, "an integer >= 0")),
    "repetition": (("cell_id", str, "a string"), ("attempt", int, "an integer >= 0"),
                   ("repetition", int, "an integer >= 0"), ("warmup", bool, "true or false"),
                   ("valid", bool, "true or false")),
    "cell_complete": (("cell_id", str, "a string"), ("attempt", int, "an integer >= 0"), ("status", str, "a string")),
    "cell_suspended": (("cell_id", str, "a string"), ("attempt", int, "an integer >= 0")),
    "cycle": (("cycle", int, "an integer >= 0"),),
}


def _structure_problem(record: dict[str, Any]) -> tuple[str, Any, str] | None:
    for key, kind, text in _STRUCTURE.get(record.get("record"), ()):
        value = record.get(key)
        ok = isinstance(value, bool) if kind is bool else (
            _is_int(value) and value >= 0 if kind is int else isinstance(value, kind))
        if not ok:
            return key, value, f"must be {text}"
    if record.get("record") == "repetition" and not record.get("valid", True) \
            and not isinstance(record.get("invalid_reasons"), list):
        return "invalid_reasons", record.get("invalid_reasons"), "must be a list when valid is false"
    return None


def record_problem(records: list[dict[str, Any]]) -> str | None:
    """The first rule a file's records break, named (record number, field, value), or None."""
    for number, record in enumerate(records, start=1):
        found = _structure_problem(record) or _walk(record, "")
        if found:
            field, value, problem = found
            shown = repr(value)
            shown = shown if len(shown) <= 40 else shown[:40] + "..."
            return f"record {number} ({record.get('record', '?')}): {field} = {shown} {problem}"
    return None


# ------------------------------------------------------------------------------------------
# The allowlist
# ------------------------------------------------------------------------------------------

def load_allowlist(path: Path = ALLOWLIST_PATH) -> tuple[dict[str, dict[str, str]], str | None]:
    """sha256 -> {file, reason}, and the allowlist file's SHA-256 (None when there is no file)."""
    from rollout_lib.study.strict import StrictLoadError, load_yaml

    if not Path(path).exists():
        return {}, None
    try:
        data = read_bytes(path, kind="allowlist")
        document = load_yaml(data.decode("utf-8"))
    except (UnsafeInput, StrictLoadError, UnicodeDecodeError) as exc:
        raise AllowlistError(f"evidence allowlist {path}: {exc}") from None
    except Exception as exc:  # yaml errors
        raise AllowlistError(f"evidence allowlist {path}: not valid YAML ({exc})") from None
    if not isinstance(document, dict) or document.get("allowlist_version") != 1 \
            or not isinstance(document.get("entries"), list) or set(document) != {"allowlist_version", "entries"}:
        raise AllowlistError(f"evidence allowlist {path}: must be a mapping with exactly allowlist_version: 1 and "
                             "entries: a list")
    out: dict[str, dict[str, str]] = {}
    for index, entry in enumerate(document["entries"]):
        where = f"evidence allowlist {path}: entries[{index}]"
        if not isinstance(entry, dict) or set(entry) != {"sha256", "file", "reason"}:
            raise AllowlistError(f"{where}: must have exactly the keys sha256, file, reason")
        sha, reason = entry["sha256"], entry["reason"]
        if not isinstance(sha, str) or len(sha) != 64 or not set(sha) <= _HEX:
            raise AllowlistError(f"{where}.sha256: {sha!r} is not a lowercase hex SHA-256 (64 characters)")
        if not isinstance(reason, str) or len(reason.strip()) < 10:
            raise AllowlistError(f"{where}.reason: say why this file may decide a gate (10 characters at least)")
        if not isinstance(entry["file"], str):
            raise AllowlistError(f"{where}.file: must be a string (the file's path, for the reader)")
        if sha in out:
            raise AllowlistError(f"{where}.sha256: {sha} is listed twice")
        out[sha] = {"file": entry["file"], "reason": reason}
    return out, sha256_bytes(data)


def after_the_fact_entry(file: str, seal: dict[str, Any], allowlist: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The aggregate's `sealed_after_the_fact` row of a file whose seal ended `after_the_fact`."""
    listed = allowlist.get(seal["sha256"])
    return {"file": file, "sha256": seal["sha256"], "sealed_at": seal.get("utc"), "reason": seal.get("reason"),
            "allowlisted": listed is not None, "allowlist_reason": listed["reason"] if listed else None}


def after_the_fact_exclusion(row: dict[str, Any]) -> str:
    return (f"sealed after the fact ({row['sealed_at']}: {row['reason']}) and not named by SHA-256 in the evidence "
            f"allowlist ({ALLOWLIST_PATH.relative_to(REPO_ROOT).as_posix()}): such a file cannot decide a gate")


def allowlist_binding(rows: list[dict[str, Any]], allowlist_sha: str | None,
                      path: Path = ALLOWLIST_PATH) -> dict[str, Any]:
    """How the aggregate is bound to the allowlist: its SHA-256 when a file of the campaign was sealed
    after the fact (the allowlist decided something), else not_applicable (editing the allowlist for
    another campaign does not change this one's aggregate)."""
    if not rows:
        return {"status": "not_applicable", "reason": "no input of this campaign was sealed after the fact"}
    try:
        shown = Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        shown = str(path)
    if allowlist_sha is None:
        return {"status": "absent", "path": shown, "sha256": None}
    return {"status": "bound", "path": shown, "sha256": allowlist_sha}
