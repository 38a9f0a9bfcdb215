"""Raw evidence files: one writer each, crash-safe appends, and an append-only seal manifest.

- **One writer.** `RawWriter` takes an exclusive `flock` on the file's lock (`<output-dir>/.locks/...`,
  see `lock_path`) before it reads, repairs or
  appends; a second writer (a concurrent run, or a resume racing a live run) is refused at once with
  the holder's pid, host and start time. The kernel drops the lock when the holder dies, even on
  kill -9, so a crashed run never blocks its own resume.
- **Crash-safe lines.** Each record is one canonical-JSON line, flushed and fsynced. A torn last line
  (crash mid-write) is moved to a `.torn-N` sidecar on resume, never silently dropped.
- **Seals.** When a run ends (teardown recorded) the file's SHA-256 goes into `SEALS.jsonl` beside
  the campaign's backend folders: one canonical-JSON line per sealed file, appended under a lock,
  fsynced. A sealed file is final: resuming it is refused, and publish refuses a sealed file whose
  bytes differ, a sealed file that is missing, and a raw file with neither a seal nor a live writer.
  Evidence JSON files (conformance, refresh) are sealed the same way in their own folder.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout_lib.core import canonical_json, sha256_bytes
from rollout_lib.safe_read import UnsafeInput, is_regular, read_bytes
from rollout_lib.safe_write import write_fully

SEAL_MANIFEST = "SEALS.jsonl"
SEAL_ENDINGS = ("teardown", "complete", "abandoned", "after_the_fact")
CHAIN_VERSION = 1
CHAIN_GENESIS = "0" * 64  # the previous-line hash of a manifest's first line


class RawFileError(ValueError):
    """A raw file cannot be read as this project's raw file (not a torn tail: damage in the middle)."""


class WriterBusy(RuntimeError):
    """Another live process holds the writer lock of this file."""


class RawSealed(RuntimeError):
    """The run ended and its file is sealed: it is never appended to again."""


class SealError(RuntimeError):
    """The seal manifest is malformed or contradicts itself."""


def _utc() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def read_raw(path: str | Path, *, kind: str = "raw", root: str | Path | None = None
             ) -> tuple[list[dict[str, Any]], bytes]:
    """Complete records of a raw file, and the bytes of a torn last line (b'' if none).

    Read through `safe_read` (a regular file, inside `root` when given, within the kind's size limit);
    an unsafe file raises RawFileError naming why."""
    try:
        data = read_bytes(path, kind=kind, root=root)
    except UnsafeInput as exc:
        raise RawFileError(str(exc)) from None
    return parse_raw(data, path)


def parse_raw(data: bytes, path: str | Path) -> tuple[list[dict[str, Any]], bytes]:
    """`read_raw` on bytes already read (and hashed) by the caller."""
    end = data.rfind(b"\n") + 1
    records = []
    for number, line in enumerate(data[:end].splitlines(), start=1):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise RawFileError(f"{path}: line {number} is not JSON ({type(exc).__name__}: {exc}); only a torn "
                               "last line is repairable: this file was damaged or edited") from None
        if not isinstance(record, dict):
            raise RawFileError(f"{path}: line {number} is not a JSON object")
        records.append(record)
    return records, data[end:]


# ------------------------------------------------------------------------------------------
# Locks
# ------------------------------------------------------------------------------------------

def lock_path(target: Path) -> Path:
    """Where the writer's lock of `target` lives: outside the committed evidence folders (issue 40), in
    `<output-dir>/.locks/` mirroring the target's path, for a target in a raw or conformance tree
    (`<output-dir>/raw/...`, `<output-dir>/cycles/raw/...`, `<output-dir>/conformance/...`); beside the
    target (`<target>.lock`) for any other file. On the output tree, so writers on several nodes of a shared
    filesystem see the same lock."""
    target = Path(target)
    for tree in target.parents:
        if tree.name in ("raw", "conformance"):
            root = tree.parent.parent if tree.name == "raw" and tree.parent.name == "cycles" else tree.parent
            return root / ".locks" / target.relative_to(root).parent / (target.name + ".lock")
    return target.with_name(target.name + ".lock")


class FileLock:
    """Exclusive, non-blocking `flock` on `<target>.lock`, with the holder written inside it."""

    def __init__(self, target: str | Path, *, what: str = "file"):
        self.target = Path(target)
        self.path = lock_path(self.target)
        self.what = what
        self._fd: int | None = None

    def acquire(self, *, blocking: bool = False) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise WriterBusy(f"{self.target} is being written by pid {holder.get('pid', '?')} on host "
                             f"{holder.get('host', '?')} (since {holder.get('utc', '?')}): a second "
                             f"{self.what} writer is refused") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "utc": _utc()},
                                  sort_keys=True) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


