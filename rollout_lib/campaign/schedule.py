"""Cost estimates and the longest-first schedule of a campaign's remaining cells over GPUs.

Pure functions (no processes, no clock): `driver.py` feeds them what is left to measure and the
time to the deadline, and they say which cell goes to which GPU, in which order, and which do not
fit this lease. A unit is a cell's cold-start share, its warmup and its remaining measured
repetitions; a cell too long for a whole lease is planned with the repetitions that fit (at least one
measured after the warmup), and the next lease continues it as a new segment. Every segment repeats
the warmup (480-760 s for the oracle's largest cells), so a cell that one lease can hold is split only
to fill time at the end of a job that no whole cell fits. A warmup may cost more than a measured
repetition (the oracle's greedy cells: 1.2-2.4x, first-pass allocator growth): the runner is given
both estimates and expects the first measured repetition to run over its own as far as the warmup ran
over the warmup's (`runner.expected_next_s`); the plan follows both.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field, replace
from typing import Any

# The runner's admission rule (measure/runner.py): a repetition starts only when
# `now + expected x SAFETY + MARGIN` is before the deadline, and a cell only when its warmups + one
# measured repetition fit that way. The plan applies the same rule, so a unit it schedules is one the
# worker will run (lease 5: a plan without it gave a 472 s/rep cell "1 measured rep fits" in a 1,113 s
# budget, the worker skipped it and the GPU idled for the rest of the lease).
from rollout_lib.measure.runner import DEADLINE_MARGIN_S, DEADLINE_SAFETY, expected_next_s

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
    repetition_s: float  # one measured repetition (the estimate the runner is given)
    repetitions_left: int  # warmups + measured repetitions still to do
    warmup_s: float | None = None  # one warmup repetition; None: as long as a measured one

    @property
    def first_s(self) -> float:
        return self.repetition_s if self.warmup_s is None else self.warmup_s

    def seconds(self, repetitions: int, warmups: int) -> float:
        """The first `repetitions` of a segment, warmups first."""
        first = min(repetitions, warmups)
        return first * self.first_s + (repetitions - first) * self.repetition_s


@dataclass
class Assignment:
    gpu: int
    cells: list[str] = field(default_factory=list)
    planned_s: float = 0.0
    partial: dict[str, int] = field(default_factory=dict)  # cell -> measured repetitions that fit
    fillers: list[str] = field(default_factory=list)  # partial cells a whole lease could hold: end-of-job fill


@dataclass
class Plan:
    assignments: list[Assignment]
    unscheduled: list[str]
    costs: dict[str, CellCost]
    budget_s: float
    cold_start_s: float
    lease_s: float | None = None  # the longest budget one lease gives a job; None: budget_s
    warmups: int = 1  # warmup repetitions every segment starts with
    safety: float = DEADLINE_SAFETY  # the admission rule the plan was made with (the runner's)
    margin_s: float = DEADLINE_MARGIN_S

    def to_json(self) -> dict[str, Any]:
        return {"budget_s": self.budget_s, "cold_start_s": self.cold_start_s, "lease_s": self.lease_s,
                "unscheduled": self.unscheduled,
                "assignments": [{"gpu": a.gpu, "cells": a.cells, "planned_s": round(a.planned_s, 1),
                                 "partial": a.partial, "fillers": a.fillers} for a in self.assignments],
                "estimates_s": {c: round(cost.repetition_s, 2) for c, cost in self.costs.items()},
                "warmup_estimates_s": {c: round(cost.first_s, 2) for c, cost in self.costs.items()}}


def calibration_ratio(observed: list[tuple[float, float]]) -> float:
    """Median observed/model ratio over (observed wall_s, model estimate) pairs; 1.0 without data."""
    ratios = [wall / model for wall, model in observed if wall > 0 and model > 0]
    return statistics.median(ratios) if ratios else 1.0


def repetitions_admitted(room_s: float, repetition_s: float, warmups: int, *, warmup_s: float | None = None,
                         most: int | None = None, safety: float = DEADLINE_SAFETY,
                         margin_s: float = DEADLINE_MARGIN_S, overrun: float = 1.0) -> int:
    """How many repetitions (warmups first, each `warmup_s`, default `repetition_s`; then `repetition_s`
    each) the runner would run of a cell started with `room_s` seconds to the deadline, at most `most`:
    0 when it would not start the cell at all. The runner is given both estimates; it starts the cell if
    its warmups + one measured fit by them, and each later repetition only if one as long as
    `runner.expected_next_s` says still fits (the larger of the estimate and the last wall; right after
    the warmups, the estimate scaled by their overrun). `overrun`: the walls run this factor over their
    estimates (the estimates the runner is given stay as they are)."""
    limit = sys.maxsize if most is None else most
    if repetition_s <= 0:  # no estimate of cost: as many as asked, if the margin itself fits
        return 0 if room_s < margin_s else limit
    warmup_s = repetition_s if warmup_s is None else warmup_s
    if (warmups * warmup_s + repetition_s) * safety + margin_s > room_s:
        return 0
    elapsed, last, count = 0.0, 0.0, 0  # the runner's loop, walls as estimated
    while count < limit:
        expected = expected_next_s(repetition_s, warmup_s, last, after_warmup=0 < count == warmups)
        if count > 0 and elapsed + expected * safety + margin_s > room_s:
            break
        last = (warmup_s if count < warmups else repetition_s) * overrun
        elapsed += last
        count += 1
    return count


def repetitions_started(the_plan: Plan, assignment: Assignment, overrun: float = 1.0) -> tuple[int, int]:
    """(started, planned): how many of the repetitions one GPU's job plans the runner would start if every
    wall ran `overrun` times its estimate. The runner's loop replayed cell after cell: a cell it declines
    costs nothing and the next one is tried, a cell it cuts costs the repetitions it ran."""
    started = planned = 0
    elapsed = the_plan.cold_start_s
    for cell_id in assignment.cells:
        cost = the_plan.costs[cell_id]
        wanted = the_plan.warmups + assignment.partial.get(cell_id, cost.repetitions_left - the_plan.warmups)
        ran = repetitions_admitted(the_plan.budget_s - elapsed, cost.repetition_s, the_plan.warmups,
                                   warmup_s=cost.warmup_s, most=wanted, safety=the_plan.safety,
                                   margin_s=the_plan.margin_s, overrun=overrun)
        started += ran
        planned += wanted
        elapsed += cost.seconds(ran, the_plan.warmups) * overrun
    return started, planned


def overrun_tolerance(the_plan: Plan, assignment: Assignment) -> float | None:
    """The largest factor (up to 2) by which every repetition of one GPU's job may run over its estimate
    with the runner still starting each repetition the plan counts on (1.0: none to spare; None: nothing
    planned). The plan's admission rule decides, replayed: each repetition must fit, by the larger of the
    estimate and the last wall, times the safety factor, plus the margin; so the room a plan leaves before
    its deadline is not all overrun it absorbs (h200-v2 lease 18: 58 s of room, 1.1% of overrun)."""
    if not assignment.cells:
        return None

    def holds(factor: float) -> bool:
        started, planned = repetitions_started(the_plan, assignment, factor)
        return started >= planned

    if not holds(1.0):
        return 1.0
    low, high = 1.0, 2.0
    if holds(high):
        return high
    for _ in range(30):  # bisection to well under 0.1%
        middle = (low + high) / 2
        low, high = (middle, high) if holds(middle) else (low, middle)
    return low


def plan(costs: list[CellCost], *, gpus: int, budget_s: float, cold_start_s: float, warmups: int,
         lease_s: float | None = None, safety: float = DEADLINE_SAFETY, margin_s: float = DEADLINE_MARGIN_S) -> Plan:
    """Longest-first onto the least-loaded GPU. A cell that fits the budget is a unit: it is started only
    where the runner's admission rule lets it finish before the deadline (else a shorter one fills the
    gap). A cell longer than a whole lease (`lease_s`, default `budget_s`) can never finish in one: it
    gets the repetitions the runner will admit (its warmups + at least one measured), and the next lease
    continues it. A cell a whole lease could hold but this budget cannot waits for one, unless time is
    left on a GPU after every whole unit is placed: then the waiting cell whose admitted repetitions
    measure the most seconds fills it (its warmup is repeated next lease; the time would idle otherwise)."""
    if gpus < 1:
        raise ValueError(f"gpus: {gpus} is not allowed; at least 1")
    if lease_s is not None and lease_s < budget_s:
        raise ValueError(f"lease-s: {lease_s} is not allowed; at least the budget ({budget_s} s)")
    assignments = [Assignment(gpu=i, planned_s=cold_start_s) for i in range(gpus)]
    waiting = []

    def admitted(room_s: float, cost: CellCost) -> int:
        return repetitions_admitted(room_s, cost.repetition_s, warmups, warmup_s=cost.warmup_s,
                                    most=cost.repetitions_left, safety=safety, margin_s=margin_s)

    def add(target: Assignment, cost: CellCost, repetitions: int) -> None:
        target.cells.append(cost.cell_id)
        target.planned_s += cost.seconds(repetitions, warmups)
        if repetitions < cost.repetitions_left:
            target.partial[cost.cell_id] = repetitions - warmups

    for cost in sorted(costs, key=lambda c: (-c.seconds(c.repetitions_left, warmups), c.cell_id)):
        target = min(assignments, key=lambda a: (a.planned_s, a.gpu))
        fitting_total = admitted(budget_s - target.planned_s, cost)
        longer_than_a_lease = admitted((lease_s or budget_s) - cold_start_s, cost) < cost.repetitions_left
        if fitting_total >= cost.repetitions_left or (longer_than_a_lease and fitting_total > warmups):
            add(target, cost, min(fitting_total, cost.repetitions_left))
        else:
            waiting.append(cost)
    while waiting:  # end-of-job fill: the most measured seconds first
        options = [(min(admitted(budget_s - a.planned_s, cost), cost.repetitions_left), cost, a)
                   for cost in waiting for a in assignments]
        options = [(total, cost, a) for total, cost, a in options if total > warmups]
        if not options:
            break
        total, cost, target = max(options, key=lambda o: ((o[0] - warmups) * o[1].repetition_s, -o[2].gpu))
        add(target, cost, total)
        if cost.cell_id in target.partial:
            target.fillers.append(cost.cell_id)
        waiting.remove(cost)
    return Plan(assignments, [c.cell_id for c in waiting], {c.cell_id: c for c in costs}, budget_s, cold_start_s,
                lease_s, warmups, safety, margin_s)


def forecast(costs: list[CellCost], *, gpus: int, lease_s: float, cold_start_s: float, warmups: int,
             first_budget_s: float | None = None, safety: float = DEADLINE_SAFETY,
             margin_s: float = DEADLINE_MARGIN_S, most_leases: int = 100) -> tuple[list[Plan], list[str]]:
    """The plans of successive leases until every cell is planned, if the estimates hold: the first lease
    with `first_budget_s` (default `lease_s`), each later one with `lease_s`; a cell cut in one lease costs
    its warmups + the rest in the next. Returns the plans and the cells no lease can start (not even a
    warmup + one measured repetition fits `lease_s`); ValueError past `most_leases`."""
    plans: list[Plan] = []
    left = list(costs)
    never: list[str] = []
    while left and len(plans) < most_leases:
        budget = first_budget_s if not plans and first_budget_s is not None else lease_s
        the_plan = plan(left, gpus=gpus, budget_s=budget, cold_start_s=cold_start_s, warmups=warmups,
                        lease_s=lease_s, safety=safety, margin_s=margin_s)
        planned = {cell for a in the_plan.assignments for cell in a.cells}
        if not planned and budget == lease_s:
            never = [c.cell_id for c in left]
            break
        plans.append(the_plan)
        cut = {cell: measured for a in the_plan.assignments for cell, measured in a.partial.items()}
        left = [replace(c, repetitions_left=c.repetitions_left - cut[c.cell_id]) if c.cell_id in cut else c
                for c in left if c.cell_id not in planned or c.cell_id in cut]
    if left and not never:
        raise ValueError(f"forecast: {len(left)} cell(s) still unplanned after {most_leases} leases")
    return plans, never
