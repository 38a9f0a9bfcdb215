"""Children die with their parent, even by SIGKILL (issue 40 item 6), proven on the CPU.

A parent process starts a server the way the project does, prints the server's pid and port, and
waits; the test kills the parent with SIGKILL and asserts that the server is gone within seconds and
its port closed:

- the managed-server path (`backends/server.py`, frozen measured code: its own session, no parent
  death signal) is covered by the tree reaper that `rollout` starts (`lifetime.start_reaper`);
- a bound child (`lifetime.popen_bound`: own process group, PR_SET_PDEATHSIG, a watchdog for the
  child's own children) dies with its parent, grandchild included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rollout_lib.backends.server import port_open
from rollout_lib.lifetime import alive, run_bound

from .conftest import REPO

FAKE = str(REPO / "tests" / "fake_openai_server.py")

MANAGED_PARENT = textwrap.dedent(f"""
    import sys, time
    from rollout_lib.lifetime import start_reaper
    from rollout_lib.backends.server import ManagedServer
    start_reaper()
    server = ManagedServer(lambda port: [sys.executable, {FAKE!r}, "--port", str(port), "--ignore-sigterm"],
                           sys.argv[1], start_timeout_s=60)
    server.start()
    print(server.process.pid, server.port, flush=True)
    time.sleep(600)
""")

BOUND_PARENT = textwrap.dedent(f"""
    import socket, sys, time
    from rollout_lib.lifetime import popen_bound
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    # a shell whose own child is the server: PDEATHSIG reaches the shell, the watchdog its group
    child = popen_bound(["/bin/sh", "-c", f"{{sys.executable}} {FAKE!r} --port {{port}} & wait"])
    print(child.pid, port, flush=True)
    time.sleep(600)
""")


def _start_parent(code: str, tmp_path) -> tuple[subprocess.Popen, int, int]:
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "server.log")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    line = parent.stdout.readline().split()
    assert len(line) == 2, f"the parent did not report its server (exit {parent.poll()})"
    return parent, int(line[0]), int(line[1])


def _wait_port(port: int, up: bool, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if port_open(port) == up:
            return True
        time.sleep(0.1)
    return False


def _server_pids_on(port: int) -> list[int]:
    """pids whose command line names `--port <port>` (the fake server; the shell that started it)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as handle:
                    cmd = handle.read().split(b"\0")
            except OSError:
                continue
            if FAKE.encode() in cmd and str(port).encode() in b" ".join(cmd):
                out.append(int(name))
    return out


@pytest.mark.parametrize("how", ["managed-server-reaper", "bound-child"])
def test_a_server_dies_with_its_parent_killed_by_sigkill(how, tmp_path):
    parent, child_pid, port = _start_parent(MANAGED_PARENT if how == "managed-server-reaper" else BOUND_PARENT,
                                            tmp_path)
    try:
        assert _wait_port(port, True, 30), "the server never listened"
        servers = _server_pids_on(port)
        assert servers, "the server process was not found"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_port(port, False, 10), f"port {port} still open 10 s after the parent was killed"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in servers):
            time.sleep(0.1)
        assert not [p for p in servers if alive(p)], f"server processes {servers} outlived their parent"
    finally:
        for pid in [child_pid, *_server_pids_on(port)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


def test_a_bound_child_past_its_timeout_is_killed_with_its_group():
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_bound(["/bin/sh", "-c", "sleep 300 & sleep 300"], timeout=1)
    assert time.monotonic() - started < 10


def test_a_bound_child_returns_its_output():
    done = run_bound([sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"], input="ok")
    assert (done.returncode, done.stdout.strip()) == (0, "OK")
