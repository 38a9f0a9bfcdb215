"""Campaign driver: what is still missing, scheduled longest-first over GPU slots, one measuring
process per GPU, bounded by a deadline, resumable across GPU jobs.

    rollout campaign plan   --campaign h200-v2 --backend hf_reference --gpus 2 --deadline-s 1500
    rollout campaign run    --campaign h200-v2 --backend hf_reference --deadline-s 1500 [--detach]
    rollout campaign run    --campaign h200-v2 --backend hf_reference --deadline-s 1500 --executor ray --address auto
    rollout campaign status --campaign h200-v2 [--backend hf_reference]

`run` reads the cells still to measure (the frozen calculator's definition, as `rollout missing`),
estimates each (a prior per backend, calibrated by the median observed/prior ratio of earlier raw
files on the same GPU model) and plans them longest-first onto the least-loaded GPU slot. Each slot gets
one `rollout measure --direct` process (its own run id and raw file, the deadline and the estimates),
started by an executor (`executors.py`): `local` (one GPU of this machine via CUDA_VISIBLE_DEVICES, or
its CPU; no Ray) or `ray` (a Ray task with num_gpus=1 per slot, on any node of a Ray cluster; more than
one GPU always runs there, DESIGN decision 14). The runner starts no repetition that would end after the
deadline and leaves a cut cell as a segment that the next job continues; a Ray worker lost mid-cell is
sealed by the driver and its unfinished cells continued by a replacement. The driver itself never touches
CUDA (a CUDA context in it would be a foreign GPU process to the workers' NVML check).

State lives in `<output-dir>/campaigns/<campaign>/<backend>-driver-<stamp>.json` (workers, pids,
plan, executor and Ray cluster; one file per driver run), logs beside it and, for Ray workers, the
worker records (node, GPU) under `workers/`; `status` reads those and the raw files: done / running /
to-measure cells, the current cell and repetition of each worker, and an ETA. `--detach` starts the
driver in its own process session (it outlives the command that started it) and returns at once.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rollout_lib.campaign.executors import (
    EXECUTORS,
    ExecutorError,
    LocalExecutor,
    RayExecutor,
    WorkerJob,
    worker_record_path,
)
from rollout_lib.campaign.identity_probe import identity_differences, probe
from rollout_lib.campaign.schedule import (
    COLD_START_S,
    DEFAULT_COLD_START_S,
    Assignment,
    CellCost,
    Plan,
    calibration_ratio,
    forecast,
    model_repetition_s,
    overrun_tolerance,
    plan,
    repetitions_started,
)
from rollout_lib.core import REPO_ROOT, write_json_atomic
from rollout_lib.evidence.publish import campaign_cells
from rollout_lib.measure.campaign_files import continuable_files, find_continuations
from rollout_lib.measure.rawfile import RawFileError, live_holder, read_raw, read_seals, seal_abandoned
from rollout_lib.study.prereg import Preregistration
from rollout_lib.study.workload import Workload

POLL_S = 5.0
MODE_CALIBRATION_MIN = 3  # repetitions of one sampling mode before it gets its own ratio


def _utc_stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def campaign_dir(output_dir: Path, campaign: str) -> Path:
    return Path(output_dir) / "campaigns" / campaign


def state_path(output_dir: Path, campaign: str, backend: str, stamp: str) -> Path:
    """One state file per driver run: two drivers (one per GPU set) never overwrite each other."""
    return campaign_dir(output_dir, campaign) / f"{backend}-driver-{stamp}.json"


def visible_gpus() -> list[int]:
    """GPU indices this machine shows (NVML, no CUDA context); [] on a CPU-only machine."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [int(x) for x in env.split(",") if x.strip().isdigit()]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return list(range(pynvml.nvmlDeviceGetCount()))
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return []


def local_gpu_name() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            return name.decode() if isinstance(name, bytes) else name
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def _raw_records(path: Path) -> list[dict[str, Any]]:
    try:
        return read_raw(path)[0]
    except (OSError, RawFileError):
        return []


def backend_dir_of(output_dir: Path, campaign: str, backend: str) -> Path:
    """Where one backend's raw files of a campaign live: <output-dir>/raw/<campaign>/<backend>."""
    return Path(output_dir) / "raw" / campaign / backend


def backend_raw_files(backend_dir: Path) -> list[list[dict[str, Any]]]:
    """The records of each readable, non-empty raw file of one backend, in name (run id) order."""
    return [records for records in map(_raw_records, sorted(backend_dir.glob("*.jsonl"))) if records]


