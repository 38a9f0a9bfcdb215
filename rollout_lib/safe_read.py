"""The one way this project reads its inputs (standard library only, foundation level beside core.py).

Evidence, aggregates, preregistrations, seal manifests, allowlists and cycle raw files are read only
through `read_bytes` (and its `read_text` / `read_json` wrappers):

- the file must be a regular file: a FIFO, a device (`/dev/zero`), a socket or a directory is refused
  (the open is non-blocking, so a FIFO cannot make the reader wait for a writer);
- with `root`, its real path must lie inside `root`: a symlink that leaves the tree is refused;
- the final path component is opened with O_NOFOLLOW and checked with fstat on the opened
  descriptor, so a file swapped for a symlink or a FIFO after the check is still refused;
- the size is checked against the kind's limit (`LIMITS`, the one place they are stated) before a
  byte is read, and the read itself stops at the limit (a file that grows while read is refused).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

MiB = 1 << 20
LIMITS: dict[str, int] = {
    "preregistration": 1 * MiB,   # a study file is a few KB
    "allowlist": 1 * MiB,         # params/evidence-allowlist.yaml
    "seal_manifest": 16 * MiB,    # one ~300-byte line per sealed file
    "raw": 64 * MiB,              # the largest committed raw file is 0.35 MB
    "cycle_raw": 64 * MiB,
    "evidence": 16 * MiB,         # conformance / refresh JSON: the largest committed one is 70 KB
    "aggregate": 64 * MiB,        # the h200-v2 aggregate is ~0.5 MB
    "calculator": 1 * MiB,
    "trace": 256 * MiB,           # a torch-profiler Chrome trace (gzipped or not): a whole p512-r512 cell is tens of MB
}


class UnsafeInput(ValueError):
    """An input is not a regular file inside its tree, or is larger than its kind's limit."""


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symlink"}


def _what(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Whether `path`'s real path (every symlink resolved) lies inside `root`'s real path."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def read_bytes(path: str | os.PathLike[str], *, kind: str, root: str | os.PathLike[str] | None = None,
               limit: int | None = None) -> bytes:
    """The bytes of a regular file of `kind` (see the module docstring); raises UnsafeInput."""
    cap = limit if limit is not None else LIMITS[kind]
    shown = os.fspath(path)
    real = os.path.realpath(path)
    if root is not None and not inside(real, root):
        raise UnsafeInput(f"{shown}: resolves to {real}, outside {os.fspath(root)}: a {kind} file is read only "
                          "inside its tree")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise FileNotFoundError(f"{shown}: {kind} file does not exist") from None
    except OSError as exc:  # ELOOP: swapped for a symlink after realpath; ENXIO: a socket
        raise UnsafeInput(f"{shown}: cannot be opened as a regular {kind} file ({os.strerror(exc.errno)})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeInput(f"{shown}: is {_what(info.st_mode)}, not a regular file: a {kind} is read only "
                              "from a regular file")
        if info.st_size > cap:
            raise UnsafeInput(f"{shown}: {info.st_size} bytes, over the {kind} limit of {cap} bytes")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise UnsafeInput(f"{shown}: grew past the {kind} limit of {cap} bytes while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike[str], *, kind: str, root: str | os.PathLike[str] | None = None) -> str:
    data = read_bytes(path, kind=kind, root=root)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeInput(f"{os.fspath(path)}: not UTF-8 text (byte {exc.start})") from None


def read_json(path: str | os.PathLike[str], *, kind: str, root: str | os.PathLike[str] | None = None) -> Any:
    """JSON of a bounded regular file; NaN and Infinity are refused (evidence JSON never holds them)."""
    data = read_bytes(path, kind=kind, root=root)
    return loads_json(data, str(path))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in evidence JSON")


def loads_json(data: bytes | str, where: str) -> Any:
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise UnsafeInput(f"{where}: not valid JSON ({type(exc).__name__}: {exc})") from None


def is_regular(path: str | os.PathLike[str]) -> bool:
    """lstat says a regular file (a symlink, even to a regular file, is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False

