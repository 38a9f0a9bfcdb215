"""What a campaign's existing raw files tell a new measuring process.

- **The GPU it is bound to.** A campaign is a set of raw files bound to one GPU identity (model and
  driver; `not_applicable` for a CPU campaign): that of its first raw file. A process on another GPU,
  or on a CPU, is refused before it writes anything.
- **Cells to continue.** A cell cut off mid-way (a deadline, a lost machine) keeps its measured
  repetitions. The next process that measures the cell continues the latest partial attempt of it
  (no `cell_complete`: killed, or `cell_suspended` at a deadline) when that attempt's file has the
  same measurement identity and every one of its measured repetitions is valid. The new attempt
  names the earlier ones as its `continues` chain; the calculator assembles the cell from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_lib.measure.identity import gpu_key
from rollout_lib.measure.rawfile import RawFileError, live_holder, read_raw


class CampaignGPUMismatch(ValueError):
    """This process runs on another GPU (or a CPU) than the campaign's first raw file."""


def _headers(campaign_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(campaign_dir.glob("*/*.jsonl")):
        try:
            records, _ = read_raw(path)
        except RawFileError:
            continue  # a damaged file binds nothing; publish names it
        if records and records[0].get("record") == "header":
            out.append((path, records[0]))
    return out


def campaign_gpu(campaign_dir: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The GPU identity the campaign is bound to and the file that bound it (None for a new campaign)."""
    headers = _headers(Path(campaign_dir))
    if not headers:
        return None
    path, header = min(headers, key=lambda item: (item[1].get("utc", ""), str(item[0])))
    return gpu_key(header.get("environment", {})), path


def check_campaign_gpu(campaign_dir: str | Path, environment: dict[str, Any], campaign: str) -> None:
    bound = campaign_gpu(campaign_dir)
    if bound is None:
        return
    expected, first = bound
    here = gpu_key(environment)
    if here != expected:
        def name(key: dict[str, Any]) -> str:
            return "a CPU (no GPU)" if key.get("status") != "measured" else f"{key['name']} driver {key['driver']}"
        raise CampaignGPUMismatch(
            f"campaign: {campaign!r} is bound to {name(expected)} (its first raw file {first.name} in "
            f"{first.parent.name}/); this process runs on {name(here)}: use another campaign name")


@dataclass
class Segment:
    run_id: str
    attempt: int
    measured_indices: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "attempt": self.attempt, "measured_indices": self.measured_indices}


@dataclass
class Continuation:
    """Earlier segments of a cell, oldest first, and the measured indices they already hold."""

    cell_id: str
    chain: list[Segment] = field(default_factory=list)

    @property
    def done(self) -> set[int]:
        return {i for segment in self.chain for i in segment.measured_indices}


def measured_indices(reps: list[dict[str, Any]]) -> list[int]:
    """Measured index of each non-warmup repetition (old files: their order within the attempt)."""
    measured = [r for r in reps if not r.get("warmup")]
    return [r.get("measured_index", position) for position, r in enumerate(measured)]


def continuable_files(backend_dir: str | Path, current: Path | None = None) -> list[tuple[Path, list[dict[str, Any]]]]:
    """The readable raw files of one backend that a worker may continue from (path, records), in name
    order: a file another process is writing right now is not ours to continue (`current`, our own, is)."""
    files = []
    for path in sorted(Path(backend_dir).glob("*.jsonl")):
        is_current = current is not None and path.resolve() == Path(current).resolve()
        if not is_current and live_holder(path) is not None:
            continue
        try:
            records, _ = read_raw(path)
        except RawFileError:
            continue
        files.append((path, records))
    return files


def find_continuations(backend_dir: str | Path, identity_sha256: str, cells: list[str],
                       current: Path | None = None,
                       files: list[tuple[Path, list[dict[str, Any]]]] | None = None) -> dict[str, Continuation]:
    """For each cell, the chain to continue (only cells whose latest attempt is a valid partial). `files`:
    `continuable_files(backend_dir, current)` already read (a caller asking under several identities)."""
    attempts: dict[str, list[dict[str, Any]]] = {}
    for path, records in continuable_files(backend_dir, current) if files is None else files:
        if not records or records[0].get("measurement_identity_sha256") != identity_sha256:
            continue
        run_id = records[0].get("run_id", path.stem)
        by_key: dict[tuple[str, int], dict[str, Any]] = {}
        for record in records:
            kind = record.get("record")
            key = (record.get("cell_id"), record.get("attempt"))
            if kind == "cell_start" and key[0] in cells:
                by_key[key] = {"run_id": run_id, "start": record, "reps": [], "end": None}
            elif key in by_key and kind == "repetition":
                by_key[key]["reps"].append(record)
            elif key in by_key and kind in ("cell_complete", "cell_suspended"):
                by_key[key]["end"] = record
        for (cell_id, _), entry in by_key.items():
            attempts.setdefault(cell_id, []).append(entry)
    out = {}
    for cell_id, entries in attempts.items():
        latest = max(entries, key=lambda e: (e["start"].get("utc", ""), e["run_id"], e["start"]["attempt"]))
        end = latest["end"]
        if end is not None and end.get("record") == "cell_complete":
            continue  # completed or failed: nothing to continue (a failed cell starts over)
        measured = [r for r in latest["reps"] if not r.get("warmup")]
        if any(not r.get("valid") for r in measured):
            continue  # an invalid repetition is not carried forward: the cell starts over
        chain = [Segment(s["run_id"], s["attempt"], list(s["measured_indices"]))
                 for s in latest["start"].get("continues", [])]
        own = measured_indices(latest["reps"])
        if own:
            chain.append(Segment(latest["run_id"], latest["start"]["attempt"], own))
        if chain:
            out[cell_id] = Continuation(cell_id, chain)
    return out
