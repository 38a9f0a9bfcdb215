"""A managed child server on 127.0.0.1: free port, health wait, log tail, teardown with proof.

Used by the vLLM backend (vLLM's OpenAI-compatible server) and testable with any HTTP server.
- `start()` picks a free port (a preferred port already in use is replaced by a free one and the
  switch recorded), starts the command in its own session with output to a log file, and polls
  `GET /health` until it answers 200; a process that exits, or a deadline that passes, raises
  `ServerStartError` with the log's first exception (the root cause: vLLM's engine core raises it,
  then the API server prints its own wrapper traceback, which is all a plain tail shows) and the
  log tail, and the process is stopped.
- `stop()` sends SIGTERM to the whole process group, waits, escalates to SIGKILL, and returns the
  proof: exit code, signal used, whether the port still accepts connections, leftover processes.
Servers bind 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
# The "(EngineCore pid=12) " / "[rank0]: " prefix of a multi-process server's log lines.
_PREFIX = r"(?:\([^)]*pid=\d+\)|\[rank\d+\]:)"
_PROCESS_PREFIX = re.compile(rf"^{_PREFIX}\s?")
# "ValueError: ...", "torch.OutOfMemoryError: ...", "RuntimeError: ..." at the start of a line, after an
# optional process prefix.
_EXCEPTION_LINE = re.compile(rf"^(?:{_PREFIX}\s*)?"
                             r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)(?::.*)?)$")
# Wrappers that say "see above" rather than what went wrong.
_WRAPPER_EXCEPTIONS = ("Engine core initialization failed", "EngineCore failed to start")
_FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def root_cause_in(lines: list[str]) -> tuple[int, str] | None:
    """(index, text) of the first exception line in `lines` that is not a "see above" wrapper, process
    prefix removed, or None. An exception without a message (a bare `AssertionError`) says nothing by
    itself: the frame that raised it and its source line are appended (lease 10: "AssertionError at
    .../lora_expand_op.py:183 in _lora_expand: assert weight.dtype in [torch.float16, torch.bfloat16]")."""
    for index, line in enumerate(lines):
        match = _EXCEPTION_LINE.match(line.strip())
        if not match or any(wrapper in match.group(1) for wrapper in _WRAPPER_EXCEPTIONS):
            continue
        cause = match.group(1)
        if ":" not in cause:
            cause += _raising_frame(lines[:index])
        return index, cause
    return None


def _raising_frame(before: list[str]) -> str:
    """" at FILE:LINE in FUNCTION: SOURCE" for the last traceback frame in `before`, or "" when none."""
    body = [_PROCESS_PREFIX.sub("", line) for line in before]
    for index in range(len(body) - 1, -1, -1):
        frame = _FRAME_LINE.match(body[index])
        if frame:
            source = next((line.strip() for line in body[index + 1:]
                           if line.strip() and set(line.strip()) - set("^~")), "")
            return f" at {frame.group(1)}:{frame.group(2)} in {frame.group(3)}" + (f": {source}" if source else "")
    return ""


class ServerStartError(RuntimeError):
    """The server did not become healthy; the message carries the reason, the root cause with the lines
    before it, and the log tail; `root_cause` is the log's first exception line (None when it has none)."""

    def __init__(self, message: str, root_cause: str | None = None):
        super().__init__(message)
        self.root_cause = root_cause


def port_open(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def session_pids(session_id: int) -> list[int]:
    """Live processes of a session (our child started a new one), zombies excluded."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, sid = fields[0], int(fields[3])
        if sid == session_id and state != "Z":
            out.append(int(entry.name))
    return sorted(out)


class ManagedServer:
    def __init__(self, command: Callable[[int], list[str]], log_path: str | Path, *, env: dict[str, str] | None = None,
                 preferred_port: int | None = None, start_timeout_s: float = 900.0, health_path: str = "/health"):
        self.command = command
        self.log_path = Path(log_path)
        self.env = env
        self.preferred_port = preferred_port
        self.start_timeout_s = start_timeout_s
        self.health_path = health_path
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.port_note: str | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _choose_port(self) -> int:
        if self.preferred_port is not None:
            if not port_open(self.preferred_port):
                return self.preferred_port
            port = free_port()
            self.port_note = f"preferred port {self.preferred_port} was in use; picked {port}"
            return port
        return free_port()

    def start(self) -> float:
        """Start and wait for health; returns seconds until healthy."""
        self.port = self._choose_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        started = time.perf_counter()
        self.process = subprocess.Popen(self.command(self.port), stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        deadline = started + self.start_timeout_s
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                report, cause = self.failure_report()
                raise ServerStartError(f"server exited with code {code} before it was healthy "
                                       f"(port {self.port}); {report}", cause)
            if self.healthy():
                return time.perf_counter() - started
            time.sleep(0.5)
        self.stop()
        report, cause = self.failure_report()
        raise ServerStartError(f"server not healthy within {self.start_timeout_s:.0f} s on port {self.port}; "
                               f"{report}", cause)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + self.health_path, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            data = self.log_path.read_bytes()[-20000:]
        except OSError:
            return "(no log)"
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])

    def _first_exception(self) -> tuple[list[str], int, str] | None:
        """(the log's lines, the index of its first exception line that is not a "see above" wrapper, that
        exception without its process prefix), or None when the log has none."""
        try:
            lines = self.log_path.read_bytes().decode("utf-8", "replace").splitlines()
        except OSError:
            return None
        found = root_cause_in(lines)
        return (lines, *found) if found else None

    def root_cause(self) -> str | None:
        """The log's first exception line that is not a "see above" wrapper (see `root_cause_in`)."""
        found = self._first_exception()
        return found[2] if found else None

    def failure_report(self, tail_lines: int = 20, context_lines: int = 6) -> tuple[str, str | None]:
        """What a failed start says (the root cause with the lines before it, when the log has one, then
        the log tail and its path), and the root cause itself (None when the log has none)."""
        found = self._first_exception()
        if found:
            lines, index, cause = found
            head = "root cause:\n" + "\n".join(lines[max(0, index - context_lines):index + 1]) + "\n"
        else:
            cause, head = None, "no exception line in the log; "
        return f"{head}log tail ({self.log_path}):\n{self.log_tail(tail_lines)}", cause

    def stop(self, grace_s: float = 30.0) -> dict[str, Any]:
        """SIGTERM the process group, escalate to SIGKILL after `grace_s`; return the proof."""
        proof: dict[str, Any] = {"port": self.port, "signal": None, "exit_code": None}
        if self.process is None:
            proof.update(port_closed=True, leftover_pids=[], note="never started")
            return proof
        session = self.process.pid  # start_new_session: pid == session id == process group id
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(session, signal.SIGTERM)
            proof["signal"] = "SIGTERM"
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(session, signal.SIGKILL)
                proof["signal"] = "SIGKILL after SIGTERM timeout"
                self.process.wait(timeout=30)
        else:
            proof["signal"] = "none (already exited)"
        leftovers = session_pids(session)
        if leftovers:  # children that left the group alive: kill them too, and say so
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        proof["exit_code"] = self.process.returncode
        proof["leftover_pids_after_stop"] = leftovers
        proof["leftover_pids"] = session_pids(session)
        deadline = time.perf_counter() + 10
        while self.port is not None and port_open(self.port) and time.perf_counter() < deadline:
            time.sleep(0.1)
        proof["port_closed"] = self.port is None or not port_open(self.port)
        if self._log is not None:
            self._log.close()
            self._log = None
        return proof
