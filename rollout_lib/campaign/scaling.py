"""How long a whole campaign takes on 1, 2, 4, 8 ... GPUs, estimated from its own measured cells.

The regime: a campaign whose raw files exist (complete or not). Per backend, every cell of the
preregistered workload costs its warmups and measured repetitions at the median seconds measured for
it (`driver.estimate_costs`: cells not measured yet from the calibrated prior, and said so), each GPU's
worker starts with the backend's measured cold start (median of its raw files' `cold_start_s`; the
prior where none was measured), and the cells go longest-first onto the least-loaded GPU with no
deadline (`schedule.plan`, the scheduler `rollout campaign run` uses). Backends run one after another,
as `rollout campaign run --backend B` does. Outputs, per backend and GPU count: the makespan, the
speed-up over one GPU, the efficiency, and the bound no GPU count passes (one worker's cold start plus
the longest cell). What the estimate leaves out: process start before the cold start, the Ray
cluster's own start, and time between repetitions that the runner does not record.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_lib.campaign.driver import backend_dir_of, backend_raw_files, estimate_costs
from rollout_lib.campaign.schedule import COLD_START_S, DEFAULT_COLD_START_S, plan
from rollout_lib.study.prereg import BACKEND_NAMES, Preregistration
from rollout_lib.study.workload import Workload

GPU_COUNTS = (1, 2, 4, 8)
NO_DEADLINE_S = 1e9  # the scheduler needs a budget; this one admits every cell


@dataclass(frozen=True)
class BackendScaling:
    backend: str
    cells: int
    cells_measured: int  # cells whose seconds come from their own repetitions (the rest: calibrated prior)
    cold_start_s: float
    cold_start_source: str  # "measured (median of N raw files)" or "prior"
    serial_s: float  # one GPU
    longest_cell: str
    longest_cell_s: float
    makespan_s: dict[int, float]  # GPU count -> seconds

    @property
    def bound_s(self) -> float:
        """No GPU count finishes this backend faster: a worker's cold start plus the longest cell."""
        return self.cold_start_s + self.longest_cell_s

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "cells": self.cells, "cells_measured": self.cells_measured,
                "cold_start_s": round(self.cold_start_s, 1), "cold_start_source": self.cold_start_source,
                "serial_s": round(self.serial_s, 1), "longest_cell": self.longest_cell,
                "longest_cell_s": round(self.longest_cell_s, 1), "bound_s": round(self.bound_s, 1),
                "makespan_s": {str(n): round(s, 1) for n, s in self.makespan_s.items()}}


def measured_cold_start(files: list[list[dict[str, Any]]], backend: str) -> tuple[float, str]:
    seconds = [record["cold_start_s"]["seconds"] for records in files for record in records
               if record.get("record") == "cold_start"
               and (record.get("cold_start_s") or {}).get("status") == "measured"]
    if seconds:
        return statistics.median(seconds), f"measured (median of {len(seconds)} worker start(s))"
    return COLD_START_S.get(backend, DEFAULT_COLD_START_S), "prior (no worker start measured)"


def raw_files_by_backend(output_dir: Path, campaign: str) -> dict[str, list[list[dict[str, Any]]]]:
    """The records of each readable raw file of the campaign, per backend (the campaign driver's reader)."""
    return {b: backend_raw_files(backend_dir_of(Path(output_dir), campaign, b)) for b in BACKEND_NAMES}


def backend_scaling(study: Preregistration, backend: str, files: list[list[dict[str, Any]]],
                    gpu_counts: tuple[int, ...] = GPU_COUNTS) -> BackendScaling:
    """One backend's whole workload (every cell, from scratch) over each GPU count, from the records of
    its raw files."""
    cells = Workload(study).cell_ids()
    costs, calibration = estimate_costs(study, backend, cells, files)
    warmups = study.protocol.warmup_repetitions
    cold_start_s, source = measured_cold_start(files, backend)
    makespan = {}
    for gpus in gpu_counts:
        schedule = plan(costs, gpus=gpus, budget_s=NO_DEADLINE_S, cold_start_s=cold_start_s, warmups=warmups)
        if schedule.unscheduled:  # cannot happen without a deadline; a wrong estimate must not pass silently
            raise ValueError(f"scaling: {backend} cells left unscheduled on {gpus} GPU(s): {schedule.unscheduled}")
        # a GPU that got no cell starts no worker
        makespan[gpus] = max(a.planned_s for a in schedule.assignments if a.cells)
    longest = max(costs, key=lambda c: (c.seconds(c.repetitions_left, warmups), c.cell_id))
    return BackendScaling(backend, len(cells), len(calibration["cells_from_own_repetitions"]), cold_start_s, source,
                          sum(c.seconds(c.repetitions_left, warmups) for c in costs) + cold_start_s,
                          longest.cell_id, longest.seconds(longest.repetitions_left, warmups), makespan)


