"""Children die with their parent, even when the parent is killed with SIGKILL (standard library, Linux).

Two guards, because neither alone covers every process this project starts:

- **Bound children** (`popen_bound`, `run_bound`): a child started here gets its own process group,
  `PR_SET_PDEATHSIG` = SIGKILL (the kernel kills it when the thread that started it dies) and a
  watchdog process that sees the parent gone and then kills the child's whole group (the child's own
  children included: PDEATHSIG reaches only the direct child).
- **The tree reaper** (`start_reaper`): for processes started by code that must stay byte-stable
  (the managed vLLM server of `backends/server.py` is measured code, frozen in h200-v2's
  measurement identity, so it cannot be edited to use `popen_bound`). The reaper is a small process
  in its own session that watches the root process; every 0.25 s it records the root's descendants
  (pid and start time, from /proc), including those that moved to their own session. When the root
  dies (SIGKILL included) or exits, it sends SIGTERM to each recorded process still alive (the same
  pid AND start time: a reused pid is never touched), then SIGKILL after a grace period. A process
  started and re-parented within one 0.25 s poll is not seen: a documented limit.

    python -m rollout_lib.lifetime --root PID          # what start_reaper() runs
    python -m rollout_lib.lifetime --parent PID --group PGID   # what popen_bound() runs
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1
POLL_S = 0.25
GRACE_S = 3.0


# ------------------------------------------------------------------------------------------
# /proc
# ------------------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live, non-zombie process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _table() -> dict[int, tuple[int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (found := _stat(int(name))) is not None:
            out[int(name)] = found
    return out


def alive(pid: int, start: int | None = None) -> bool:
    found = _stat(pid)
    return found is not None and (start is None or found[1] == start)


# ------------------------------------------------------------------------------------------
# Bound children
# ------------------------------------------------------------------------------------------

def _set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def bind_to_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn`: own process group, SIGKILL on the parent's death; exits at once if the parent
    already died between fork and exec (PDEATHSIG would never fire then)."""

    def preexec() -> None:
        os.setpgid(0, 0)
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _spawn_watchdog(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rollout_lib.lifetime", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def popen_bound(command: list[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen` whose child (and the child's process group) dies with this process."""
    if "preexec_fn" in kwargs or kwargs.get("start_new_session"):
        raise ValueError("popen_bound sets the child's process group and parent-death signal itself")
    parent = os.getpid()
    proc = subprocess.Popen(command, preexec_fn=bind_to_parent(parent), **kwargs)
    proc.watchdog = _spawn_watchdog(["--parent", str(parent), "--group", str(proc.pid)])
    return proc


def run_bound(command: list[str], *, input: str | None = None, timeout: float | None = None,
              **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(..., capture_output=True, text=True)` with a bound child; on a timeout or an
    interrupt the child's whole group is killed before the exception propagates."""
    proc = popen_bound(command, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        with contextlib.suppress(Exception):
            proc.watchdog.terminate()
            proc.watchdog.wait(timeout=5)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


# ------------------------------------------------------------------------------------------
# The tree reaper
# ------------------------------------------------------------------------------------------

_REAPER: subprocess.Popen | None = None


def start_reaper(root_pid: int | None = None) -> subprocess.Popen:
    """Start (once per process) the reaper of `root_pid`'s descendants (default: this process)."""
    global _REAPER
    if _REAPER is None or _REAPER.poll() is not None:
        _REAPER = _spawn_watchdog(["--root", str(root_pid or os.getpid())])
    return _REAPER


def _kill_all(targets: dict[int, int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, start in targets.items():
            if alive(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + (GRACE_S if sig == signal.SIGTERM else 1.0)
        while time.monotonic() < deadline and any(alive(p, s) for p, s in targets.items()):
            time.sleep(0.05)


def _record_descendants(root: int, known: dict[int, tuple[int, int]], me: int) -> None:
    """Add to `known` every live process whose parent is `root` or a known process (transitively)."""
    table = _table()
    changed = True
    while changed:
        changed = False
        for pid, (ppid, start) in table.items():
            if pid != me and (ppid == root or ppid in known) and known.get(pid, (0, -1))[1] != start:
                known[pid] = (ppid, start)
                changed = True


def reap(root: int) -> None:
    """Watch `root`; when it dies, kill every descendant recorded while it lived (and their children),
    those that started their own session included."""
    me = os.getpid()
    root_stat = _stat(root)
    if root_stat is None:
        return
    known: dict[int, tuple[int, int]] = {}  # pid -> (parent pid, start time)
    while alive(root, root_stat[1]):
        _record_descendants(root, known, me)
        known = {pid: value for pid, value in known.items() if alive(pid, value[1])}
        time.sleep(POLL_S)
    _record_descendants(root, known, me)  # children born since the last scan
    _kill_all({pid: start for pid, (_, start) in known.items()})


def watch_group(parent: int, group: int) -> None:
    """Kill process group `group` when `parent` dies; return when the group is empty."""
    parent_stat = _stat(parent)
    parent_start = parent_stat[1] if parent_stat else None
    while parent_start is not None and alive(parent, parent_start):
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(POLL_S)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_lib.lifetime", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=int, help="reap this process's descendants when it dies")
    parser.add_argument("--parent", type=int, help="with --group: kill the group when this process dies")
    parser.add_argument("--group", type=int)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is the parent's business
    if args.root:
        reap(args.root)
    elif args.parent and args.group:
        watch_group(args.parent, args.group)
    else:
        parser.error("give --root PID, or --parent PID and --group PGID")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