def live_holder(target: str | Path) -> dict[str, Any] | None:
    """The holder of `<target>.lock` if a live process holds it, else None."""
    path = lock_path(Path(target))
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _read_holder(fd) or {"pid": "?", "host": "?"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------
# Seals
# ------------------------------------------------------------------------------------------

def manifest_path(folder: str | Path) -> Path:
    return Path(folder) / SEAL_MANIFEST


def _manifest_lines(path: Path) -> list[bytes]:
    """The manifest's complete lines (each with its newline); a torn last line is damage."""
    try:
        data = read_bytes(path, kind="seal_manifest")
    except UnsafeInput as exc:
        raise SealError(str(exc)) from None
    end = data.rfind(b"\n") + 1
    if data[end:]:
        raise SealError(f"{path}: torn last line ({len(data) - end} bytes): the manifest is append-only and "
                        "fsynced; this is damage, not a crash")
    return data[:end].splitlines(keepends=True)


def _verify_chain(path: Path, lines: list[bytes], entries: list[dict[str, Any]]) -> None:
    """The hash chain of a manifest (version 1). Lines written before the chain existed (no
    `chain_version`) are legacy; the first chained line is a `chain_anchor` that lists the SHA-256 of
    every legacy line, and every later line carries `previous_line_sha256`, the SHA-256 of the line
    before it (newline included). So an inserted, removed, reordered or edited line is named."""
    anchor_at = None
    for number, entry in enumerate(entries, start=1):
        previous = sha256_bytes(lines[number - 2]) if number > 1 else CHAIN_GENESIS
        if anchor_at is None:
            if "chain_version" not in entry:
                continue  # legacy line, covered by the anchor once one is written
            if entry.get("record") != "chain_anchor":
                raise SealError(f"{path}: line {number} is chained but no chain_anchor precedes it: a line was "
                                "inserted or the anchor removed")
            anchor_at = number
            legacy = entry.get("legacy_line_sha256")
            found = [sha256_bytes(x) for x in lines[:number - 1]]
            if not isinstance(legacy, list) or legacy != found:
                legacy = legacy if isinstance(legacy, list) else []
                differs = next((i + 1 for i, (a, b) in enumerate(zip(legacy, found, strict=False)) if a != b),
                               min(len(legacy), len(found)) + 1)
                raise SealError(f"{path}: line {differs}: does not match the chain anchor at line {number} "
                                f"({len(legacy)} legacy lines anchored, {len(found)} found): a line before the "
                                "anchor was inserted, removed, reordered or edited")
        if entry.get("chain_version") != CHAIN_VERSION:
            raise SealError(f"{path}: line {number} has chain_version {entry.get('chain_version')!r} after the chain "
                            f"started at line {anchor_at}; allowed: {CHAIN_VERSION} (an unchained line was inserted "
                            "or edited)")
        if entry.get("previous_line_sha256") != previous:
            raise SealError(f"{path}: line {number}: its previous_line_sha256 {entry.get('previous_line_sha256')} "
                            f"does not match line {number - 1} (sha256 {previous}): line {number - 1} or "
                            f"{number} was inserted, removed, reordered or edited")


def read_manifest(folder: str | Path) -> list[dict[str, Any]]:
    """Every entry of `folder/SEALS.jsonl` after its chain is verified ([] when there is none)."""
    path = manifest_path(folder)
    if not os.path.lexists(path):
        return []
    lines = _manifest_lines(path)
    entries = []
    for number, line in enumerate(lines, start=1):
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise SealError(f"{path}: line {number} is not JSON ({type(exc).__name__})") from None
        if not isinstance(entry, dict):
            raise SealError(f"{path}: line {number} is not a JSON object")
        entries.append(entry)
    _verify_chain(path, lines, entries)
    return entries


def read_seals(folder: str | Path) -> dict[str, dict[str, Any]]:
    """relative path -> seal entry; a path sealed twice with different bytes is an error, and so is a
    broken hash chain (see `_verify_chain`)."""
    path = manifest_path(folder)
    seals: dict[str, dict[str, Any]] = {}
    for number, entry in enumerate(read_manifest(folder), start=1):
        if entry.get("record") == "chain_anchor":
            continue
        if entry.get("record") != "seal" or not isinstance(entry.get("path"), str) or "sha256" not in entry:
            raise SealError(f"{path}: line {number} is not a seal entry")
        if entry.get("ended") not in SEAL_ENDINGS:
            raise SealError(f"{path}: line {number}: ended {entry.get('ended')!r}; allowed: {', '.join(SEAL_ENDINGS)}")
        previous = seals.get(entry["path"])
        if previous is not None and previous["sha256"] != entry["sha256"]:
            raise SealError(f"{path}: {entry['path']} is sealed twice with different hashes "
                            f"({previous['sha256']} at first, {entry['sha256']} at line {number})")
        seals.setdefault(entry["path"], entry)
    return seals


def _append_chained(manifest: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """Append `entry` with its chain link (writing the chain anchor first when the manifest has none)."""
    lines = _manifest_lines(manifest) if os.path.lexists(manifest) else []
    chained = any(b'"chain_version"' in line for line in lines)
    out = b""
    previous = sha256_bytes(lines[-1]) if lines else CHAIN_GENESIS
    if not chained:
        anchor = {"record": "chain_anchor", "chain_version": CHAIN_VERSION, "previous_line_sha256": previous,
                  "legacy_line_sha256": [sha256_bytes(line) for line in lines], "utc": _utc()}
        anchor_line = (canonical_json(anchor) + "\n").encode("utf-8")
        out += anchor_line
        previous = sha256_bytes(anchor_line)
    entry = entry | {"chain_version": CHAIN_VERSION, "previous_line_sha256": previous}
    out += (canonical_json(entry) + "\n").encode("utf-8")
    fd = os.open(manifest, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        write_fully(fd, out)
    finally:
        os.close(fd)
    return entry


RAW_TREE_SHAPES = ("<output-dir>/raw/<campaign>/<backend>/<run>.jsonl",
                   "<output-dir>/cycles/raw/<campaign>/<backend>/<run>.jsonl",
                   "<output-dir>/conformance/<name>.json")


def seal_folder_of(target: str | Path) -> Path:
    """The folder whose SEALS.jsonl seals `target`: only a regular file inside a raw tree (see
    RAW_TREE_SHAPES) may be sealed; anything else is refused before a byte is written."""
    target = Path(target)
    if not is_regular(target):
        what = "a symlink" if target.is_symlink() else "missing" if not os.path.lexists(target) else \
            "not a regular file"
        raise SealError(f"{target}: {what}; only a regular raw or evidence file is sealed")
    real = Path(os.path.realpath(target))
    if real.suffix == ".jsonl" and len(real.parents) >= 4 and real.parents[2].name == "raw":
        return real.parents[1]
    if real.suffix == ".json" and real.parent.name == "conformance":
        return real.parent
    raise SealError(f"{target}: not inside a raw tree; a sealed file lives at one of: {'; '.join(RAW_TREE_SHAPES)}")


def seal_file(target: str | Path, folder: str | Path, *, ended: str, reason: str | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Append `target`'s SHA-256 to `folder/SEALS.jsonl` (under the manifest's lock); returns the entry.

    An `after_the_fact` seal needs a reason: it is kept in the entry beside its time, and
    publish lists every after-the-fact seal (it counts toward a gate only when allowlisted)."""
    if ended not in SEAL_ENDINGS:
        raise ValueError(f"ended: {ended!r} is not allowed; allowed: {', '.join(SEAL_ENDINGS)}")
    if ended == "after_the_fact" and not (reason or "").strip():
        raise SealError(f"reason: a seal that ends {ended!r} must say why (a non-empty --reason)")
    target, folder = Path(target), Path(folder)
    relative = target.resolve().relative_to(folder.resolve()).as_posix()
    manifest = manifest_path(folder)
    lock = FileLock(manifest, what="seal manifest").acquire(blocking=True)
    try:
        existing = read_seals(folder).get(relative)
        try:
            data = read_bytes(target, kind="raw" if target.suffix == ".jsonl" else "evidence", root=folder)
        except UnsafeInput as exc:
            raise SealError(str(exc)) from None
        digest = sha256_bytes(data)
        if existing is not None:
            if existing["sha256"] != digest:
                raise SealError(f"{relative} is already sealed with sha256 {existing['sha256']}; "
                                f"it now has {digest}: a sealed file must not change")
            return existing
        entry = {"record": "seal", "path": relative, "sha256": digest, "bytes": len(data),
                 "ended": ended, "utc": _utc(), "host": socket.gethostname(), "pid": os.getpid()}
        if reason:
            entry["reason"] = reason
        entry.update(extra or {})
        return _append_chained(manifest, entry)
    finally:
        lock.release()


# ------------------------------------------------------------------------------------------
# The writer
# ------------------------------------------------------------------------------------------

class RawWriter:
    """The single writer of one raw file (see the module docstring)."""

    def __init__(self, path: Path, *, seal_folder: Path | None = None):
        self.path = Path(path)
        self.seal_folder = seal_folder if seal_folder is not None else self.path.parent.parent
        self._handle = None
        self._lock = FileLock(self.path, what="raw-file")

    def open(self, header: dict[str, Any], *, same_run: Any = None) -> list[dict[str, Any]]:
        """Create the file with `header`, or resume it; returns the existing records.

        `same_run(old_header, new_header)` raises when the existing file may not be resumed from here.
        """
        self._lock.acquire()
        try:
            relative = self.path.resolve().relative_to(self.seal_folder.resolve()).as_posix()
            sealed = read_seals(self.seal_folder).get(relative)
            if sealed is not None:
                raise RawSealed(f"{self.path} is sealed (run ended: {sealed['ended']}, {sealed['utc']}): "
                                "a sealed run is never resumed; use a new run id")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existing: list[dict[str, Any]] = []
            torn = b""
            if self.path.exists():
                existing, torn = read_raw(self.path)
                if not existing or existing[0].get("record") != "header":
                    raise RawFileError(f"{self.path}: no header record; not a raw file of this project")
                if same_run is not None:
                    same_run(existing[0], header)
            self._handle = open(self.path, "ab")  # noqa: SIM115 - kept open for the run
            if torn:
                sidecar = self._sidecar()
                sidecar.write_bytes(torn)
                os.truncate(self.path, self.path.stat().st_size - len(torn))
                self.append({"record": "repair", "torn_bytes": len(torn), "moved_to": sidecar.name,
                             "torn_sha256": sha256_bytes(torn)})
            if not existing:
                self.append(header)
            return existing
        except BaseException:
            self.close()
            raise

    def _sidecar(self) -> Path:
        n = 1
        while (candidate := self.path.with_name(f"{self.path.name}.torn-{n}")).exists():
            n += 1
        return candidate

    def append(self, record: dict[str, Any]) -> None:
        record = {"utc": _utc()} | record
        self._handle.write((canonical_json(record) + "\n").encode("utf-8"))
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def seal(self, *, ended: str = "teardown") -> dict[str, Any]:
        """Close and seal the file (the run ended); the lock is held until the seal is written."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        try:
            return seal_file(self.path, self.seal_folder, ended=ended)
        finally:
            self._lock.release()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._lock.release()


@contextlib.contextmanager
def exclusive(target: str | Path, what: str) -> Iterator[None]:
    """Hold `<target>.lock` exclusively for the block (refused at once when held elsewhere)."""
    lock = FileLock(target, what=what).acquire()
    try:
        yield
    finally:
        lock.release()


def seal_abandoned(path: str | Path, *, reason: str, ended: str = "abandoned") -> dict[str, Any]:
    """Seal a raw file whose run will not be resumed (its writer died and its machine is gone).

    Refused while a live writer holds the file. `abandoned`: a torn tail is first moved to a sidecar
    (as a resume would) and a `sealed_without_teardown` record with the reason is appended, so the
    file itself says how it ended. `after_the_fact`: a finished file from before seals existed is
    sealed byte for byte as it is (its bytes are already bound by a published aggregate); the
    reason lives in the seal entry.
    """
    if ended not in ("abandoned", "after_the_fact"):
        raise ValueError(f"ended: {ended!r} is not allowed here; allowed: abandoned, after_the_fact")
    path = Path(path)
    writer = RawWriter(path)
    writer._lock.acquire()
    try:
        relative = path.resolve().relative_to(writer.seal_folder.resolve()).as_posix()
        if relative in read_seals(writer.seal_folder):
            raise RawSealed(f"{path} is already sealed")
        records, torn = read_raw(path)
        if not records or records[0].get("record") != "header":
            raise RawFileError(f"{path}: no header record; not a raw file of this project")
        if ended == "after_the_fact":
            if torn:
                raise RawFileError(f"{path}: torn last line; resume or seal it as abandoned instead")
            writer._lock.release()
            return seal_file(path, writer.seal_folder, ended=ended, reason=reason)
        writer._handle = open(path, "ab")  # noqa: SIM115 - closed by seal()
        if torn:
            sidecar = writer._sidecar()
            sidecar.write_bytes(torn)
            os.truncate(path, path.stat().st_size - len(torn))
            writer.append({"record": "repair", "torn_bytes": len(torn), "moved_to": sidecar.name,
                           "torn_sha256": sha256_bytes(torn)})
        writer.append({"record": "sealed_without_teardown", "reason": reason, "ended": ended})
    except BaseException:
        writer.close()
        raise
    return writer.seal(ended=ended)