def estimate_costs(study: Preregistration, backend: str, cells: list[str], files: list[list[dict[str, Any]]],
                   identity_sha256: str | None = None,
                   by_sampling_mode: bool = True) -> tuple[list[CellCost], dict[str, Any]]:
    """Per cell: seconds per measured repetition, per warmup, and the repetitions still to do; `files` are
    the records of this campaign's raw files of this backend. A cell with measured repetitions under
    `identity_sha256` (the one the workers will have; any, without it) is estimated from them (their
    median; its warmups likewise, if it has any); any other cell from the backend's prior x the median
    observed/prior ratio of this campaign's repetitions, its warmup x the median warmup/measured ratio
    of this campaign's segments (at least 1). The observed/prior ratio is taken over the cell's sampling
    mode alone once that mode has `MODE_CALIBRATION_MIN` repetitions: the prior misses the oracle's greedy
    and stochastic paths in opposite directions (h200-v2 after lease 16: x 0.86 and x 1.07).
    `by_sampling_mode=False`: one ratio for all (tools/backtest_estimates.py compares the two)."""
    workload = Workload(study)
    rows = study.workload.logical_prompts
    warmups, measured = study.protocol.warmup_repetitions, study.protocol.measured_repetitions

    def prior(cell_id: str) -> float:
        cell = workload.cell(cell_id)
        return model_repetition_s(backend, cell.prompt_tokens, cell.response_tokens,
                                  rows * cell.samples_per_prompt, cell.sampling.name)

    def mode(cell_id: str) -> str:
        return workload.cell(cell_id).sampling.name

    # calibrated on this campaign's own repetitions only: other campaigns (a pilot on older code)
    # may have run a different measurement path on the same GPU model
    gpu_name = local_gpu_name()
    pairs: dict[str, list[tuple[float, float]]] = {}  # sampling mode -> (observed, prior)
    warmup_ratios: list[float] = []  # warm-up / measured median, per segment
    sources: set[str] = set()
    own: dict[str, dict[str, list[float]]] = {}
    known = set(workload.cell_ids())
    for records in files:
        same_identity = identity_sha256 is None or records[0].get("measurement_identity_sha256") == identity_sha256
        segments: dict[str, dict[str, list[float]]] = {}
        for record in records:
            if record.get("record") == "repetition" and record.get("wall_s") and record.get("cell_id") in known:
                pairs.setdefault(mode(record["cell_id"]), []).append((record["wall_s"], prior(record["cell_id"])))
                sources.add(records[0].get("run_id"))
                kind = "warmup" if record.get("warmup") else "measured"
                segments.setdefault(record["cell_id"], {"warmup": [], "measured": []})[kind].append(record["wall_s"])
        for cell_id, walls in segments.items():
            if walls["warmup"] and walls["measured"]:
                warmup_ratios.append(walls["warmup"][0] / statistics.median(walls["measured"]))
            if same_identity:
                mine = own.setdefault(cell_id, {"warmup": [], "measured": []})
                mine["warmup"] += walls["warmup"]
                mine["measured"] += walls["measured"]
    all_pairs = [pair for mode_pairs in pairs.values() for pair in mode_pairs]
    ratio = calibration_ratio(all_pairs)
    warmup_ratio = max(1.0, statistics.median(warmup_ratios)) if warmup_ratios else 1.0
    ratio_by_mode = {m: {"ratio": calibration_ratio(p), "repetitions": len(p)}
                     for m, p in sorted(pairs.items()) if by_sampling_mode and len(p) >= MODE_CALIBRATION_MIN}
    costs, from_own = [], []
    for cell_id in cells:
        walls = own.get(cell_id, {"warmup": [], "measured": []})
        if walls["measured"]:
            from_own.append(cell_id)
            repetition_s = statistics.median(walls["measured"])
        else:
            repetition_s = prior(cell_id) * ratio_by_mode.get(mode(cell_id), {"ratio": ratio})["ratio"]
        warmup_s = statistics.median(walls["warmup"]) if walls["warmup"] else repetition_s * warmup_ratio
        costs.append(CellCost(cell_id, repetition_s, warmups + measured, warmup_s))
    return costs, {"calibration_ratio": ratio, "calibration_repetitions": len(all_pairs),
                   "calibration_by_sampling": ratio_by_mode,
                   "calibration_gpu": gpu_name, "calibration_files": sorted(sources),
                   "warmup_ratio": warmup_ratio, "warmup_segments": len(warmup_ratios),
                   "cells_from_own_repetitions": from_own}