def campaign_scaling(study: Preregistration, campaign: str, files: dict[str, list[list[dict[str, Any]]]],
                     gpu_counts: tuple[int, ...] = GPU_COUNTS) -> dict[str, Any]:
    """Every backend with raw files in the campaign (`files`: records per raw file, per backend, as
    `raw_files_by_backend` reads them or the report already holds them), and the campaign (those backends
    one after another) per GPU count; a backend with no raw file yet is named, not guessed."""
    if not gpu_counts or any(n < 1 for n in gpu_counts):
        raise ValueError(f"gpus: {list(gpu_counts)} is not allowed; whole numbers of at least 1")
    measured = [b for b in BACKEND_NAMES if files.get(b)]
    if not measured:
        raise ValueError(f"campaign: {campaign!r} has no raw files; the estimate is made from measured cells "
                         "(measure first)")
    backends = [backend_scaling(study, b, files[b], gpu_counts) for b in measured]
    total = {n: sum(b.makespan_s[n] for b in backends) for n in gpu_counts}
    one = sum(b.serial_s for b in backends)
    return {"campaign": campaign, "gpu_counts": list(gpu_counts), "backends": [b.to_json() for b in backends],
            "campaign_s": {str(n): round(s, 1) for n, s in total.items()},
            "speedup": {str(n): round(one / s, 2) for n, s in total.items()},
            "efficiency": {str(n): round(one / s / n, 2) for n, s in total.items()},
            "bound_s": round(sum(b.bound_s for b in backends), 1),
            "backends_not_measured": [b for b in BACKEND_NAMES if b not in measured]}


def format_scaling(result: dict[str, Any]) -> str:
    counts = result["gpu_counts"]
    head = f"{'backend':<14}{'cells':>7}{'cold s':>8}" + "".join(f"{f'{n} GPU':>11}" for n in counts) + \
        f"{'bound':>11}  longest cell"
    lines = [f"campaign {result['campaign']}: whole workload from scratch, hours (longest-first, no deadline)", head]
    for b in result["backends"]:
        lines.append(f"{b['backend']:<14}{b['cells']:>7}{b['cold_start_s']:>8.0f}"
                     + "".join(f"{b['makespan_s'][str(n)] / 3600:>11.2f}" for n in counts)
                     + f"{b['bound_s'] / 3600:>11.2f}  {b['longest_cell']} ({b['longest_cell_s']:.0f} s)")
    lines.append(f"{'campaign':<29}" + "".join(f"{result['campaign_s'][str(n)] / 3600:>11.2f}" for n in counts)
                 + f"{result['bound_s'] / 3600:>11.2f}")
    lines.append(f"{'speed-up':<29}" + "".join(f"{result['speedup'][str(n)]:>10.2f}x" for n in counts))
    lines.append(f"{'efficiency':<29}" + "".join(f"{result['efficiency'][str(n)]:>11.2f}" for n in counts))
    unmeasured = [f"{b['backend']} {b['cells'] - b['cells_measured']}" for b in result["backends"]
                  if b["cells_measured"] < b["cells"]]
    if unmeasured:
        lines.append("cells estimated from the calibrated prior (not measured yet): " + ", ".join(unmeasured))
    if result["backends_not_measured"]:
        lines.append("not in the estimate (no raw file yet): " + ", ".join(result["backends_not_measured"]))
    lines.append("cold starts: " + "; ".join(f"{b['backend']} {b['cold_start_source']}" for b in result["backends"]))
    lines.append("left out: process start before the cold start, the Ray cluster's start, and gaps between "
                 "repetitions that the runner does not record")
    return "\n".join(lines)
