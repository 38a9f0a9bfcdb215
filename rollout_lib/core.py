"""The foundation every layer may import (standard library only): project paths and names, canonical JSON,
SHA-256 helpers and atomic evidence writes.

Evidence is bound to bytes: every JSON this project writes goes through `canonical_json`, so the
same content always has the same SHA-256 (sorted keys, no whitespace, shortest round-trip float
text, UTF-8, no NaN/Infinity).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rollout_lib.safe_write import write_bytes_atomic  # the one atomic writer (same foundation layer)

# The library's own source tree: for code only (measurement-code digests, the pinned calculator files,
# the source stamp). Data paths (params, outputs, notebooks) are never resolved from it: an editable install
# would write into the checkout whatever the working directory, a regular one into site-packages.
REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_ROOT = REPO_ROOT
# The library's default output folder, relative: it resolves against the working directory when used
# (the CLI passes <project root>/outputs explicitly).
OUTPUTS_DIR = Path("outputs")
PROJECT_MARKER = "params"  # a project is the folder that holds params/, found the way git finds .git
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # run ids: they become file names under the output tree
NAME_MAX_CHARS = 64


class ProjectRootNotFound(FileNotFoundError):
    """No folder holding params/ in the working directory or any folder above it."""


class BadName(ValueError):
    """A run id or campaign name that cannot be a file name under the output tree."""


def find_project_root(start: str | os.PathLike[str] | None = None) -> Path | None:
    """The nearest folder, from `start` (default: the working directory) upwards, that holds params/."""
    here = Path(start if start is not None else Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / PROJECT_MARKER).is_dir():
            return folder
    return None


def project_root(start: str | os.PathLike[str] | None = None) -> Path:
    """`find_project_root`, or ProjectRootNotFound with the one-line reason."""
    found = find_project_root(start)
    if found is None:
        here = Path(start if start is not None else Path.cwd()).resolve()
        raise ProjectRootNotFound(f"project root: no {PROJECT_MARKER}/ folder in {here} or any folder above it; "
                                  f"run inside a project (a checkout with {PROJECT_MARKER}/) or give every path "
                                  "explicitly (--params, --output-dir)")
    return found


def check_name(field: str, value: object, pattern: str = NAME_PATTERN, allowed: str = "") -> str:
    """A run id or campaign name, checked before it becomes part of any path: a string of at most 64
    characters from [A-Za-z0-9._-] (first one a letter or digit). BadName names the field otherwise."""
    import re

    allowed = allowed or "letters, digits, '.', '_', '-' (first a letter or digit)"
    if not isinstance(value, str):
        raise BadName(f"{field}: expected a string, got {type(value).__name__} {value!r:.80}")
    if len(value) > NAME_MAX_CHARS:
        raise BadName(f"{field}: {len(value)} characters ({value[:24]!r}...); at most {NAME_MAX_CHARS} allowed: "
                      f"{allowed}")
    if not re.fullmatch(pattern, value):
        raise BadName(f"{field}: {value!r} must match {pattern}: {allowed}, at most {NAME_MAX_CHARS} characters")
    return value



# Startup messages known to be harmless, silenced at their source by logger and message (nothing else
# from these loggers is hidden). bitsandbytes, imported on a CPU with AVX512-BF16, looks for an optional
# faster NF4 matmul in the `kernels` package (kernels-community) and says so when it is absent; it then
# uses its own CPU kernel, the one every CPU measurement here has always used.
KNOWN_HARMLESS_LOG_MESSAGES: dict[str, tuple[str, ...]] = {
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}


class _DropKnownMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_known_warnings() -> None:
    """Install the filters for KNOWN_HARMLESS_LOG_MESSAGES (idempotent; before the library is imported)."""
    for name, prefixes in KNOWN_HARMLESS_LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownMessages) for f in logger.filters):
            logger.addFilter(_DropKnownMessages(prefixes))


@contextlib.contextmanager
def notebook_kernel_options() -> Iterator[dict[str, Any]]:
    """papermill keyword arguments for a kernel that talks over Unix sockets in a private folder (0700),
    not over unencrypted localhost TCP: nothing listens on a port, and the kernel's start-up warning
    about TCP without encryption ("[IPKernelApp] WARNING | Kernel is running over TCP without
    encryption") has no cause left. The folder and its sockets are removed afterwards.

    Once the last cell has replied, the kernel is stopped at once (nbclient's `shutdown_kernel="immediate"`:
    a kill of its process group) instead of being asked to tear itself down: ipykernel 7.4's own teardown
    (closing its zmq sockets and contexts from several threads) can abort in libzmq, printing "Assertion
    failed: pfd.revents & POLLIN (src/signaler.cpp:238)" on the run's stderr (seen once, in a CI run on a
    loaded 2-core machine). Nothing is lost by skipping it: every cell has returned and its outputs are in
    the notebook, and what a measurement writes is written, fsynced and sealed inside its cells (a backend's
    server is stopped there too)."""
    from traitlets.config import Config  # papermill's dependency; only a notebook run needs it

    folder = tempfile.mkdtemp(prefix="rollout-kernel-")
    try:
        yield {"config": Config({"KernelManager": {"transport": "ipc", "ip": os.path.join(folder, "kernel")}}),
               "kernel_manager_class": _shutdown_without_interrupt_manager(), "shutdown_kernel": "immediate"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _shutdown_without_interrupt_manager() -> type:
    """jupyter_client's AsyncKernelManager, except that shutting the kernel down sends it no SIGINT.

    jupyter_client interrupts the kernel before every shutdown request. When the last cell has just
    replied, the kernel may still be inside that request's handler, where ipykernel turns the signal into
    a KeyboardInterrupt and logs "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel." on the run's
    stderr: a race, seen on a loaded CI machine. The shutdown request alone stops an idle kernel; a busy
    one (a failed or cancelled run) is still ended by jupyter_client's SIGTERM and kill after its wait.
    An interrupt asked for while the kernel is not shutting down (nbclient's cell timeout) is unchanged."""
    from jupyter_client import AsyncKernelManager

    class ShutdownWithoutInterrupt(AsyncKernelManager):
        async def _async_interrupt_kernel(self) -> None:
            if self.shutting_down:
                return
            await super()._async_interrupt_kernel()

    return ShutdownWithoutInterrupt


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
    data = canonical_json_bytes(value)
    write_bytes_atomic(target, data)
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