def past_job_overruns(output_dir: Path, campaign: str, backend: str,
                      files: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per earlier `campaign run` job of this backend whose driver file keeps its plan's estimates, oldest
    first: {"job", "overrun", "repetitions"}, overrun = the sum of its repetitions' walls over the sum of
    the estimates it was planned with (warm-ups against the warm-up estimates where the plan recorded
    them, measured repetitions only before that). `files`: the backend's raw files' records. The oracle's
    jobs ran 0.81-1.32x their plans over leases 13-18 on one GPU kind, far more than one plan's safety
    margin absorbs: `campaign plan` sets this record beside each plan's overrun tolerance."""
    by_run = {records[0].get("run_id"): records for records in files if records}
    jobs = []
    for path in sorted(campaign_dir(output_dir, campaign).glob(f"{backend}-driver-*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):  # a driver killed while writing it: no plan to compare with
            continue
        plan_json = state.get("plan") or {}
        estimates = plan_json.get("estimates_s") or {}
        warmup_estimates = plan_json.get("warmup_estimates_s")
        walls_s = estimated_s = 0.0
        count = 0
        for worker in state.get("workers") or []:
            for record in by_run.get(worker.get("run_id"), []):
                if record.get("record") != "repetition" or not record.get("wall_s"):
                    continue
                table = (warmup_estimates or {}) if record.get("warmup") else estimates
                estimate = table.get(record.get("cell_id"))
                if not estimate:
                    continue
                walls_s += record["wall_s"]
                estimated_s += estimate
                count += 1
        if count:
            jobs.append({"job": path.stem.removeprefix(f"{backend}-driver-"), "overrun": walls_s / estimated_s,
                         "repetitions": count})
    return jobs


def own_identity(study: Preregistration, backend: str, gpu: str | None = None,
                 timeout_s: float = 300) -> dict[str, Any]:
    """{"sha256", "key", "source"}: the measurement identity a worker on this machine will have, from
    `rollout_lib.campaign.identity_probe` in a subprocess (on `gpu` via CUDA_VISIBLE_DEVICES; it exits
    before any worker starts, so this process never holds a CUDA context); sha256 None and why if it
    fails."""
    return probe(study.source_path, backend, gpu, timeout_s)


class IdentityMismatch(ValueError):
    """This machine's measurement identity is not the one a campaign job was told to continue under."""


def require_identity(identity: dict[str, Any], expected_prefix: str | None) -> None:
    """Refuse (`IdentityMismatch`, nothing started) unless `identity` (`own_identity`'s) has a SHA-256 that
    starts with `expected_prefix`; no-op without a prefix. A job meant to continue cut cells under a known
    identity (the oracle's repetitions of lease 10 wait under the one with vLLM staged) would otherwise
    measure them afresh under another one and split them a second time."""
    if expected_prefix is None:
        return
    found = identity.get("sha256")
    if not found:
        raise IdentityMismatch(f"expect-identity: {expected_prefix} required, but this machine's measurement "
                               f"identity is unknown ({identity.get('source')}); nothing was started")
    if not found.startswith(expected_prefix):
        raise IdentityMismatch(f"expect-identity: {expected_prefix} required, this machine's measurement identity "
                               f"is {found[:10]} ({identity.get('source')}); nothing was started")


def make_plan(study: Preregistration, campaign: str, backend: str, output_dir: Path, gpus: int,
              deadline_s: float, cells: list[str] | None = None,
              identity: dict[str, Any] | None = None, lease_s: float | None = None) -> tuple[Plan, dict[str, Any]]:
    """The schedule of the cells still to measure. A cell cut off earlier costs only its remaining
    repetitions (plus a warmup) when its segments share the measurement identity a worker here will have:
    `identity` (`own_identity`: sha256, key and where it came from); without one the newest raw
    file's stands in for it (the worker decides exactly at run time). `lease_s`: see `schedule.plan`."""
    todo = cells if cells is not None else campaign_cells(study, campaign, output_dir)[backend]["to_measure"]
    backend_dir = backend_dir_of(output_dir, campaign, backend)
    files = backend_raw_files(backend_dir)
    headers = [records[0] for records in files]
    if identity is None or not identity.get("sha256"):
        newest = headers[-1] if headers else {}
        identity = {"sha256": newest.get("measurement_identity_sha256"),
                    "key": newest.get("measurement_identity") or {},
                    "source": "the newest raw file's" + (f" ({identity['source']})" if identity else "")}
    costs, calibration = estimate_costs(study, backend, todo, files, identity["sha256"])
    calibration["identity"] = {"sha256": identity["sha256"], "source": identity["source"]}
    calibration["stranded"] = []
    calibration["past_jobs"] = past_job_overruns(output_dir, campaign, backend, files)
    if identity["sha256"]:
        partial = find_continuations(backend_dir, identity["sha256"], todo)
        warmups, measured = study.protocol.warmup_repetitions, study.protocol.measured_repetitions
        costs = [replace(c, repetitions_left=warmups + measured - len(partial[c.cell_id].done))
                 if c.cell_id in partial else c for c in costs]
        calibration["stranded"] = segments_under_other_identities(backend_dir, identity, headers, todo)
    cold = COLD_START_S.get(backend, DEFAULT_COLD_START_S)
    return plan(costs, gpus=gpus, budget_s=deadline_s, cold_start_s=cold,
                warmups=study.protocol.warmup_repetitions, lease_s=lease_s), calibration


def plan_on_this_machine(study: Preregistration, campaign: str, backend: str, output_dir: Path, gpus: int | None,
                         deadline_s: float, cells: list[str] | None = None, expect_identity: str | None = None,
                         visible: list[int] | None = None, lease_s: float | None = None,
                         as_identity: dict[str, Any] | None = None) -> tuple[Plan, dict[str, Any]]:
    """`make_plan` for `gpus` (default: every visible one, at least 1) under the identity a worker here will
    have (`own_identity`, probed on the first visible GPU), refused first (`require_identity`) unless it
    begins with `expect_identity`; or under `as_identity` (`identity_of_raw_files`: `campaign plan
    --as-identity`, no probe). What `campaign plan` prints and `campaign run` starts."""
    visible = visible_gpus() if visible is None else visible
    if as_identity is not None:
        identity = as_identity
    else:
        identity = own_identity(study, backend, str(visible[0]) if visible else None)
        require_identity(identity, expect_identity)
    return make_plan(study, campaign, backend, output_dir, gpus or max(1, len(visible)), deadline_s, cells,
                     identity, lease_s)


def identity_of_raw_files(output_dir: Path, campaign: str, backend: str, prefix: str) -> dict[str, Any]:
    """The measurement identity (`own_identity`'s shape) of this backend's raw files whose SHA-256 begins with
    `prefix`: `campaign plan --as-identity` costs continuations as a worker with it would (a machine that
    cannot have it, a CPU, can still plan a lease). ValueError naming the identities found otherwise."""
    found = _identities([records[0] for records in backend_raw_files(backend_dir_of(output_dir, campaign, backend))])
    matching = [sha for sha in found if sha.startswith(prefix)]
    if len(matching) != 1:
        known = ", ".join(sha[:10] for sha in sorted(found)) or "none"
        raise ValueError(f"as-identity: {prefix} {'matches no' if not matching else 'matches more than one'} "
                         f"measurement identity of {campaign}/{backend}'s raw files; allowed: {known}")
    return {"sha256": matching[0], "key": found[matching[0]], "source": "--as-identity (a raw file's)"}


def forecast_plans(the_plan: Plan, lease_s: float, overrun: float = 1.0) -> tuple[list[Plan], list[str]]:
    """`schedule.forecast` from a plan's costs (this lease's budget first, then whole leases of `lease_s`);
    `overrun`: every repetition (and so every estimate) that factor longer, as if the plans knew the host."""
    costs = [replace(c, repetition_s=c.repetition_s * overrun,
                     warmup_s=None if c.warmup_s is None else c.warmup_s * overrun) for c in the_plan.costs.values()]
    return forecast(costs, gpus=len(the_plan.assignments), lease_s=lease_s, cold_start_s=the_plan.cold_start_s,
                    warmups=the_plan.warmups, first_budget_s=the_plan.budget_s)


def format_forecast_at_past_overruns(the_plan: Plan, lease_s: float, jobs: list[dict[str, Any]]) -> str | None:
    """How many leases the forecast needs if every repetition runs as far over its estimate as the earlier
    jobs' median and their worst (`past_job_overruns`); None without earlier jobs."""
    if not jobs:
        return None
    factors = [job["overrun"] for job in jobs]
    parts = []
    for label, factor in (("median", statistics.median(factors)), ("worst", max(factors))):
        plans, never = forecast_plans(the_plan, lease_s, factor)
        cut = sum(len(a.partial) for lease in plans for a in lease.assignments)
        parts.append(f"at their {label} x {factor:.2f}, {len(plans)} lease(s), {cut} segment(s) cut"
                     + (f", never fits: {', '.join(never)}" if never else ""))
    return f"  if the walls run as the {len(jobs)} earlier job(s) did: " + "; ".join(parts)


def format_forecast(plans: list[Plan], never: list[str], lease_s: float) -> str:
    """One line per lease: what each GPU measures (a cut cell with its measured repetitions)."""
    lines = [f"forecast, if the estimates hold: {len(plans)} lease(s), this one and then {lease_s:.0f} s each"]
    warmups_repeated = 0
    for number, lease in enumerate(plans, 1):
        for a in lease.assignments:
            cells = [f"{c} ({a.partial[c]} measured, cut)" if c in a.partial else c for c in a.cells]
            warmups_repeated += len(a.partial)
            lines.append(f"  lease {number} GPU {a.gpu}: {a.planned_s:.0f} s: {', '.join(cells) or 'nothing'}")
    lines.append(f"  segments cut at a lease's end (each repeats its warm-up in the next): {warmups_repeated}")
    if never:
        lines.append(f"  never fits a lease (not even a warm-up + one measured repetition): {', '.join(never)}")
    return "\n".join(lines)


def _identities(headers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Measurement identity SHA-256 -> its key, over raw headers oldest first (the newest of each wins)."""
    return {h["measurement_identity_sha256"]: h.get("measurement_identity") or {}
            for h in headers if h.get("measurement_identity_sha256")}


def segments_under_other_identities(backend_dir: Path, identity: dict[str, Any], headers: list[dict[str, Any]],
                                    todo: list[str]) -> list[dict[str, Any]]:
    """Measured repetitions of to-do cells that wait under a measurement identity other than `identity`
    (`{"sha256", "key"}`: the one the plan takes for this machine's), with what differs: a worker with
    `identity` cannot continue them and measures those cells afresh. Lease 10's oracle ran with vLLM
    staged (`packages.vllm` 0.26.0, earlier leases: absent), which stranded three cut cells' repetitions."""
    identities = _identities(headers)
    mine = identity.get("key") or {}
    others = [sha for sha in sorted(identities) if sha != identity["sha256"]]
    return [{"cell_id": cell_id, "measured_repetitions": count, "identity_sha256": other,
             "differs": identity_differences(identities[other], mine)}
            for other, cell_id, count in _cut_segments(backend_dir, others, todo)]


def waiting_repetitions(output_dir: Path, campaign: str, backend: str,
                        todo: list[str]) -> dict[str, list[tuple[str, int]]]:
    """Per to-do cell, the measured repetitions its cut segments hold, per measurement identity (SHA-256,
    count): what a worker under that identity continues instead of measuring again."""
    backend_dir = backend_dir_of(output_dir, campaign, backend)
    headers = [records[0] for records in backend_raw_files(backend_dir)]
    out: dict[str, list[tuple[str, int]]] = {}
    for identity_sha256, cell_id, count in _cut_segments(backend_dir, sorted(_identities(headers)), todo):
        out.setdefault(cell_id, []).append((identity_sha256, count))
    return out


def _cut_segments(backend_dir: Path, identities: list[str], todo: list[str]) -> list[tuple[str, str, int]]:
    """(identity, cell, measured repetitions) of each to-do cell's continuable segments under each identity."""
    files = continuable_files(backend_dir)  # read once, asked once per identity
    return [(identity_sha256, cell_id, len(continuation.done))
            for identity_sha256 in identities
            for cell_id, continuation in sorted(find_continuations(backend_dir, identity_sha256, todo,
                                                                   files=files).items())
            if continuation.done]


def _short(differences: list[str], most: int = 3) -> str:
    if not differences:
        return "no field differs"
    more = len(differences) - most
    return "; ".join(differences[:most]) + (f"; and {more} more" if more > 0 else "")


def _past_jobs_line(the_plan: Plan, assignment: Assignment, jobs: list[dict[str, Any]]) -> str | None:
    """How this GPU's plan would have fared at each earlier job's overrun (`past_job_overruns`)."""
    if not assignment.cells or not jobs:
        return None
    factors = [job["overrun"] for job in jobs]
    replays = [repetitions_started(the_plan, assignment, factor) for factor in factors]
    whole = sum(started >= planned for started, planned in replays)
    worst = max(factors)
    started, planned = replays[factors.index(worst)]
    return (f"  earlier jobs ran x {min(factors):.2f}-{worst:.2f} their estimates (median x "
            f"{statistics.median(factors):.2f}, {len(jobs)} job(s)); at each job's factor every planned repetition "
            f"starts in {whole} of {len(jobs)}; at x {worst:.2f}, {started} of {planned} start")


def format_plan(the_plan: Plan, calibration: dict[str, Any]) -> str:
    gpu = calibration["calibration_gpu"] or "this machine"
    own = calibration.get("cells_from_own_repetitions") or []
    by_mode = "".join(f"; {m} x {v['ratio']:.3f} over {v['repetitions']}"
                      for m, v in (calibration.get("calibration_by_sampling") or {}).items())
    lines = [f"estimates: prior x {calibration['calibration_ratio']:.3f} (median observed/prior over "
             f"{calibration['calibration_repetitions']} repetitions of this campaign"
             f"{by_mode}; GPU {gpu}); "
             f"{len(own)} cell(s) from their own measured repetitions (marked *); warm-up x "
             f"{calibration.get('warmup_ratio', 1.0):.2f} where a cell has none (median warm-up/measured over "
             f"{calibration.get('warmup_segments', 0)} segments)",
             f"budget {the_plan.budget_s:.0f} s per GPU, cold start {the_plan.cold_start_s:.0f} s"
             + (f", a whole lease {the_plan.lease_s:.0f} s" if the_plan.lease_s is not None else "")]
    warmups = the_plan.warmups
    for a in the_plan.assignments:
        tolerance = overrun_tolerance(the_plan, a)
        lines.append(f"GPU {a.gpu}: {len(a.cells)} cell(s), planned {a.planned_s:.0f} s" + (
            "" if tolerance is None else
            f"; every planned repetition starts if they run at most {tolerance - 1:.1%} over their estimates"
            if tolerance < 2.0 else "; every planned repetition starts even at twice its estimate"))
        history = _past_jobs_line(the_plan, a, calibration.get("past_jobs") or [])
        if history:
            lines.append(history)
        for cell_id in a.cells:
            cost = the_plan.costs[cell_id]
            measured_left = cost.repetitions_left - warmups
            measured_now = a.partial.get(cell_id, measured_left)
            fill = "; fills the job's end, a whole lease would hold it" if cell_id in a.fillers else ""
            note = f" (cut: {measured_now} of {measured_left} measured fit{fill})" if cell_id in a.partial else ""
            mark = "*" if cell_id in own else ""
            lines.append(f"  {cell_id + mark:28s} warm-up {warmups} x {cost.first_s:6.1f} s + {measured_now} x "
                         f"{cost.repetition_s:6.1f} s = {cost.seconds(warmups + measured_now, warmups):7.1f} s{note}")
    if the_plan.unscheduled:
        lines.append(f"not this lease ({len(the_plan.unscheduled)}): {', '.join(the_plan.unscheduled)}")
    chosen = calibration.get("identity") or {}
    if chosen.get("sha256"):
        lines.append(f"continuations: measurement identity {chosen['sha256'][:10]}, {chosen['source']}")
    stranded = calibration.get("stranded") or []
    if stranded:
        lines.append("WARNING: measured repetitions wait under another measurement identity; a worker with the "
                     "one above cannot continue them and measures these cells afresh:")
        for entry in stranded:
            lines.append(f"  {entry['cell_id']:28s} {entry['measured_repetitions']} measured rep(s) under "
                         f"{entry['identity_sha256'][:10]}: {_short(entry['differs'])}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# run / status
# ------------------------------------------------------------------------------------------

def _worker_command(study_path: str, campaign: str, backend: str, output_dir: Path, run_id: str, cells: list[str],
                    deadline_unix: float, estimates: dict[str, float], device: str,
                    warmup_estimates: dict[str, float] | None = None) -> list[str]:
    return [sys.executable, "-m", "rollout_lib.cli", "measure", "--direct", "--backend", backend,
            "--params", study_path, "--campaign", campaign, "--output-dir", str(output_dir), "--run-id", run_id,
            "--cells", ",".join(cells), "--deadline-unix", repr(deadline_unix),
            "--estimates-json", json.dumps(estimates, sort_keys=True)] + (
                ["--warmup-estimates-json", json.dumps(warmup_estimates, sort_keys=True)] if warmup_estimates else []
            ) + (["--device", device] if device else [])


def resolve_executor(executor: str | None, gpus: int | None, visible: list[int]) -> str:
    """`local` for one GPU (or the CPU), `ray` for more (DESIGN decision 14); an explicit choice is kept,
    `local` with more than one GPU is refused (no home-made multi-GPU scheduling)."""
    if executor is not None and executor not in EXECUTORS:
        raise ValueError(f"executor: {executor!r} is not allowed; allowed: {', '.join(EXECUTORS)}")
    wanted = gpus if gpus is not None else (len(visible) if executor is None else None)
    if executor is None:
        return "ray" if wanted is not None and wanted > 1 else "local"
    if executor == "local" and wanted is not None and wanted > 1:
        raise ValueError(f"gpus: {wanted} with --executor local is not allowed; the local executor runs one GPU, "
                         "more than one GPU runs on Ray: --executor ray (--gpus 1 to use one of them here)")
    return executor


MAX_REPLACEMENTS_PER_SLOT = 2  # a slot whose workers keep dying is left to the next job
REPLACEMENT_MARGIN_S = 60.0  # no replacement this close to the deadline: it could not even warm up


def run_campaign(study: Preregistration, campaign: str, backend: str, output_dir: Path, *, gpus: int | None,
                 deadline_s: float, cells: list[str] | None = None, progress: bool = True,
                 expect_identity: str | None = None, lease_s: float | None = None,
                 executor: str | None = None, address: str | None = None) -> int:
    """Plan, start one worker per GPU, wait for them; returns 0 when every worker exited 0 (a lost Ray
    worker whose cells a replacement took over counts by its replacement).

    `executor`: `local` (one GPU of this machine, or its CPU; no Ray) or `ray` (one Ray task with num_gpus=1
    per GPU of the cluster at `address`; `resolve_executor` picks when None). `expect_identity` (a hex
    prefix): refuse before anything starts unless the workers' measurement identity begins with it
    (`require_identity`)."""
    output_dir = Path(os.path.abspath(output_dir))  # the workers run in the package's tree
    visible = visible_gpus()
    executor = resolve_executor(executor, gpus, visible)
    started = time.time()
    deadline_unix = started + deadline_s
    folder = campaign_dir(output_dir, campaign)
    if executor == "local":
        count = gpus or 1
        if visible and count > len(visible):
            raise ValueError(f"gpus: {count} requested, {len(visible)} visible ({visible})")
        the_plan, calibration = plan_on_this_machine(study, campaign, backend, output_dir, count, deadline_s, cells,
                                                     expect_identity, visible, lease_s)
        runner: Any = LocalExecutor(visible)
    else:
        runner = RayExecutor(address, folder, os.path.abspath(study.source_path), backend)
        try:
            the_plan, calibration = _plan_on_ray(runner, study, campaign, backend, output_dir, gpus, deadline_s,
                                                 cells, expect_identity, lease_s)
        except BaseException:
            runner.close()
            raise
    try:
        return _run_workers(runner, the_plan, calibration, study, campaign, backend, output_dir, folder, started,
                            deadline_unix, progress)
    finally:
        runner.close()


def _plan_on_ray(runner: RayExecutor, study: Preregistration, campaign: str, backend: str, output_dir: Path,
                 gpus: int | None, deadline_s: float, cells: list[str] | None, expect_identity: str | None,
                 lease_s: float | None) -> tuple[Plan, dict[str, Any]]:
    """Connect, size the plan to the cluster's GPUs, plan under the identity a Ray worker has there."""
    runner.connect()
    available = runner.cluster_gpus()
    if available < 1:
        raise ExecutorError(f"executor: the Ray cluster at {runner.context.get('gcs_address')} has no GPU "
                            "resources; start its nodes with their GPUs (ray start ... --num-gpus N)")
    count = gpus or available
    if count > available:
        raise ValueError(f"gpus: {count} requested, the Ray cluster has {available}")
    identity = runner.probe_identity()
    identity["source"] = f"a Ray worker's on {identity.get('where', {}).get('hostname')} (identity probe)"
    require_identity(identity, expect_identity)
    runner.prepare(identity)
    return make_plan(study, campaign, backend, output_dir, count, deadline_s, cells, identity, lease_s)


def _public(worker: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in worker.items() if not k.startswith("_")}


def _run_workers(runner: Any, the_plan: Plan, calibration: dict[str, Any], study: Preregistration, campaign: str,
                 backend: str, output_dir: Path, folder: Path, started: float, deadline_unix: float,
                 progress: bool) -> int:
    print(format_plan(the_plan, calibration), flush=True)
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    stamp = _utc_stamp()
    estimates = {c: round(cost.repetition_s, 3) for c, cost in the_plan.costs.items()}
    warmup_estimates = {c: round(cost.first_s, 3) for c, cost in the_plan.costs.items()}
    study_path = os.path.abspath(study.source_path)
    workers: list[dict[str, Any]] = []

    def launch(slot: int, run_id: str, cells: list[str], replaces: str | None = None) -> None:
        log = folder / "logs" / f"{backend}-{run_id}.log"
        raw_file = str(backend_dir_of(output_dir, campaign, backend) / f"{run_id}.jsonl")
        command = _worker_command(study_path, campaign, backend, output_dir, run_id, cells, deadline_unix,
                                  {c: estimates[c] for c in cells}, "", {c: warmup_estimates[c] for c in cells})
        job = WorkerJob(slot=slot, run_id=run_id, cells=cells, command=command, raw_file=raw_file, log=str(log),
                        record=str(worker_record_path(folder, backend, run_id)))
        handle = runner.start(job)
        worker = {"gpu": slot, "pid": handle.get("pid"), "run_id": run_id, "cells": cells, "raw_file": raw_file,
                  "log": str(log), "returncode": None, "_handle": handle, "_done": False}
        if runner.name != "local":
            worker |= {"executor": runner.name, "record": job.record, "replaces": replaces}
        workers.append(worker)

    for assignment in the_plan.assignments:
        if assignment.cells:
            launch(assignment.gpu, f"{stamp}-g{assignment.gpu}", assignment.cells)
    state = {"campaign": campaign, "backend": backend, "driver_pid": os.getpid(), "host": socket.gethostname(),
             "started_unix": started,
             "deadline_unix": deadline_unix, "plan": the_plan.to_json(), "calibration": calibration,
             "workers": [_public(w) for w in workers]}
    if runner.name != "local":
        state |= runner.describe()
    path = state_path(output_dir, campaign, backend, stamp)
    _write_state(path, state)

    def forward(signum, _frame):  # the workers stop at a repetition boundary's worth: teardown + seal
        for worker in workers:
            if not worker["_done"]:
                runner.stop(worker["_handle"])

    def finish(worker: dict[str, Any], result: dict[str, Any]) -> None:
        worker["_done"] = True
        worker["returncode"] = result.get("returncode")
        for key in ("ended", "lost", "refused"):
            if result.get(key):
                worker[key] = result[key]
        _merge_worker_record(worker)
        if result.get("lost") and runner.replaces_lost_workers:
            replace_lost(worker)

    def replace_lost(worker: dict[str, Any]) -> None:
        """Seal a lost worker's raw file and continue its unfinished cells (its cut cell as a segment)."""
        slot = worker["gpu"]
        replaced = sum(1 for w in workers if w["gpu"] == slot and w.get("replaces"))
        raw = Path(worker["raw_file"])
        finished = {c for c, _ in worker_progress(raw)["done"]}
        remaining = [c for c in worker["cells"] if c not in finished]
        worker["sealed"] = seal_lost_raw_file(raw, f"campaign worker lost ({worker['lost'][:200]})")
        if not remaining or replaced >= MAX_REPLACEMENTS_PER_SLOT:
            return
        if time.time() > deadline_unix - REPLACEMENT_MARGIN_S:
            return
        worker["replaced_by"] = f"{stamp}-g{slot}-r{replaced + 1}"
        launch(slot, worker["replaced_by"], remaining, replaces=worker["run_id"])

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    total = sum(len(w["cells"]) for w in workers)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=f"{campaign}/{backend}: cells", unit="cell", disable=None)
    try:
        while not all(w["_done"] for w in workers):
            time.sleep(POLL_S)
            for w in list(workers):
                if not w["_done"]:
                    result = runner.poll(w["_handle"])
                    if result is not None:
                        finish(w, result)
                    elif runner.name != "local":
                        _merge_worker_record(w)
            seen = [worker_progress(Path(w["raw_file"])) for w in workers]  # each file read once a poll
            if bar is not None:
                bar.n = len({cell for p in seen for cell, _ in p["done"]})
                bar.set_postfix_str(" | ".join(f"g{w['gpu']}:{p['cell'] or '-'} {p['repetition'] or ''}".strip()
                                               for w, p in zip(workers, seen, strict=True) if not w["_done"]))
                bar.refresh()
            state["workers"] = [_public(w) for w in workers]
            _write_state(path, state)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if bar is not None:
            bar.close()
    state["workers"] = [_public(w) for w in workers]
    state["finished_unix"] = time.time()
    _write_state(path, state)
    for w in workers:
        if runner.name == "local":
            print(f"GPU {w['gpu']}: exit {w['returncode']}; raw file {w['raw_file']}; log {w['log']}", flush=True)
        else:
            how = (f"refused: {w['refused']}" if w.get("refused") else f"lost: {w['lost']}" if w.get("lost")
                   else f"exit {w['returncode']}")
            print(f"worker {w['run_id']} ({_where_text(w)}): {how}"
                  + (f"; continued by {w['replaced_by']}" if w.get("replaced_by") else "")
                  + f"; raw file {w['raw_file']}; log {w['log']}", flush=True)
    return 0 if all(w["returncode"] == 0 or w.get("replaced_by") for w in workers) else 1


def _merge_worker_record(worker: dict[str, Any]) -> None:
    """A Ray worker's node, GPU and measuring pid, from the record it wrote (`ray_worker.measure_slot`)."""
    record_path = worker.get("record")
    if not record_path:
        return
    try:
        record = json.loads(Path(record_path).read_text())
    except (OSError, ValueError):
        return
    worker["node"] = {k: record.get(k) for k in ("hostname", "node_ip", "node_id")}
    worker["gpu_ids"] = record.get("ray_gpu_ids")
    worker["cuda_visible_devices"] = record.get("cuda_visible_devices")
    worker["pid"] = record.get("measuring_pid", worker.get("pid"))
    worker["ray_worker_pid"] = record.get("worker_pid")


def _where_text(worker: dict[str, Any]) -> str:
    node = worker.get("node") or {}
    gpus = ",".join(worker.get("gpu_ids") or []) or "?"
    return (f"{worker.get('executor', 'local')} on {node.get('hostname') or '?'} ({node.get('node_ip') or '?'}) "
            f"GPU {gpus}")


def seal_lost_raw_file(raw: Path, reason: str, wait_s: float = 30.0) -> str:
    """Seal the raw file of a worker that died (its writer is gone, so `publish` would refuse it unsealed):
    what `rollout seal` does by hand. Waits for the dead writer's lock to be released; says what it did."""
    if not raw.is_file():
        return "no raw file (the worker died before it wrote one)"
    give_up = time.time() + wait_s
    while live_holder(raw) is not None:
        if time.time() > give_up:
            return "not sealed: a live writer still holds it"
        time.sleep(0.2)
    relative = raw.resolve().relative_to(raw.parent.parent.resolve()).as_posix()
    if relative in read_seals(raw.parent.parent):
        return "sealed by its writer"
    entry = seal_abandoned(raw, reason=reason)
    return f"sealed abandoned by the driver, sha256 {entry['sha256']}"


def _write_state(path: Path, state: dict[str, Any]) -> None:
    state["written_unix"] = time.time()  # `status` says how old the state is: a lease's state can be days old
    write_json_atomic(path, state, overwrite=True)  # operational state, not evidence


# A driver stops its workers at the deadline; teardown and sealing take a little longer. A state not
# marked finished this long after its deadline belongs to a lease that is over: it is not live.
STATE_GRACE_S = 300.0


def _utc_text(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            whole = int(seconds // size)
            rest = int((seconds - whole * size) // {"d": 3600, "h": 60, "min": 1}[unit])
            smaller = {"d": "h", "h": "min", "min": "s"}[unit]
            return f"{whole} {unit} {rest} {smaller} ago" if rest else f"{whole} {unit} ago"
    return f"{seconds:.0f} s ago"


def driver_liveness(state: dict[str, Any], now: float) -> tuple[bool, str]:
    """(live, words) for a driver state: finished, running, or not live and why. A state is live only
    on the host that wrote it, before its lease ended, while its driver process exists."""
    if "finished_unix" in state:
        return False, "finished"
    if now > state["deadline_unix"] + STATE_GRACE_S:
        return False, (f"not live: older than its lease (deadline {_utc_text(state['deadline_unix'])}, "
                       f"{_ago(now - state['deadline_unix'])}; never marked finished)")
    host = state.get("host")
    if host is not None and host != socket.gethostname():
        return False, f"not live here: written on host {host}"
    if not _alive(state["driver_pid"]):
        return False, "not live: its driver process is gone (never marked finished)"
    return True, f"running; deadline in {max(0, state['deadline_unix'] - now):.0f} s"


def _written_line(state: dict[str, Any], now: float) -> str:
    written = state.get("written_unix")
    if written is None:  # states from before written_unix was recorded
        started = state.get("started_unix")
        return "  state written: not recorded" + (
            f" (started {_utc_text(started)}, {_ago(now - started)})" if started is not None else "")
    return f"  state written {_utc_text(written)} ({_ago(now - written)})"


def worker_progress(raw: Path) -> dict[str, Any]:
    """The cell a worker is in and its repetition count, from its raw file."""
    records = _raw_records(raw)
    current, reps, planned = None, 0, None
    done = []
    for record in records:
        kind = record.get("record")
        if kind == "cell_start":
            current, reps = record["cell_id"], 0
            todo = record.get("measured_indices_to_do")
            planned = None if todo is None else len(todo)
        elif kind == "repetition" and record.get("cell_id") == current:
            reps += 1
        elif kind in ("cell_complete", "cell_suspended", "cell_skipped"):
            done.append((record["cell_id"], record.get("status", kind.removeprefix("cell_"))))
            current = None
    return {"cell": current, "repetition": f"rep {reps}" + (f"/{planned + 1}" if planned is not None else "")
            if current else None, "done": done, "ended": any(r.get("record") == "teardown" for r in records)}


def _worker_raw_file(worker: dict[str, Any], output_dir: Path, campaign: str, backend: str) -> Path:
    """The worker's raw file: where the driver wrote it, or, for a driver state merged from the device
    machine (its absolute path is that machine's), the file of that name under this output directory."""
    written = Path(worker["raw_file"])
    if written.exists():
        return written
    return backend_dir_of(output_dir, campaign, backend) / written.name


def _count_words(words: Iterable[str]) -> str:
    """'2 completed, 1 suspended' from an iterable of words, in first-seen order."""
    return ", ".join(f"{n} {word}" for word, n in Counter(words).items())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def status(study: Preregistration, campaign: str, output_dir: Path, backend: str | None = None) -> str:
    """Done / running / to-measure cells, each worker's current cell and repetition, and an ETA."""
    output_dir = Path(output_dir)
    lines = []
    try:
        cells = campaign_cells(study, campaign, output_dir)
        for name, entry in cells.items():
            if backend is None or name == backend:
                lines.append(f"{name}: {len(entry['valid'])} valid, {len(entry['to_measure'])} to measure "
                             f"({len(entry['missing'])} missing, {len(entry['invalid'])} invalid)")
    except Exception as exc:  # the evidence check refused: say why, still show the workers
        lines.append(f"campaign cells: not derivable now ({type(exc).__name__}: {' '.join(str(exc).split())[:400]})")
    now = time.time()
    for path in sorted(campaign_dir(output_dir, campaign).glob("*-driver-*.json")):
        state = json.loads(path.read_text())
        if backend is not None and state["backend"] != backend:
            continue
        alive, words = driver_liveness(state, now)
        left = state["deadline_unix"] - now
        lines.append(f"driver {state['backend']} pid {state['driver_pid']}: {words}")
        lines.append(_written_line(state, now))
        if state.get("executor") == "ray":
            ray_info = state.get("ray") or {}
            lines.append(f"  executor ray: cluster {ray_info.get('gcs_address') or 'address not recorded'}, "
                         f"{ray_info.get('nodes', '?')} node(s); dashboard "
                         + (ray_info.get("dashboard_url") or "none (not started with this cluster)"))
        estimates = state["plan"]["estimates_s"]
        warmup_estimates = state["plan"].get("warmup_estimates_s", {})  # absent in drivers before lease 16
        for worker in state["workers"]:
            raw = _worker_raw_file(worker, output_dir, campaign, state["backend"])
            progress = worker_progress(raw)
            # a worker of a state that is not live is not probed: its pid may be another process here
            if worker.get("executor") == "ray":  # its pid lives on its node: the driver's record says
                running = alive and worker.get("returncode") is None and not worker.get("lost") \
                    and not worker.get("refused") and not progress["ended"]
            else:
                running = alive and _alive(worker["pid"]) and live_holder(raw) is not None
            finished = {c for c, _ in progress["done"]}
            remaining = [c for c in worker["cells"] if c not in finished]
            eta = sum(warmup_estimates.get(c, estimates.get(c, 0)) * study.protocol.warmup_repetitions
                      + estimates.get(c, 0) * study.protocol.measured_repetitions for c in remaining)
            eta = min(eta, max(0.0, left)) if running else 0.0
            state_word = ("running" if running else f"lost ({worker['lost'][:120]})" if worker.get("lost")
                          else f"refused ({worker['refused'][:160]})" if worker.get("refused")
                          else f"exited {worker.get('returncode')}"
                          if "finished_unix" in state or worker.get("returncode") is not None
                          else "not live (no exit recorded)")
            where = f" [{_where_text(worker)}]" if worker.get("executor") == "ray" else ""
            then = f"; continued by {worker['replaced_by']}" if worker.get("replaced_by") else ""
            lines.append(f"  GPU {worker['gpu']}{where} pid {worker['pid']} {state_word}{then}: "
                         f"{len(finished)}/{len(worker['cells'])} cells ended"
                         + (f" ({_count_words(s.split(' (')[0] for _, s in progress['done'])})" if finished else "")
                         + (f"; {'now' if running or not worker.get('lost') else 'cut in'} {progress['cell']} "
                            f"{progress['repetition']}" if progress["cell"] else "")
                         + (f"; ETA {eta:.0f} s" if running else "") + f"; {raw.name}")
    if len(lines) == 0:
        lines.append(f"campaign {campaign}: no driver state under {campaign_dir(output_dir, campaign)}")
    return "\n".join(lines)


def detach(argv: list[str], log: Path) -> int:
    """Start `rollout <argv>` in its own process session, output to `log`; return its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "rollout_lib.cli", *argv], cwd=REPO_ROOT,
                                stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc.pid
