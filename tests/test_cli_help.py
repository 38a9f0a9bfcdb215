"""The CLI explains itself: every subcommand's and action's `--help` opens with a one-line purpose
and ends with an example; `rollout prereg` says what it validated; `rollout campaign status` says how
old a driver's state is and whether it is live."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from rollout_lib.cli import _subparsers, build_parser

from .conftest import PREREG, REPO, SMOKE

COMMANDS = sorted(_subparsers(build_parser()))


def rollout(*argv: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollout_lib.cli", *argv], capture_output=True, text=True, cwd=cwd)


def test_the_cli_has_its_subcommands_and_actions():
    # the walk finds nested actions too: a test that iterated over nothing would assert nothing
    assert {"prereg", "measure", "publish", "check", "report", "campaign run", "campaign status",
            "models build", "models verify"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_a_purpose_line_and_an_example(command):
    out = rollout(*command.split(), "--help")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    # argparse prints: usage block, blank line, the description, blank line, arguments..., epilog
    after_usage = text.split("\n\n", 1)[1]
    purpose = after_usage.split("\n\n", 1)[0]
    assert "\n" not in purpose.strip() and purpose.strip().endswith("."), (command, purpose)
    assert not purpose.lstrip().startswith(("positional arguments", "options")), (command, purpose)
    example = re.search(r"\nexample:\n  (rollout .+)\n?$", text)
    assert example, (command, text[-300:])
    assert example.group(1).startswith(f"rollout {command}"), (command, example.group(1))


def test_top_level_help_says_where_paths_resolve():
    out = rollout("--help")
    assert out.returncode == 0 and "project root" in out.stdout and "holds params/" in out.stdout


def test_prereg_prints_valid_file_and_hash_keeping_the_details(prereg_study):
    out = rollout("prereg", str(SMOKE))
    assert out.returncode == 0, out.stderr
    from rollout_lib.study.prereg import load

    assert out.stdout == f"valid: {SMOKE} (sha256 {load(SMOKE).sha256})\n"
    for detail in ("  study ", "  actor ", "  teacher ", "  calculator"):
        assert detail in out.stderr, out.stderr
    default = rollout("prereg")  # the default: the preregistration in the project root
    assert default.stdout == f"valid: params/rollout-runtime-v2.yaml (sha256 {prereg_study.sha256})\n"
    assert PREREG.is_file()


# ------------------------------------------------------------------------------------------
# campaign status: when the state was written, and whether it is live
# ------------------------------------------------------------------------------------------

def _state(out, name: str, **fields) -> None:
    from rollout_lib.campaign.driver import state_path

    now = time.time()
    state = {"campaign": "st", "backend": "hf_cached", "driver_pid": os.getpid(), "host": socket.gethostname(),
             "started_unix": now - 60, "deadline_unix": now + 600, "written_unix": now - 5,
             "plan": {"estimates_s": {}}, "workers": []} | fields
    path = state_path(out, "st", "hf_cached", name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state))


def test_status_marks_a_state_older_than_its_lease_as_not_live(tmp_path, smoke_study):
    from rollout_lib.campaign.driver import status

    out = tmp_path / "out"
    days = 2 * 86400
    # the driver's pid is alive here (this process): only the age of the state says it is not live
    _state(out, "20261201T000000Z", started_unix=time.time() - days - 900, deadline_unix=time.time() - days,
           written_unix=time.time() - days - 30)
    text = status(smoke_study, "st", out)
    assert f"driver hf_cached pid {os.getpid()}: not live: older than its lease (deadline " in text, text
    assert "2 d ago; never marked finished)" in text, text
    assert re.search(r"\n  state written \d{4}-\d\d-\d\d \d\d:\d\d UTC \(2 d( \d+ h)? ago\)", text), text
    assert "running" not in text


def test_status_of_a_live_state_says_running_and_how_recent(tmp_path, smoke_study):
    from rollout_lib.campaign.driver import status

    out = tmp_path / "out"
    _state(out, "20261204T000000Z")
    text = status(smoke_study, "st", out)
    assert f"driver hf_cached pid {os.getpid()}: running; deadline in " in text, text
    assert re.search(r"\n  state written .* UTC \([56] s ago\)", text), text


def test_status_of_a_state_from_another_host_is_not_live_here(tmp_path, smoke_study):
    from rollout_lib.campaign.driver import status

    out = tmp_path / "out"
    _state(out, "20261204T000000Z", host="gpu-lease-machine")
    text = status(smoke_study, "st", out)
    assert "not live here: written on host gpu-lease-machine" in text, text


def test_status_of_a_finished_state_says_when_it_was_written(tmp_path, smoke_study):
    from rollout_lib.campaign.driver import status

    out = tmp_path / "out"
    _state(out, "20261204T000000Z", finished_unix=time.time() - 3700, written_unix=time.time() - 3700)
    text = status(smoke_study, "st", out)
    assert f"driver hf_cached pid {os.getpid()}: finished\n  state written " in text, text
    assert "(1 h 1 min ago)" in text, text
