"""Merge what a device call brought back (`queue.tgz` of tools/lab/queue.sh, `campaign.tgz` of
campaign.sh) into this checkout's outputs/, append-only.

    python tools/lab/merge_device_outputs.py /work/.device/4/queue.tgz [--logs-to outputs/perf/queue-lease6] [--dry-run]

Every file under the archive's `outputs/` is compared with the checkout's:
- absent here: copied (new evidence);
- identical: left alone;
- here a prefix of the returned bytes (a seal manifest, a raw file resumed on the device): replaced,
  since evidence only grows;
- the returned bytes a prefix of the checkout's (an older archive, merged after a later one): left alone;
- anything else: a conflict. Nothing at all is written when there is a conflict (the checked-in bytes
  are evidence: a rerun never overwrites an earlier run), and the exit status is 1.
Lock files are skipped. With `--logs-to DIR`, the queue's job logs, job list and host facts (`logs/`,
`state/jobs`, `state/queue.tsv`, `state/host.json`) are copied there too, by the same rule: a later poll
of the same queue extends its logs, but another machine's queue (a second start in the same lease) writes
different logs under the same names, a conflict (lease 19 lost its first machine's logs that way: give
the second machine its own folder, `--logs-to outputs/perf/queue-lease19/machine-2`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class MergePlan:
    new: list[str] = field(default_factory=list)
    grown: list[str] = field(default_factory=list)
    same: list[str] = field(default_factory=list)
    behind: list[str] = field(default_factory=list)  # the checkout already holds more
    conflicts: list[str] = field(default_factory=list)


def _safe_members(archive: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """Regular files and folders with relative paths that stay inside the extraction folder."""
    members = []
    for member in archive.getmembers():
        path = Path(member.name)
        if path.is_absolute() or ".." in path.parts:
            raise ValueError(f"archive member {member.name!r} points outside the archive")
        if member.isfile() or member.isdir():
            members.append(member)
    return members


def _compare(source: Path, target: Path) -> str:
    """The MergePlan list a returned file belongs to against the checkout's copy (the module docstring)."""
    if not target.exists():
        return "new"
    here, there = target.read_bytes(), source.read_bytes()
    if here == there:
        return "same"
    if there.startswith(here):
        return "grown"
    return "behind" if here.startswith(there) else "conflicts"


def plan_merge(returned: Path, repo: Path) -> MergePlan:
    """Compare every returned file under outputs/ with the checkout's (see the module docstring)."""
    plan = MergePlan()
    for source in sorted((returned / "outputs").rglob("*")):
        if not source.is_file() or source.name.endswith(".lock"):
            continue
        relative = source.relative_to(returned).as_posix()
        target = repo / relative
        getattr(plan, _compare(source, target)).append(relative)
    return plan


def _log_copies(root: Path, logs_to: Path) -> list[tuple[Path, Path]]:
    """(returned file, destination) for the queue's logs, job list, queue file and host facts."""
    copies = [(log, logs_to / log.name) for log in sorted((root / "logs").glob("*")) if log.is_file()] \
        if (root / "logs").is_dir() else []
    for name, as_name in (("jobs", "jobs.txt"), ("queue.tsv", "queue.tsv"), ("host.json", "host.json")):
        if (root / "state" / name).is_file():
            copies.append((root / "state" / name, logs_to / as_name))
    return copies


def merge(archive_path: Path, repo: Path = REPO, logs_to: Path | None = None, dry_run: bool = False) -> MergePlan:
    with tempfile.TemporaryDirectory() as scratch, tarfile.open(archive_path) as archive:
        root = Path(scratch)
        archive.extractall(root, members=_safe_members(archive), filter="data")
        plan = plan_merge(root, repo)
        log_writes = []
        if logs_to is not None:
            logs_to = repo / logs_to if not logs_to.is_absolute() else logs_to
            for source, target in _log_copies(root, logs_to):
                found = _compare(source, target)
                if found in ("new", "grown"):
                    log_writes.append((source, target))
                elif found == "conflicts":
                    where = target.relative_to(repo).as_posix() if target.is_relative_to(repo) else str(target)
                    plan.conflicts.append(f"{where} (another queue's log: use another --logs-to folder)")
        if plan.conflicts or dry_run:
            return plan
        for relative in plan.new + plan.grown:
            target = repo / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / relative, target)
        for source, target in log_writes:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archive", type=Path)
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--logs-to", type=Path, default=None, help="copy the queue's job logs here")
    parser.add_argument("--dry-run", action="store_true", help="say what would change, write nothing")
    args = parser.parse_args(argv)
    if not args.archive.is_file():
        print(f"archive: {args.archive} is not a file", file=sys.stderr)
        return 2
    plan = merge(args.archive, args.repo, args.logs_to, args.dry_run)
    for label, paths in (("new", plan.new), ("grown", plan.grown), ("behind", plan.behind),
                         ("CONFLICT", plan.conflicts)):
        for path in paths:
            print(f"{label:8s} {path}")
    print(f"{len(plan.new)} new, {len(plan.grown)} grown, {len(plan.same)} unchanged, {len(plan.behind)} behind "
          f"the checkout, {len(plan.conflicts)} conflicts" + (" (dry run: nothing written)" if args.dry_run else ""))
    if plan.conflicts:
        print("nothing was written: a returned file differs from the checked-in one and does not extend it",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
