"""Diagnostic: the managed vLLM backend side by side with the in-process engine (`vllm.LLM`, in a clean
subprocess) on the same requests and seeds, with the same adapter and without one.

Answers two questions of the vLLM issue: does the managed server (HTTP, streaming, one request per
sample) cost throughput against the engine itself (goal: within 5% in every cell), and what does
serving through a LoRA adapter cost against the bare base weights (the "LoRA tax")? Each variant
runs in its own process, one after the other (no two engines share the GPU): one warmup, then the
timed repetitions; tokens/s = generated tokens / median wall. Not a gate: evidence beside them.

With `hf_cached` among the variants it answers a third (issue 43): is this project's fast path, with its
live LoRA, at least 1.3x the in-process engine started without LoRA in every cell, and how far is its
decode step from the step's memory-bandwidth floor (rollout_lib/measure/floor.py)?

    rollout vllm-diagnostic --cells p128-r64-n1-greedy,p512-r256-n4-stochastic --out outputs/perf/x.json
    rollout vllm-diagnostic --variants inprocess_no_adapter,hf_cached --cells p128-r64-n1-greedy --out y.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_lib.backends import create_backend
from rollout_lib.backends.vllm_managed import LORA_RANKS
from rollout_lib.lifetime import run_bound
from rollout_lib.measure.floor import cell_floor, over_floor
from rollout_lib.models.policy import policy_versions, write_peft_adapter
from rollout_lib.study.prereg import Preregistration
from rollout_lib.study.workload import Workload

CHILD = Path(__file__).with_name("vllm_inprocess_child.py")


def _job_requests(workload: Workload, cells: list[str]) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for cell_id in cells:
        out[cell_id] = [{"prompt_token_ids": list(r.prompt_token_ids), "max_new_tokens": r.max_new_tokens,
                         "temperature": 0.0 if r.greedy else r.temperature, "seed": r.seed,
                         "eos_token_ids": list(r.eos_token_ids)} for r in workload.requests(workload.cell(cell_id))]
    return out


def run_child(python: str, job: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
    # bound: own process group, SIGKILL on our death, a watchdog for the engine's own children
    done = run_bound([python, str(CHILD)], input=json.dumps(job), timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"in-process vLLM child failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_managed(study: Preregistration, workload: Workload, policy, cells: list[str], repetitions: int,
                     options: dict[str, Any]) -> dict[str, Any]:
    """The managed backend on `cells`: one cold start, the policy synced, per cell one warmup and the
    timed repetitions (the engine-side phases are read after each timer, as the runner does)."""
    managed = create_backend("vllm", study, **options)
    started = time.perf_counter()
    cold = managed.cold_start()
    managed.sync_policy(policy)
    measured = {}
    try:
        for cell_id in cells:
            requests = workload.requests(workload.cell(cell_id))
            managed.generate(requests)  # warmup, excluded
            walls, tokens = [], None
            for _ in range(repetitions):
                begin = time.perf_counter()
                batch = managed.generate(requests)
                walls.append(time.perf_counter() - begin)
                _ = batch.phases
                tokens = batch.generated_tokens
            median = statistics.median(walls)
            measured[cell_id] = {"wall_s": walls, "median_wall_s": median, "generated_tokens": tokens,
                                 "tokens_per_s": tokens / median}
    finally:
        managed.teardown()
    return {"cold_start_s": cold.seconds, "cells": measured, "environment": managed.environment(),
            "total_s": time.perf_counter() - started}


# inprocess_no_adapter_reset_cache: the engine without LoRA, its prefix cache reset before every call, so no
# measured repetition reuses the warm-up's prompt KV (vLLM 0.26 caches prefixes by default; hf_cached prefills
# every call, as a rollout must); sharing within one call (a prompt's n samples) stays
VARIANTS = ("managed", "inprocess_adapter", "inprocess_no_adapter", "inprocess_no_adapter_reset_cache", "hf_cached")
DEFAULT_VARIANTS = ("managed", "inprocess_adapter", "inprocess_no_adapter")
HF_CACHED_GOAL = 1.3  # issue 43: hf_cached >= 1.3x the in-process engine without LoRA, in every cell


def check_variants(variants: tuple[str, ...]) -> tuple[str, ...]:
    """The variants in the canonical order; an unknown or empty list is refused in one line."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        fault = f"unknown {', '.join(unknown)}" if unknown else "none given"
        raise ValueError(f"variants {list(variants)!r}: {fault}; "
                         f"allowed: a comma-separated subset of {', '.join(VARIANTS)}")
    return tuple(v for v in VARIANTS if v in variants)


