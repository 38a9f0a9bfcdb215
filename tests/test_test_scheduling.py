"""`make test`'s scheduling: the files whose processes listen on kernel-picked ports run on one worker.

A managed server picks a free port, closes it and its child binds it seconds later (the frozen
`backends/server.py`); a Ray cluster on the other worker took such a port once (stop 72's CI). The
conftest's scheduler keeps those files in one work unit; this checks that the names it lists are
files here, and that two xdist workers really give them one worker while other files spread.
"""

from __future__ import annotations

import re
import subprocess
import sys

from .conftest import REPO, SHARE_PICKED_PORTS


def test_every_file_sharing_picked_ports_exists():
    missing = [name for name in SHARE_PICKED_PORTS if not (REPO / "tests" / name).is_file()]
    assert not missing, f"tests/conftest.py SHARE_PICKED_PORTS names files that are gone: {missing}"


def test_two_workers_run_the_port_files_on_one_worker(tmp_path):
    """Stand-in files under the real names, each test sleeping a little so both workers are busy, run with
    the project's conftest and `--dist=loadfile`: the port files land on one worker, the others on both."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    body = "import time\n\n" + "".join(f"def test_{i}():\n    time.sleep(0.2)\n\n\n" for i in range(3))
    others = [f"test_other_{i}.py" for i in range(4)]
    for name in (*SHARE_PICKED_PORTS, *others):
        (tests / name).write_text(body)
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "--numprocesses=2",
                           "--dist=loadfile"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, name in re.findall(r"\[(gw\d)\][^\n]*PASSED tests/(test_\w+\.py)", done.stdout):
        workers.setdefault(name, set()).add(worker)
    assert set(workers) == {*SHARE_PICKED_PORTS, *others}, done.stdout[-3000:]
    assert len(set().union(*(workers[name] for name in SHARE_PICKED_PORTS))) == 1, workers
    assert set().union(*workers.values()) == {"gw0", "gw1"}, workers
