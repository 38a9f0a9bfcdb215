"""The foundation every layer may import (standard library only): repository paths, canonical JSON,
SHA-256 helpers and atomic evidence writes.

Evidence is bound to bytes: every JSON this project writes goes through `canonical_json`, so the
same content always has the same SHA-256 (sorted keys, no whitespace, shortest round-trip float
text, UTF-8, no NaN/Infinity).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
OUTPUTS_DIR = REPO_ROOT / "outputs"



class CanonicalJSONError(ValueError):
    """A value cannot be written as canonical JSON (NaN, Infinity, or a non-JSON type)."""


def _check_json_value(value: Any, path: str) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CanonicalJSONError(f"{path or '<root>'}: {value!r} is not allowed in evidence JSON "
                                     "(NaN/Infinity have no canonical text; use a status field instead)")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CanonicalJSONError(f"{path or '<root>'}: dict key {key!r} must be a string")
            _check_json_value(item, f"{path}.{key}" if path else key)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_json_value(item, f"{path}[{index}]")
        return
    raise CanonicalJSONError(f"{path or '<root>'}: type {type(value).__name__} is not JSON "
                             "(convert it explicitly before writing evidence)")


def canonical_json(value: Any) -> str:
    """Canonical text of a JSON value: sorted keys, compact separators, shortest float repr."""
    _check_json_value(value, "")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json_bytes(value: Any) -> bytes:
    return (canonical_json(value) + "\n").encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomic(path: str | os.PathLike[str], value: Any, *, overwrite: bool = False) -> str:
    """Write canonical JSON via temp file + fsync + rename; returns the file's SHA-256.

    Evidence is append-only: refuses to replace an existing file unless `overwrite` is set.
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; evidence files are never rewritten (choose a new run id)")
    target.parent.mkdir(parents=True, exist_ok=True)
    data = canonical_json_bytes(value)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:  # a full disk or an interrupt leaves no partial file beside the previous output
        tmp.unlink(missing_ok=True)
        raise
    return sha256_bytes(data)


def build_directory_once(out: str | os.PathLike[str], build: Callable[[Path], Any]) -> bool:
    """Build the cache directory `out` safely under concurrent builders (two GPU shards, say).

    `build(tmp)` fills a unique temporary sibling; one atomic rename publishes it. If another builder
    renamed first, its directory is kept and this one's is removed. Returns True when this call's
    build was published. A reader never sees a half-built `out`.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        build(tmp)
        try:
            os.rename(tmp, out)
            return True
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and out.is_dir():
                return False  # another builder won the race; both built the same bytes
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
