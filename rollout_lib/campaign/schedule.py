"""Cost estimates and the longest-first schedule of a campaign's remaining cells over GPUs.

Pure functions (no processes, no clock): `driver.py` feeds them what is left to measure and the
time to the deadline, and they say which cell goes to which GPU, in which order, and which do not
fit this lease. A unit is a cell's cold-start share, its warmup and its remaining measured
repetitions; a cell too long for the lease is planned with the repetitions that fit (at least one
measured after the warmup), and the next lease continues it as a new segment.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

# The runner's admission rule (measure/runner.py, frozen with the oracle): a repetition starts only when
# `now + estimate x SAFETY + MARGIN` is before the deadline, and a cell only when its warmups + one
# measured repetition fit that way. The plan applies the same rule, so a unit it schedules is one the
# worker will run (lease 5: a plan without it gave a 472 s/rep cell "1 measured rep fits" in a 1,113 s
# budget, the worker skipped it and the GPU idled for the rest of the lease).
from rollout_lib.measure.runner import DEADLINE_MARGIN_S, DEADLINE_SAFETY

# Seconds per repetition on one H200, before calibration from raw files (2026-11-29/30 runs):
# hf_reference greedy ~0.1 s per full-recompute step (launch bound, growing with the prefix),
# seeded stochastic ~0.06 s per token, one request at a time; hf_cached eager ~0.07 s per batched
# step; vLLM ~4 ms per step plus request overhead. Cold starts: NF4 load, mirror build, engine start.
COLD_START_S = {"hf_reference": 40.0, "hf_cached": 60.0, "vllm": 180.0}
DEFAULT_COLD_START_S = 60.0


def model_repetition_s(backend: str, prompt_tokens: int, response_tokens: int, rows: int, sampling: str) -> float:
    """The prior: seconds for one repetition of a cell (`rows` = logical prompts x n)."""
    if backend == "hf_reference":
        if sampling == "greedy":
            return response_tokens * (0.095 + 4e-6 * rows * (prompt_tokens + response_tokens / 2))
        return rows * (0.05 + response_tokens * 0.06)
    if backend == "hf_cached":
        # the fast path (CUDA graphs), fitted with margin on h200-v2's 24 cells: 0.22-2.42 s per
        # repetition (the eager path's prior, 0.07 s per token, planned 22x too long)
        return 0.1 + response_tokens * 0.005
    if backend == "vllm":
        return 0.5 + response_tokens * 0.004
    return 0.5 + response_tokens * 0.1


@dataclass(frozen=True)
class CellCost:
    cell_id: str
    repetition_s: float  # one repetition (warmup or measured)
    repetitions_left: int  # warmups + measured repetitions still to do

    @property
    def total_s(self) -> float:
        return self.repetition_s * self.repetitions_left


@dataclass
class Assignment:
    gpu: int
    cells: list[str] = field(default_factory=list)
    planned_s: float = 0.0
    partial: dict[str, int] = field(default_factory=dict)  # cell -> measured repetitions that fit


@dataclass
class Plan:
    assignments: list[Assignment]
    unscheduled: list[str]
    costs: dict[str, CellCost]
    budget_s: float
    cold_start_s: float

    def to_json(self) -> dict[str, Any]:
        return {"budget_s": self.budget_s, "cold_start_s": self.cold_start_s, "unscheduled": self.unscheduled,
                "assignments": [{"gpu": a.gpu, "cells": a.cells, "planned_s": round(a.planned_s, 1),
                                 "partial": a.partial} for a in self.assignments],
                "estimates_s": {c: round(cost.repetition_s, 2) for c, cost in self.costs.items()}}


def calibration_ratio(observed: list[tuple[float, float]]) -> float:
    """Median observed/model ratio over (observed wall_s, model estimate) pairs; 1.0 without data."""
    ratios = [wall / model for wall, model in observed if wall > 0 and model > 0]
    return statistics.median(ratios) if ratios else 1.0


def repetitions_admitted(room_s: float, repetition_s: float, warmups: int, *,
                         safety: float = DEADLINE_SAFETY, margin_s: float = DEADLINE_MARGIN_S) -> int:
    """How many repetitions (warmups first) the runner would run of a cell started with `room_s` seconds
    to the deadline, each taking `repetition_s`: 0 when it would not start the cell at all."""
    if repetition_s <= 0:  # no estimate of cost: as many as asked, if the margin itself fits
        return 0 if room_s < margin_s else sys.maxsize
    if (warmups + 1) * repetition_s * safety + margin_s > room_s:
        return 0
    # repetition j starts at j x repetition_s and is admitted while it ends (with the margin) in time
    return math.floor((room_s - margin_s - repetition_s * safety) / repetition_s) + 1


def plan(costs: list[CellCost], *, gpus: int, budget_s: float, cold_start_s: float, warmups: int,
         safety: float = DEADLINE_SAFETY, margin_s: float = DEADLINE_MARGIN_S) -> Plan:
    """Longest-first onto the least-loaded GPU. A cell that fits a lease is a unit: it is started only
    where the runner's admission rule lets it finish before the deadline (else a shorter one fills the
    gap). A cell longer than a whole lease can never finish in one: it gets the repetitions the runner
    will admit (its warmups + at least one measured), and the next lease continues it."""
    if gpus < 1:
        raise ValueError(f"gpus: {gpus} is not allowed; at least 1")
    assignments = [Assignment(gpu=i, planned_s=cold_start_s) for i in range(gpus)]
    unscheduled = []

    def admitted(room_s: float, cost: CellCost) -> int:
        return repetitions_admitted(room_s, cost.repetition_s, warmups, safety=safety, margin_s=margin_s)

    for cost in sorted(costs, key=lambda c: (-c.total_s, c.cell_id)):
        target = min(assignments, key=lambda a: (a.planned_s, a.gpu))
        room = budget_s - target.planned_s
        fitting_total = admitted(room, cost)
        if fitting_total >= cost.repetitions_left:
            target.cells.append(cost.cell_id)
            target.planned_s += cost.total_s
            continue
        longer_than_a_lease = admitted(budget_s - cold_start_s, cost) < cost.repetitions_left
        fitting = fitting_total - warmups
        if longer_than_a_lease and fitting >= 1:
            target.cells.append(cost.cell_id)
            target.partial[cost.cell_id] = fitting
            target.planned_s += (warmups + fitting) * cost.repetition_s
        else:
            unscheduled.append(cost.cell_id)
    return Plan(assignments, unscheduled, {c.cell_id: c for c in costs}, budget_s, cold_start_s)
