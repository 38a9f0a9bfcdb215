"""The device queue files (tools/lab/queues/*.tsv) are checked on CPU before a lease spends GPU
minutes on them: each line is `name<TAB>timeout_s<TAB>command`, names are unique, every
`rollout_lib.cli` (and tools/lab/side_by_side.py) command parses with the real parser (cells known to the
preregistered workload), the probe's variants are ones it accepts, and named test files exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rollout_lib.cli import build_parser
from rollout_lib.core import REPO_ROOT
from rollout_lib.study.prereg import load
from rollout_lib.study.workload import Workload

QUEUES = sorted((REPO_ROOT / "tools" / "lab" / "queues").glob("*.tsv"))


def _jobs(path: Path) -> list[tuple[str, int, str]]:
    jobs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        assert len(fields) == 3, f"{path.name}:{number}: {len(fields)} tab-separated fields, want 3"
        name, timeout_s, command = fields
        assert re.fullmatch(r"[A-Za-z0-9_.+-]+", name), f"{path.name}:{number}: job name {name!r}"
        assert timeout_s.isdigit() and 0 < int(timeout_s) <= 3600, f"{path.name}:{number}: timeout {timeout_s!r}"
        jobs.append((name, int(timeout_s), command))
    return jobs


def _shell_words(command: str) -> list[str]:
    """The command's words with shell arithmetic and command substitutions replaced by a plain value
    and redirections dropped (what argparse would see)."""
    command = re.sub(r"\$\(\(.*?\)\)", "600", command)
    command = re.sub(r"\$\{?JOB_DEADLINE_S\}?", "600", command)
    command = re.sub(r"\$\{?QUEUE_LEASE_S\}?", "1560", command)
    command = re.sub(r"\$\([^()]*\)", "20261201T000000Z", command)
    words = shlex.split(command)
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word in (">", "2>", ">>", "2>>"):
            skip = True
            continue
        if word.startswith(("2>&1", ">")):
            continue
        out.append(word)
    return out


def _check_command(where: str, command: str, parser, known_cells: set[str]) -> None:
    """One shell command of a job, parsed as its program would parse it."""
    from tools.lab import fast_path_probe

    assigned = re.fullmatch(r"[A-Z_]+=\$\((.*)\)", command.strip())
    if assigned:  # VAR=$(command): the command whose output a later command of the job reads
        _check_command(where, assigned.group(1), parser, known_cells)
        return
    words = _shell_words(command)
    if words[:1] == ["timeout"]:  # `timeout SECONDS command`: the command killed after SECONDS, checked as itself
        assert len(words) > 2 and words[1].isdigit(), f"{where}: timeout SECONDS COMMAND: {command}"
        _check_command(where, shlex.join(words[2:]), parser, known_cells)
        return
    env = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in words if re.fullmatch(r"[A-Z_]+=.*", w)}
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
    if words[:3] == ["python3", "-m", "rollout_lib.cli"]:
        args = parser.parse_args(words[3:])  # SystemExit (a failed test) on an unknown option
        for attribute in ("cells", "cell", "exclude_cells"):
            value = getattr(args, attribute, None)
            if value:
                unknown = set(str(value).split(",")) - known_cells
                assert not unknown, f"{where}: unknown cells {sorted(unknown)}"
        if getattr(args, "backend_option", None) and getattr(args, "backend", None):
            # KEY=VALUE pairs as the command reads them, accepted by the backend itself (an unknown key,
            # a reserved engine flag such as --host, a malformed list fails here, not on the GPU)
            from rollout_lib.backends import create_backend
            from rollout_lib.cli import _backend_options

            create_backend(args.backend, load(REPO_ROOT / "params" / "rollout-runtime-v2.yaml"),
                           **_backend_options(args.backend_option))
        if getattr(args, "rungs", None):  # a setting the comparison does not have fails before the lease
            from rollout_lib.checks.vllm_compare import chosen_rungs

            chosen_rungs(args.comparison, args.rungs.split(","))
    elif words[:2] == ["python3", "tools/lab/side_by_side.py"]:
        from tools.lab import side_by_side

        args = side_by_side.build_parser().parse_args(words[2:])
        unknown = set(args.cells.split(",")) - known_cells
        assert not unknown, f"{where}: unknown cells {sorted(unknown)}"
    elif words[:2] == ["python3", "tools/lab/cycle_memory_probe.py"]:
        from tools.lab import cycle_memory_probe

        args = cycle_memory_probe.build_parser().parse_args(words[2:])
        assert args.cell in known_cells, f"{where}: unknown cell {args.cell}"
    elif len(words) == 5 and words[0] == "[" and words[4] == "]" and words[2] in ("-ge", "-gt"):
        assert words[1].isdigit() and words[3].isdigit(), f"{where}: a guard on seconds left: {command}"
    elif words[:2] == ["python3", "tools/profile_standin_training.py"]:
        from tools import profile_standin_training

        profile_standin_training.build_parser().parse_args(words[2:])
    elif words[:2] == ["python3", "tools/lab/fill_standin_draft.py"]:
        assert len(words) == 4 and words[3].startswith("params/drafts/"), f"{where}: RECORDS_DIR OUT_YAML: {command}"
    elif words[:2] in (["python3", "tools/lab/gemm_bench.py"], ["python3", "tools/lab/epilogue_bench.py"],
                       ["python3", "tools/lab/pdl_bench.py"]):
        from tools.lab import epilogue_bench, gemm_bench, pdl_bench

        bench = {"gemm_bench.py": gemm_bench, "epilogue_bench.py": epilogue_bench,
                 "pdl_bench.py": pdl_bench}[Path(words[1]).name]
        args = bench.build_parser().parse_args(words[2:])
        assert str(args.out).startswith("outputs/perf/"), f"{where}: its JSON under outputs/perf/: {command}"
    elif words[:2] == ["python3", "tools/lab/pick_engine.py"]:
        from tools.lab import pick_engine

        args = pick_engine.build_parser().parse_args(words[2:])
        assert all(str(f).startswith("outputs/perf/") for f in args.folders), f"{where}: probe folders: {command}"
    elif words[:2] == ["python3", "tools/lab/engine_profile.py"]:
        from tools.lab import engine_profile

        args = engine_profile.build_parser().parse_args(words[2:])
        assert args.out.startswith("outputs/perf/") and (args.engine_choice or "outputs/perf/").startswith(
            "outputs/perf/"), f"{where}: the profile and the picker's choice under outputs/perf/: {command}"
    elif words[:2] == ["python3", "tools/lab/host_facts.py"]:
        from tools.lab import host_facts

        args = host_facts.build_parser().parse_args(words[2:])
        assert args.gpu_is, f"{where}: host_facts in a job only as a guard (--gpu-is NAME): {command}"
    elif words[:2] == ["mkdir", "-p"]:
        assert all(w.startswith("outputs/") for w in words[2:]), f"{where}: folders under outputs/ only: {command}"
    elif words[:1] == ["echo"]:
        pass  # a value the job keeps beside its results (the redirection is dropped above)
    elif words[:2] == ["bash", "tools/lab/wait_for_install.sh"]:
        assert len(words) in (3, 4) and words[2] in ("vllm", "ray") and all(w.isdigit() for w in words[3:]), \
            f"{where}: package (vllm or ray) and seconds to wait: {command}"
    elif words == ["bash", "/tmp/stage/install-extras.sh"]:
        pass  # the staged installer of ../shared/device/extras (copied to /tmp/stage by the first call)
    elif words[:4] == ["python3", "-m", "pytest", "-q"]:
        for word in words:
            if word.startswith("tests/") or word.startswith("--ignore=tests/"):
                target = word.split("=", 1)[-1]
                assert (REPO_ROOT / target).exists(), f"{where}: {target} does not exist"
    elif words[:2] == ["bash", "tools/lab/fast_path_evidence.sh"]:
        for variant in env.get("VARIANTS", "before,inductor").split(","):
            base, *suffixes = variant.split("+")
            assert base in ("before", "off", "inductor", "eager"), f"{where}: variant {variant}"
            assert all(s in fast_path_probe.SUFFIXES for s in suffixes), f"{where}: {variant}"
            assert not suffixes or base in ("off", "inductor"), f"{where}: {variant}"
            if base == "before":
                assert "BEFORE" in env, f"{where}: `before` needs BEFORE=<file>"
    elif words[:4] == ["python3", "-m", "pip", "install"]:
        # a carried wheel (e.g. .whl/ Liger Kernel): offline, no dependencies, the version the GPU stack pins
        wheels = [w for w in words if w.endswith(".whl")]
        assert wheels and "--no-index" in words and "--no-deps" in words, f"{where}: offline wheels only: {command}"
        pinned = (REPO_ROOT / "requirements" / "gpu.txt").read_text()
        for wheel in wheels:
            name, version = Path(wheel).name.split("-")[:2]
            assert f"{name.replace('_', '-')}=={version}" in pinned, f"{where}: {wheel} is not the pinned version"
    else:
        pytest.fail(f"{where}: a command this test cannot check: {command[:80]}")


@pytest.mark.parametrize("path", QUEUES, ids=[p.name for p in QUEUES])
def test_queue_file_is_runnable(path):
    jobs = _jobs(path)
    assert jobs, f"{path.name}: no jobs"
    names = [name for name, _, _ in jobs]
    assert len(set(names)) == len(names), f"{path.name}: duplicate job names"
    known_cells = set(Workload(load(REPO_ROOT / "params" / "rollout-runtime-v2.yaml")).cell_ids())
    parser = build_parser()
    for name, _, line in jobs:
        for command in re.split(r"\s(?:\|\||&&)\s", line):  # `a || b`: the fallback is checked like the first
            _check_command(f"{path.name}/{name}", command, parser, known_cells)


def test_a_command_under_timeout_is_checked_as_itself():
    """`timeout $((JOB_DEADLINE_S - 10)) python3 -m pytest ...` (lease 43's GPU suite): the seconds must be a number
    once the shell has computed them, and the command after them passes or fails as it would alone."""
    parser = build_parser()
    cells = set(Workload(load(REPO_ROOT / "params" / "rollout-runtime-v2.yaml")).cell_ids())
    _check_command("q/ok", "timeout $((JOB_DEADLINE_S - 10)) python3 -m pytest -q -m gpu tests", parser, cells)
    with pytest.raises(AssertionError, match=r"tests/nowhere\.py does not exist"):
        _check_command("q/bad", "timeout 300 python3 -m pytest -q tests/nowhere.py", parser, cells)
    with pytest.raises(pytest.fail.Exception, match="a command this test cannot check"):
        _check_command("q/bad", "timeout 300 rm -rf outputs", parser, cells)


@pytest.mark.parametrize("script", sorted((REPO_ROOT / "tools" / "lab").glob("*.sh")), ids=lambda p: p.name)
def test_device_scripts_parse(script):
    """A syntax error in a device script would cost a machine start to find: `bash -n` finds it here."""
    import subprocess

    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", QUEUES, ids=[p.name for p in QUEUES])
def test_campaign_jobs_take_their_deadline_from_the_lease(path):
    """A `campaign run` job plans for JOB_DEADLINE_S (the lease's remainder, or its own timeout less a
    margin), never a fixed figure: lease 7's vllm rows had a fixed 540 s and started after the lease's
    end, leaving a header-only raw file."""
    for name, _, command in _jobs(path):
        if "rollout_lib.cli campaign run" in command:
            assert "--deadline-s $JOB_DEADLINE_S" in command, f"{path.name}/{name}: --deadline-s is not $JOB_DEADLINE_S"
            if "--lease-s" in command:  # a fixed figure could fall below a longer lease's deadline (refused)
                assert "--lease-s $QUEUE_LEASE_S" in command, f"{path.name}/{name}: --lease-s is not $QUEUE_LEASE_S"


def test_queue_skips_a_job_past_the_lease_and_bounds_each_deadline(tmp_path):
    """queue.sh itself, run on CPU in a throwaway checkout: a job gets JOB_DEADLINE_S = min(lease left,
    timeout - JOB_MARGIN_S) and QUEUE_LEASE_S (LEASE_S); a job reached with less than MIN_JOB_S of the
    lease left is skipped and reported, and the queue still packs what ran."""
    import os
    import shutil
    import subprocess

    checkout = tmp_path / "checkout"
    (checkout / "tools" / "lab").mkdir(parents=True)
    for script in ("queue.sh", "work_copy.sh", "job_states.sh"):
        shutil.copy(REPO_ROOT / "tools" / "lab" / script, checkout / "tools" / "lab" / script)
    write = "mkdir -p outputs/perf && echo $JOB_DEADLINE_S $QUEUE_LEASE_S > outputs/perf/{}.txt"
    (checkout / "q.tsv").write_text(
        "# name\ttimeout_s\tcommand\n"
        f"own-timeout\t30\t{write.format('own-timeout')}\n"
        f"lease-left\t200\t{write.format('lease-left')}\n"
        "long\t100\tsleep 12\n"
        f"too-late\t100\t{write.format('too-late')}\n")
    env = {**os.environ, "QUEUE": "q.tsv", "QUEUE_WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"),
           "LEASE_S": "70", "MIN_JOB_S": "60", "JOB_MARGIN_S": "10", "CALL_S": "60"}
    result = subprocess.run(["bash", "tools/lab/queue.sh", "start"], cwd=checkout, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "queue: finished" in result.stdout, result.stdout
    assert re.search(r"too-late\s+skipped: \d+ s of the lease left", result.stdout), result.stdout
    assert re.search(r"long\s+exit 0 after", result.stdout), result.stdout
    perf = tmp_path / "work" / "src" / "outputs" / "perf"
    assert (perf / "own-timeout.txt").read_text().split() == ["20", "70"]  # 30 s timeout less the 10 s margin
    deadline_s, lease_s = map(int, (perf / "lease-left.txt").read_text().split())
    assert 60 <= deadline_s <= 70 and lease_s == 70  # the lease's remainder, under 200 - 10; the whole lease
    assert not (perf / "too-late.txt").exists()
    assert (tmp_path / "out" / "queue.tgz").stat().st_size > 0


@pytest.mark.parametrize("probe_sleeps_s, expected_rc", [(0, 0), (30, 124)])
def test_a_probe_cut_by_its_timeout_fails_the_job_and_says_so_in_its_log(tmp_path, probe_sleeps_s, expected_rc):
    """fast_path_evidence.sh, run on CPU in a throwaway checkout with a stand-in probe: lease 47's probe was cut
    after two of its three variants and the job still exited 0. A cut probe now makes the job exit 124, with a
    line in probe.log saying which variants were not measured; what the probe wrote and evidence.tgz still come
    back. A probe that finishes leaves the job's status 0 and no such line."""
    import os
    import shutil
    import subprocess

    checkout = tmp_path / "checkout"
    (checkout / "tools" / "lab").mkdir(parents=True)
    (checkout / "outputs" / "conformance").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "tools" / "lab" / "fast_path_evidence.sh", checkout / "tools" / "lab")
    (checkout / "tools" / "lab" / "fast_path_probe.py").write_text(
        f"import time\nprint('variant one measured', flush=True)\ntime.sleep({probe_sleeps_s})\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "STEPS": "probe", "PROBE_TIMEOUT_S": "3", "VARIANTS": "inductor"}
    result = subprocess.run(["bash", "tools/lab/fast_path_evidence.sh"], cwd=checkout, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == expected_rc, result.stderr
    log = (out / "probe.log").read_text()
    assert log.startswith("variant one measured")
    assert ("probe: exit 124 (124: stopped by PROBE_TIMEOUT_S=3)" in log) == (expected_rc == 124), log
    assert (out / "evidence.tgz").is_file()