def run_backend_child(job: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
    """One of this project's backends measured in a fresh process (backend_child.py)."""
    done = run_bound([sys.executable, "-m", "rollout_lib.checks.backend_child"], input=json.dumps(job),
                     timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{job['backend']} child failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# the in-process engines hf_cached is judged against (keys of `inprocess` in run_diagnostic)
ENGINES_WITHOUT_LORA = ("no_adapter", "no_adapter_reset_cache")


def _hf_cached_columns(study: Preregistration, workload: Workload, cell_id: str, measured: dict[str, Any],
                       gpu: str, inprocess: dict[str, Any]) -> dict[str, Any]:
    """hf_cached's rate, its decode step against the step's bandwidth floor, and the ratio to each in-process
    engine without LoRA (the issue's reference) that ran."""
    cell = workload.cell(cell_id)
    floor = cell_floor(study, gpu, measured["rows"], cell.prompt_tokens, cell.response_tokens)
    step = measured["median_decode_step_s"]
    out = {"hf_cached_tokens_per_s": measured["tokens_per_s"], "hf_cached_rows": measured["rows"],
           "hf_cached_median_decode_step_s": step, "decode_step_floor": floor,
           "hf_cached_decode_step_over_floor": over_floor(step, floor)}
    for engine in ENGINES_WITHOUT_LORA:
        if engine in inprocess:
            out[f"hf_cached_over_inprocess_{engine}"] = (measured["tokens_per_s"]
                                                         / inprocess[engine]["cells"][cell_id]["tokens_per_s"])
    return out


def _over_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's child results from several rounds as one: round 1's record with each cell's tokens_per_s (and
    hf_cached's median_decode_step_s) the median over the rounds, each round's figure beside it."""
    merged = json.loads(json.dumps(results[0]))
    for cell_id, cell in merged["cells"].items():
        for key in ("tokens_per_s", "median_decode_step_s"):
            if key in cell:
                by_round = [r["cells"][cell_id][key] for r in results]
                cell[key], cell[f"{key}_by_round"] = statistics.median(by_round), by_round
    merged["rounds"] = len(results)
    return merged


def run_diagnostic(study: Preregistration, cells: list[str], repetitions: int = 3,
                   backend_options: dict[str, Any] | None = None,
                   stream_intervals: tuple[int, ...] = (1,), non_streamed: bool = False,
                   variants: tuple[str, ...] = DEFAULT_VARIANTS,
                   hf_cached_options: dict[str, Any] | None = None, rounds: int = 1,
                   on_round: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """`stream_intervals`: the managed backend once per value (`stream_interval` option; 1 is the
    preregistered setting and the one the 5% goal is judged on). `non_streamed`: once more with
    `streaming: false` (one response per request, built once at the end as the in-process engine
    does), reported beside the preregistered setting, never instead of it. `variants`: which sides run
    (VARIANTS; `hf_cached` adds this project's fast path in its own process, judged against the
    in-process engine without LoRA: issue 43's side-by-side; `hf_cached_options` are its backend options,
    e.g. {"engine": {...}} for a candidate, checked here before anything starts). `rounds`: the in-process engines
    and hf_cached each measured that many times in fresh processes, interleaved (round 1: each side once, then
    round 2, ...), so a ratio is read against each side's spread across processes (lease 31, one H100 hold: the
    engine without LoRA at 1,286 and 1,993 tok/s on one cell in two processes); each side's figure is its median
    over the rounds, each round's figure and each round's ratio beside it. The managed backend is not repeated:
    with it, `rounds` must be 1. `on_round`: called after each round but the last with the report of the rounds
    measured so far (`complete` false, `rounds` of `rounds_requested`), so a run stopped by a time limit keeps its
    finished rounds (lease 46: three rounds overran a 480 s job and left nothing)."""
    if 1 not in stream_intervals or any(not isinstance(n, int) or n < 1 for n in stream_intervals):
        raise ValueError(f"stream_intervals {list(stream_intervals)!r}: integers >= 1, including 1 (the "
                         "preregistered setting)")
    variants = check_variants(tuple(variants))
    if hf_cached_options and "hf_cached" not in variants:
        raise ValueError("hf_cached_options: options of the hf_cached side; add hf_cached to the variants")
    if "hf_cached" in variants:  # its options refused now, not in the child
        create_backend("hf_cached", study, **(hf_cached_options or {}))
    if non_streamed and "managed" not in variants:
        raise ValueError("non_streamed: a setting of the managed backend; add managed to the variants")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1 or (rounds > 1 and "managed" in variants):
        raise ValueError(f"rounds {rounds!r} is not allowed; allowed: an integer >= 1, and 1 when managed is "
                         "among the variants (the managed backend is measured once)")
    workload = Workload(study)
    policy = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, 1)[-1]
    options = dict(backend_options or {})
    managed = create_backend("vllm", study, **options)
    # the mirror snapshot the server loads (built here only when an in-process engine reads it)
    model_dir = managed._model_dir() if any(v.startswith("inprocess") for v in variants) else None
    adapter_dir = managed.cache_dir / "adapters" / f"diagnostic-{policy.identity[:16]}"
    if "inprocess_adapter" in variants:
        write_peft_adapter(policy, adapter_dir)
    work = study.workload
    job = {"model_dir": model_dir, "max_model_len": max(work.prompt_tokens) + max(work.response_tokens) + 8,
           "kv_cache_memory_bytes": managed.kv_cache_bytes, "repetitions": repetitions,
           "max_lora_rank": next(r for r in LORA_RANKS if r >= study.actor.lora.rank),
           "cells": _job_requests(workload, cells),
           "engine_overrides": {} if managed.on_gpu else {"gpu_memory_utilization": 0.1}}
    sides = {}  # side -> one child job (a fresh process each time it runs)
    if "inprocess_adapter" in variants:
        sides["adapter"] = lambda: run_child(managed.server_python, job | {"adapter_dir": str(adapter_dir)})
    if "inprocess_no_adapter" in variants:
        sides["no_adapter"] = lambda: run_child(managed.server_python, job)
    if "inprocess_no_adapter_reset_cache" in variants:
        sides["no_adapter_reset_cache"] = lambda: run_child(managed.server_python, job | {"reset_prefix_cache": True})
    if "hf_cached" in variants:
        sides["hf_cached"] = lambda: run_backend_child({
            "params": str(Path(study.source_path).resolve()), "backend": "hf_cached", "cells": cells,
            "repetitions": repetitions, "options": hf_cached_options or {}})
    by_round: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for done in range(1, rounds + 1):
        for side, measure in sides.items():
            by_round[side].append(measure())
        if on_round is not None and done < rounds:  # rounds > 1: no managed side, nothing else to measure
            on_round(_assemble(study, workload, cells, repetitions, variants, policy, by_round, rounds,
                               hf_cached_options, {}, None))
    by_interval = ({n: _measure_managed(study, workload, policy, cells, repetitions,
                                        options | {"stream_interval": n}) for n in sorted(set(stream_intervals))}
                   if "managed" in variants else {})
    unstreamed = (_measure_managed(study, workload, policy, cells, repetitions, options | {"streaming": False})
                  if non_streamed else None)
    return _assemble(study, workload, cells, repetitions, variants, policy, by_round, rounds, hf_cached_options,
                     by_interval, unstreamed)


def _assemble(study: Preregistration, workload: Workload, cells: list[str], repetitions: int,
              variants: tuple[str, ...], policy, by_round: dict[str, list[dict[str, Any]]], rounds_requested: int,
              hf_cached_options: dict[str, Any] | None, by_interval: dict[int, dict[str, Any]],
              unstreamed: dict[str, Any] | None) -> dict[str, Any]:
    """The diagnostic's report from the rounds measured so far (`by_round`: each side's child results) and the
    managed backend's runs: per cell the rates and ratios, and the verdicts over the cells."""
    rounds = min(len(results) for results in by_round.values()) if by_round else rounds_requested
    measured = {side: results[0] if rounds_requested == 1 else _over_rounds(results)
                for side, results in by_round.items()}
    hf_cached = measured.pop("hf_cached", None)
    inprocess = measured
    rows = []
    for cell_id in cells:
        row: dict[str, Any] = {"cell_id": cell_id}
        a = inprocess["adapter"]["cells"][cell_id]["tokens_per_s"] if "adapter" in inprocess else None
        b = inprocess["no_adapter"]["cells"][cell_id]["tokens_per_s"] if "no_adapter" in inprocess else None
        if a is not None:
            row["inprocess_adapter_tokens_per_s"] = a
        if b is not None:
            row["inprocess_no_adapter_tokens_per_s"] = b
        if a is not None and b is not None:
            row["lora_tax_fraction"] = 1.0 - a / b
        if "no_adapter_reset_cache" in inprocess:
            row["inprocess_no_adapter_reset_cache_tokens_per_s"] = \
                inprocess["no_adapter_reset_cache"]["cells"][cell_id]["tokens_per_s"]
        if by_interval:
            m = by_interval[1]["cells"][cell_id]["tokens_per_s"]
            row["managed_tokens_per_s"] = m
            row["managed_tokens_per_s_by_stream_interval"] = {
                str(n): by_interval[n]["cells"][cell_id]["tokens_per_s"] for n in by_interval}
            if a is not None:
                row["managed_over_inprocess_adapter"] = m / a
        if unstreamed is not None:
            rate = unstreamed["cells"][cell_id]["tokens_per_s"]
            row["managed_non_streamed_tokens_per_s"] = rate
            if a is not None:
                row["managed_non_streamed_over_inprocess_adapter"] = rate / a
        if hf_cached is not None:
            row |= _hf_cached_columns(study, workload, cell_id, hf_cached["cells"][cell_id], hf_cached["gpu"],
                                      inprocess)
            for engine in ENGINES_WITHOUT_LORA if rounds_requested > 1 else ():
                if engine in inprocess:  # each round's ratio, the two sides measured next to each other
                    row[f"hf_cached_over_inprocess_{engine}_by_round"] = [
                        h["cells"][cell_id]["tokens_per_s"] / v["cells"][cell_id]["tokens_per_s"]
                        for h, v in zip(by_round["hf_cached"], by_round[engine], strict=True)]
        rows.append(row)
    verdict = {}
    if by_interval and "adapter" in inprocess:
        verdict["managed_within_5_percent_of_inprocess"] = all(r["managed_over_inprocess_adapter"] >= 0.95
                                                               for r in rows)
    for engine in ENGINES_WITHOUT_LORA if hf_cached is not None else ():
        if engine in inprocess:
            verdict[f"hf_cached_at_least_{HF_CACHED_GOAL}x_inprocess_{engine}"] = all(
                r[f"hf_cached_over_inprocess_{engine}"] >= HF_CACHED_GOAL for r in rows)
            if rounds_requested > 1:
                verdict[f"hf_cached_at_least_{HF_CACHED_GOAL}x_inprocess_{engine}_in_every_round"] = all(
                    min(r[f"hf_cached_over_inprocess_{engine}_by_round"]) >= HF_CACHED_GOAL for r in rows)
    return {"kind": "vllm_inprocess_diagnostic", "cells": cells, "repetitions": repetitions, "rounds": rounds,
            "rounds_requested": rounds_requested, "complete": rounds == rounds_requested,
            "variants": list(variants),
            "policy_identity": policy.identity, **({"managed": by_interval[1]} if by_interval else {}),
            "managed_by_stream_interval": {str(n): v for n, v in by_interval.items() if n != 1},
            **({"managed_non_streamed": unstreamed} if unstreamed is not None else {}),
            "inprocess": inprocess,
            **({"hf_cached": hf_cached, "hf_cached_options": hf_cached_options or {}} if hf_cached is not None else {}),
            "rows": rows, "verdict": verdict}
