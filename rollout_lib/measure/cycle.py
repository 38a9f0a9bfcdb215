"""The full RL cycle, measured (issue 15): what one on-policy training loop costs per cycle, by phase.

Regime: a fresh process per (backend, algorithm, cell); cold start of the serving backend, the
teacher and the trainer is recorded and excluded; then `cycles` cycles of
rollout -> teacher scoring -> actor scoring -> actor update -> policy sync, each phase timed with
device synchronization at its boundaries and its peak memory (NVML over the process tree, torch
reserved) recorded. The complete cycle is one span from the rollout's start to the sync's end (not
a sum of phases); full-cycle tokens/s = generated tokens / complete-cycle seconds, reported beside
rollout tokens/s, never combined with it.

Outputs one raw file (append-only, locked, sealed at the end) under
`<output-dir>/cycles/raw/<campaign>/<backend>/`: a header bound to the environment, both preregistrations and
the model digests; one `cycle` record per cycle (phases, memory per phase, loss, gradient norm,
mismatch diagnostics: mean/max |d logprob| between the rollout backend and the actor, min/mean/max
importance ratio; requested and served policy identities; each process's GPU memory at the end of
the rollout and of the update); a teardown record. A run that fails mid-way (a CUDA OOM, a server
that died) appends a `failure` record (cycle, phase, exception, torch memory at that moment), tears
its backend down and seals the file as abandoned with that reason, then re-raises.

Memory plan: before anything is loaded, the bytes the process tree will hold (weights, LoRA and
optimizer state, the engine's KV cache, the checkpointed activations of one micro-batch and one
LM-head chunk's logits) are added up against the cycle study's budget; a plan over budget is
refused (CycleBudgetError, each component named) instead of being discovered by an OOM halfway. The
plan leaves out CUDA contexts, CUDA-graph pools and allocator slack: the NVML peaks are the answer.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from rollout_lib.backends import create_backend
from rollout_lib.backends.base import Phase
from rollout_lib.backends.decode import synchronize
from rollout_lib.backends.vllm_managed import DEFAULT_KV_CACHE_FRACTION
from rollout_lib.core import OUTPUTS_DIR
from rollout_lib.measure.identity import environment_identity, gpu_identity, gpu_key
from rollout_lib.measure.rawfile import RawWriter, read_raw, seal_abandoned, seal_file
from rollout_lib.models.actor import (
    add_lora,
    load_nf4_base,
    torch_dtype,
    use_bf16_operand_head,
    use_float32_lm_head,
)
from rollout_lib.models.fast_training import FastActorTrainer, score_rows
from rollout_lib.models.local_snapshot import resolve_model_snapshot
from rollout_lib.models.policy import (
    load_policy_into_peft,
    lora_tensor_names,
    policy_versions,
    read_policy_from_peft,
)
from rollout_lib.models.synthetic import load_causal_lm
from rollout_lib.models.training import (
    LOGPROB_CHUNK_TOKENS,
    ActorTrainer,
    TrainedPolicy,
    gkd_loss,
    pg_k1_loss,
    sequence_rewards,
    token_logprobs,
    token_scores,
    training_memory_strategy,
)
from rollout_lib.study.arch import get_architecture
from rollout_lib.study.cycle import ALGORITHMS, CycleStudy
from rollout_lib.study.workload import Workload

PHASES = ("rollout", "teacher_scoring", "actor_scoring", "actor_update", "policy_sync")


class CycleBudgetError(RuntimeError):
    """The planned memory of the cycle's process tree exceeds the study's budget."""


def _arch_params(arch) -> int:
    """Projection parameters of every layer plus the (tied) embedding."""
    return arch.num_hidden_layers * sum(o * i for o, i in arch.linear_shapes().values()) \
        + arch.vocab_size * arch.hidden_size


def memory_plan(study: CycleStudy, backend: str, cell_id: str) -> dict[str, int]:
    """Bytes the process tree will hold at the update's peak, by component (an estimate made before
    loading; the measured NVML peaks per phase are what the report shows)."""
    rollout = study.rollout
    actor, teacher = get_architecture(rollout.actor.architecture.name), get_architecture(
        rollout.teacher.architecture.name)
    cell = Workload(rollout).cell(cell_id)
    actor_params, teacher_params = _arch_params(actor), _arch_params(teacher)
    lora = rollout.actor.lora
    lora_params = sum(math.prod(shape) for shape in lora_tensor_names(actor, lora).values())
    # float32 head copies: the teacher's, and the actor's unless a trainer-owned actor (vllm) drops it
    copies = study.training.float32_head_copies
    actor_head = actor.vocab_size * actor.hidden_size * 4 if copies or backend != "vllm" else 0
    teacher_head = teacher.vocab_size * teacher.hidden_size * 4 if copies else 0
    plan = {
        "actor_nf4_weights": actor_params // 2 + actor_head,
        "teacher_weights": teacher_params * 2 + teacher_head,
        "lora_and_optimizer_state": lora_params * 4 * 4,  # weights, gradients, two AdamW moments (float32)
    }
    sequence = cell.prompt_tokens + cell.response_tokens
    rows = study.optimizer.micro_batch_rows
    # checkpointed decoder: each layer's bf16 input is kept, one layer's activations (~24 hidden-sized
    # bf16 tensors per token) are live while it is recomputed
    if study.training.path == "reference":
        plan["training_activations"] = rows * sequence * actor.hidden_size * 2 * (actor.num_hidden_layers + 24)
        # one checkpointed LM-head chunk: bf16 logits, float32 logits, log-softmax and its gradient
        plan["training_logits"] = min(LOGPROB_CHUNK_TOKENS, cell.response_tokens) * actor.vocab_size * (2 + 4 * 3)
    else:
        plan.update(fast_training_plan(study, actor, cell))
    if backend == "hf_cached":
        plan["serving_mirror_weights"] = actor_params * 2
        # the graphs path's static KV caches: one per row count, sized for the longest cell (as BucketSet)
        work = rollout.workload
        longest = max(work.prompt_tokens) + max(work.response_tokens)
        rows_total = sum(work.logical_prompts * n for n in work.samples_per_prompt)
        plan["serving_static_kv_cache"] = (2 * actor.num_hidden_layers * rows_total * actor.num_key_value_heads
                                           * (longest + 64) * actor.head_dim * 2)
    if backend == "vllm":
        plan["vllm_weights"] = actor_params * 2
        plan["vllm_kv_cache"] = int(rollout.memory.budget_bytes * DEFAULT_KV_CACHE_FRACTION)
    return plan


# bytes of activations autograd keeps per token, per decoder layer, per hidden unit, for a Qwen3 layer
# with peft LoRA on its seven projections in bf16 (float32 norm upcasts, float32 LoRA inputs, SwiGLU's
# three intermediate tensors): an estimate for the plan, the measured peaks are the answer
ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN = 150


def fast_training_plan(study: CycleStudy, actor, cell) -> dict[str, int]:
    """The fused-mirror path's extra bytes: the dense mirror's projections and one micro-batch's
    activations (every layer's input with checkpointing plus one layer's activations; all layers without),
    and one fused-head chunk."""
    training = study.training
    layer_params = sum(o * i for o, i in actor.linear_shapes().values())
    rows = study.rollout.workload.logical_prompts * cell.samples_per_prompt
    rows_tokens = min(training.max_tokens_per_micro_batch, rows * (cell.prompt_tokens + cell.response_tokens))
    per_layer = rows_tokens * actor.hidden_size * ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN
    kept = (rows_tokens * actor.hidden_size * 2 * actor.num_hidden_layers + per_layer
            if training.gradient_checkpointing else per_layer * actor.num_hidden_layers)
    # the fused head's float32 logits block (and its softmax and gradient): Liger sizes its chunks to
    # about tokens / (vocab / hidden) rows (~64 here); bf16_operands 512 rows; the chunked torch head 1,024
    head_rows = {"liger": 64, "bf16_operands": 512}.get(training.logprob_kernel, 1024)
    return {"training_mirror_weights": actor.num_hidden_layers * layer_params * 2, "training_activations": kept,
            "training_logits": head_rows * actor.vocab_size * 4 * 3}


def check_budget(study: CycleStudy, backend: str, cell_id: str) -> dict[str, int]:
    plan = memory_plan(study, backend, cell_id)
    total = sum(plan.values())
    if total > study.memory.budget_bytes:
        parts = ", ".join(f"{name} {value / 2**30:.2f} GiB" for name, value in sorted(plan.items()))
        raise CycleBudgetError(f"{backend} {cell_id}: the planned process tree holds {total / 2**30:.2f} GiB, over "
                               f"the budget memory.budget_bytes {study.memory.budget_bytes / 2**30:.2f} GiB ({parts})")
    return plan


class _PhaseMemory:
    """Peak memory of one phase: torch (reset at the phase start) and NVML over the process tree."""

    def __init__(self, device, sampler):
        self.device, self.sampler = device, sampler

    def start(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.sampler is not None:
            self.sampler.start_window()

    def read(self) -> dict[str, Any]:
        import torch

        if self.device.type != "cuda":
            return {"status": "not_applicable", "reason": "CPU run: no GPU memory"}
        return {"status": "measured", "torch_peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)),
                "nvml": self.sampler.window_json() if self.sampler is not None else {"status": "not_measured"}}


def run_cycles(study: CycleStudy, backend_name: str, algorithm: str, cell_id: str, campaign: str,
               run_id: str | None = None, output_dir: Path = OUTPUTS_DIR, device: str | None = None,
               cache_dir: str | None = None, backend_options: dict[str, Any] | None = None,
               cycles: int | None = None, vllm_memory_mode: str | None = None, backend: Any = None) -> Path:
    """Measure `cycles` (default: the study's) cycles; returns the sealed raw file.

    `backend`: the rollout backend already constructed elsewhere (issue 44: `campaign.cycle_placement`
    passes a proxy to a Ray actor that serves it; it has `remote = True`, its `placement()` goes into the
    header, and the trainer then holds its own NF4 + LoRA actor, as with vllm). None: built here.

    `vllm_memory_mode` (vllm only, one of the study's `memory.vllm_modes`): `sleep` puts the engine to
    sleep after each rollout (`/sleep`, its own timed field and the device memory it freed) and wakes it
    before the sync (its own timed field); `small_kv` keeps it awake with a KV cache of
    `memory.vllm_small_kv_fraction_of_budget` of the budget."""

    if backend_name not in study.backends:
        raise ValueError(f"backend {backend_name!r} is not in the cycle study; allowed: {', '.join(study.backends)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not known; allowed: {', '.join(ALGORITHMS)}")
    if cell_id not in study.cells:
        raise ValueError(f"cell {cell_id!r} is not a cell of the cycle study; allowed: {', '.join(study.cells)}")
    if backend_name == "vllm":
        if vllm_memory_mode not in study.memory.vllm_modes:
            raise ValueError(f"vllm_memory_mode {vllm_memory_mode!r} is not allowed; allowed: "
                             f"{', '.join(study.memory.vllm_modes)}")
    elif vllm_memory_mode is not None:
        raise ValueError(f"vllm_memory_mode applies to the vllm backend only, not {backend_name}")
    plan = check_budget(study, backend_name, cell_id)
    rollout = study.rollout
    workload = Workload(rollout)
    cell = workload.cell(cell_id)
    count = cycles or study.cycles
    stamp = run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    seal_folder = cycle_raw_dir(output_dir, campaign)
    mode = f"-{vllm_memory_mode}" if vllm_memory_mode else ""
    path = seal_folder / backend_name / f"{algorithm}-{cell_id}{mode}-{stamp}.jsonl"
    digests = {"actor": rollout.actor.payload_digest, "teacher": rollout.teacher.payload_digest}
    # constructed (options checked, nothing started) before the raw file exists: a refused option
    # leaves no file behind
    remote = backend is not None
    if remote and backend.name != backend_name:
        raise ValueError(f"backend {backend.name!r} given for a {backend_name} run")
    if not remote:
        backend = create_backend(backend_name, rollout, **cycle_backend_options(
            study, backend_name, cache_dir, device, vllm_memory_mode, backend_options))
    writer = RawWriter(path, seal_folder=seal_folder)
    header = {"record": "header", "kind": "rl_cycle", "campaign": campaign, "backend": backend_name,
              "algorithm": algorithm, "cell_id": cell_id, "cycles": count, "run_id": stamp,
              "vllm_memory_mode": vllm_memory_mode,
              "cycle_study_sha256": study.sha256, "cycle_study_path": study.source_path,
              "rollout_preregistration_sha256": rollout.sha256, "memory_plan_bytes": plan,
              "budget_bytes": study.memory.budget_bytes, "gate_peak_total_bytes": study.memory.gate_peak_total_bytes,
              "algorithm_spec": _spec_json(getattr(study.algorithms, algorithm)),
              "optimizer": _spec_json(study.optimizer), "training_memory": _training_memory(study),
              # options beyond the study's setting (e.g. engine flags of a diagnostic run): the report shows them
              "backend_options": dict(backend_options or {}),
              **({"placement": backend.placement()} if remote else {}),
              "environment": environment_identity(model_digests=digests, preregistration_sha256=rollout.sha256)}
    writer.open(header)
    failure = None
    progress: dict[str, Any] = {"cycle": None, "phase": "cold_start"}
    try:
        cold = {"backend": backend.cold_start().to_json()}
        torch_device = backend.device  # the teacher and the trainer live where the backend serves
        started = time.perf_counter()
        teacher_spec = rollout.teacher
        teacher_snapshot = resolve_model_snapshot(teacher_spec, cache_dir=cache_dir, study_path=rollout.source_path)
        teacher = load_causal_lm(teacher_snapshot.path, torch_dtype(teacher_spec.serving_dtype), torch_device)
        if study.training.float32_head_copies:
            use_float32_lm_head(teacher)
        else:  # the tied bf16 embedding is the head: no float32 copy of it (issue 41)
            use_bf16_operand_head(teacher)
        synchronize(torch_device)
        cold["teacher"] = Phase.measured(time.perf_counter() - started).to_json()
        started = time.perf_counter()
        actor = _trainer_actor(backend, rollout, torch_device, cache_dir, study.training.float32_head_copies)
        start_policy = policy_versions(workload.arch, rollout.actor.lora, rollout.actor.payload_digest, 1)[0]
        trainer = _trainer(study, actor, torch_device, cache_dir)
        cold["trainer"] = Phase.measured(time.perf_counter() - started).to_json()
        served = backend.sync_policy(start_policy)
        if backend_name == "vllm" or remote:  # the trainer's own actor (hf in process: the backend's, just synced)
            load_policy_into_peft(actor, start_policy)
        writer.append({"record": "cold_start", "phases": cold, "start_policy_identity": start_policy.identity,
                       "served_identity": served, "backend_environment": backend.environment()})
        scores = token_scores(study.algorithms.pg_k1.reward_seed, workload.arch.vocab_size)
        sampler = _nvml_sampler(torch_device)
        memory = _PhaseMemory(torch_device, sampler)
        policy = start_policy
        try:
            for index in range(count):
                progress["cycle"] = index
                record = _one_cycle(study, backend, teacher, trainer, workload, cell, index, policy, algorithm,
                                    scores, torch_device, memory, sleep=vllm_memory_mode == "sleep",
                                    progress=progress)
                policy = record.pop("_next_policy")
                writer.append(record)
        finally:
            if sampler is not None:
                sampler.__exit__(None, None, None)
        progress.update(cycle=None, phase="teardown")
        teardown = backend.teardown()
        writer.append({"record": "teardown", "teardown_s": teardown.to_json(),
                       "teardown_report": backend.teardown_report()})
        backend = None
    except Exception as exc:
        failure = failure_record(exc, progress, backend.device if backend is not None else None)
        writer.append(failure)
        raise
    finally:
        if backend is not None:
            backend.teardown()
        writer.close()
        if failure is not None:  # the file says how the run ended; it is never continued
            seal_abandoned(path, reason=f"failed in {failure_where(failure)}: {failure['error']}")
    seal_file(path, seal_folder, ended="teardown")
    return path


def cycle_backend_options(study: CycleStudy, backend_name: str, cache_dir: str | None, device: str | None,
                          vllm_memory_mode: str | None, backend_options: dict[str, Any] | None) -> dict[str, Any]:
    """The options a cycle run constructs its rollout backend with (in this process, or in a Ray actor)."""
    options: dict[str, Any] = {"cache_dir": cache_dir} if cache_dir and backend_name != "vllm" else {}
    if device and backend_name != "vllm":
        options["device"] = device
    if vllm_memory_mode == "sleep":
        options["sleep_mode"] = True
    elif vllm_memory_mode == "small_kv":
        options["kv_cache_fraction_of_budget"] = study.memory.vllm_small_kv_fraction_of_budget
    return options | (backend_options or {})


def failure_where(failure: dict[str, Any]) -> str:
    """Where a `failure` record says its run stopped: "cycle 0's actor_update", or the phase alone."""
    cycle = failure.get("cycle")
    return f"cycle {cycle}'s {failure.get('phase')}" if cycle is not None else str(failure.get("phase"))


def failure_record(exc: BaseException, progress: dict[str, Any], device: Any) -> dict[str, Any]:
    """What a failed run leaves in its raw file: where it was, the exception's first line, and the
    torch allocator's view of the device at that moment (an OOM says how close the budget was)."""
    text = str(exc).strip().splitlines()
    record = {"record": "failure", "cycle": progress.get("cycle"), "phase": progress.get("phase"),
              "error": f"{type(exc).__name__}: {text[0][:400] if text else ''}".rstrip(": ")}
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        record["torch_memory"] = {"allocated_bytes": int(torch.cuda.memory_allocated(device)),
                                  "reserved_bytes": int(torch.cuda.memory_reserved(device)),
                                  "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    return record


def estimated_run_s(output_dir: Path, campaign: str, backend_name: str, algorithm: str, cell_id: str,
                    cycles_required: int, vllm_memory_mode: str | None = None, gpu: dict[str, Any] | None = None,
                    ) -> tuple[float, str] | None:
    """(seconds, source) that a cycle run of this kind is expected to take, header to teardown: the newest
    complete earlier run on the same GPU model with the same backend, memory mode and cell (the same
    algorithm preferred: the two differ in the loss, not in the rollout); None without one. Complete is
    the cycle calculator's rule: cycles 0..cycles_required-1 (the study's count, so a `--cycles` probe
    never estimates a full run) and a teardown record.

    A cycle run cannot be continued (its training state lives in the process), so a run that the
    deadline would cut is time lost: `rollout cycle --deadline-s` starts none whose estimate does not fit."""
    gpu = gpu_key({"gpu": gpu_identity()} if gpu is None else {"gpu": gpu})
    folder = cycle_raw_dir(output_dir, campaign) / backend_name
    mode = f"-{vllm_memory_mode}" if vllm_memory_mode else ""
    best: dict[bool, tuple[str, float, str]] = {}
    for path in sorted(folder.glob(f"*-{cell_id}{mode}-*.jsonl")):
        try:
            records, _ = read_raw(path)
        except (OSError, ValueError):
            continue  # a half-written or foreign file estimates nothing
        header = records[0] if records else {}
        ends = [r for r in records if r.get("record") == "teardown"]
        cycles = sorted(r["cycle"] for r in records if r.get("record") == "cycle")
        if (header.get("record") != "header" or header.get("vllm_memory_mode") != vllm_memory_mode
                or header.get("cell_id") != cell_id or not ends or cycles != list(range(cycles_required))
                or gpu_key(header.get("environment", {})) != gpu):
            continue
        seconds = (_utc_seconds(ends[-1]["utc"]) - _utc_seconds(header["utc"]))
        same = header.get("algorithm") == algorithm
        if same not in best or header["utc"] > best[same][0]:
            best[same] = (header["utc"], seconds, path.name)
    chosen = best.get(True) or best.get(False)
    return (chosen[1], chosen[2]) if chosen else None


def rollout_lower_bound_s(output_dir: Path, campaign: str, backend_name: str, cell_id: str, cycles_required: int,
                          gpu: dict[str, Any] | None = None) -> tuple[float, str] | None:
    """(seconds, source): a lower bound for a cycle run with no earlier run of its kind: `cycles_required`
    rollouts, each as short as the fastest repetition (warmups included) of this backend's cell in the
    rollout campaign of the same name on the same GPU model; None without one. Each cycle rolls out once,
    so the run takes at least this (scoring, the update and the cold start come on top).

    The oracle's cycle is the case it is for: its first run has no earlier run to go by, and eight of its
    rollouts alone outlast a 30-minute machine hold (p128-r256-n4-stochastic: 219 s each on the H200)."""
    gpu = gpu_key({"gpu": gpu_identity()} if gpu is None else {"gpu": gpu})
    walls: list[float] = []
    for path in sorted((Path(output_dir) / "raw" / campaign / backend_name).glob("*.jsonl")):
        try:
            records, _ = read_raw(path)
        except (OSError, ValueError):
            continue  # a damaged or foreign file bounds nothing
        if not records or records[0].get("record") != "header" or gpu_key(records[0].get("environment", {})) != gpu:
            continue
        walls += [float(r["wall_s"]) for r in records if r.get("record") == "repetition"
                  and r.get("cell_id") == cell_id and isinstance(r.get("wall_s"), (int, float))]
    if not walls:
        return None
    fastest = min(walls)
    return (fastest * cycles_required, f"lower bound: {cycles_required} rollouts x {fastest:.1f} s, the fastest of "
            f"{len(walls)} repetitions of {cell_id} in raw/{campaign}/{backend_name}")


def _utc_seconds(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def cycle_raw_dir(output_dir: Path, campaign: str) -> Path:
    """Cycle raw files live apart from the rollout campaigns' (their own seals, their own aggregate)."""
    return Path(output_dir) / "cycles" / "raw" / campaign


def _spec_json(spec: Any) -> dict[str, Any]:
    import dataclasses

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(spec).items()}


def _nvml_sampler(device):
    if device.type != "cuda":
        return None
    from rollout_lib.measure.memory import NVMLSampler

    return NVMLSampler(device.index or 0).__enter__()


def _trainer_actor(backend, rollout, device, cache_dir, float32_head: bool = True):
    """The NF4 + LoRA actor that trains: the backend's own where it holds one (hf_cached: its actor,
    the source of truth its mirror is synced from; hf_reference: the oracle generates with the actor),
    else a separate one in this process (vllm), whose head is the float32 copy unless `float32_head` is
    false (then the tied bf16 embedding)."""
    if backend.name == "hf_cached" and not getattr(backend, "remote", False):
        return backend.actor
    if backend.name == "hf_reference" and not getattr(backend, "remote", False):
        return backend.model
    actor = rollout.actor
    snapshot = resolve_model_snapshot(actor, cache_dir=cache_dir, study_path=rollout.source_path)
    return add_lora(load_nf4_base(snapshot.path, actor.quantization, torch_dtype(actor.quantization.compute_dtype),
                                  str(device), float32_head=float32_head), actor.lora)


def _training_memory(study: CycleStudy) -> dict[str, Any]:
    if study.training.path == "reference":
        return training_memory_strategy()
    spec = _spec_json(study.training)
    if spec["float32_head_copies"]:  # the default: headers of the studies before the field stay as they were
        del spec["float32_head_copies"]
    return {"path": study.training.path, **spec}


def _trainer(study: CycleStudy, actor, device, cache_dir):
    """The study's training path: the reference trainer, or the fused-mirror one over the same actor."""
    if study.training.path == "reference":
        return ActorTrainer(actor, study.optimizer)
    rollout = study.rollout
    snapshot = resolve_model_snapshot(rollout.actor, cache_dir=cache_dir, study_path=rollout.source_path)
    return FastActorTrainer(actor, study.optimizer, str(snapshot.path), study.training,
                            torch_dtype(rollout.actor.quantization.compute_dtype), device)


def _cycle_requests(workload: Workload, cell, index: int, stride: int):
    import dataclasses

    return [dataclasses.replace(r, seed=r.seed + index * stride, request_id=f"{r.request_id}-c{index}")
            for r in workload.requests(cell)]


def _timed_freeing(device, action) -> tuple[float, int | None]:
    """Seconds of `action()` and the device memory it freed (negative: took), None on a CPU."""
    import torch

    def free() -> int | None:
        if device.type != "cuda":
            return None
        torch.cuda.synchronize(device)
        return int(torch.cuda.mem_get_info(device)[0])

    before = free()
    seconds = action()
    after = free()
    return seconds, (after - before) if before is not None else None


def process_memory(device) -> dict[str, Any]:
    """This process tree's processes on the device, each with its GPU memory now (NVML): which of
    the trainer, the API server and the engine core holds what."""
    if device.type != "cuda":
        return {"status": "not_applicable", "reason": "CPU run: no GPU memory"}
    try:
        import pynvml

        from rollout_lib.measure.memory import COUNTED_PROCESSES, nvml_handle, process_tree

        pynvml.nvmlInit()
        try:
            running = pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_handle(device.index or 0))
        finally:
            pynvml.nvmlShutdown()  # NVML counts its inits: the sampler's stays
    except Exception as exc:  # no NVML: say so
        return {"status": "not_measured", "reason": f"NVML unavailable: {type(exc).__name__}: {exc}"}
    tree, me = process_tree(), os.getpid()
    processes = []
    for proc in running:
        if proc.pid not in tree:
            continue
        try:
            name = Path(f"/proc/{proc.pid}/comm").read_text().strip()
        except OSError:
            name = "exited"
        role = "this process" if proc.pid == me else COUNTED_PROCESSES.get(int(proc.pid), "child")
        processes.append({"pid": int(proc.pid), "name": name, "role": role,
                          "used_bytes": int(proc.usedGpuMemory) if proc.usedGpuMemory is not None else None})
    return {"status": "measured", "processes": sorted(processes, key=lambda p: p["pid"])}


def _one_cycle(study, backend, teacher, trainer, workload, cell, index, policy, algorithm, scores, device,
               memory, sleep: bool = False, progress: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    pad_id = workload.arch.bos_token_id
    micro = study.optimizer.micro_batch_rows
    requests = _cycle_requests(workload, cell, index, study.seeds.sample_seed_stride_per_cycle)
    phases, peaks, by_process = {}, {}, {}
    progress = {} if progress is None else progress

    def begin(name: str) -> float:
        progress["phase"] = name
        synchronize(device)
        memory.start()
        return time.perf_counter()

    def end(name: str, began: float) -> None:
        synchronize(device)
        phases[name] = Phase.measured(time.perf_counter() - began).to_json()
        peaks[name] = memory.read()

    cycle_started = began = begin("rollout")
    batch = backend.generate(requests)
    end("rollout", began)
    by_process["rollout_end"] = process_memory(device)
    engine = {}
    if sleep:  # the engine's weights and KV cache leave the GPU while the trainer works
        progress["phase"] = "engine_sleep"
        engine["sleep_s"], engine["freed_bytes"] = _timed_freeing(
            device, lambda: backend.sleep(study.memory.vllm_sleep_level))
    rows = [(r.prompt_token_ids, tuple(res.token_ids)) for r, res in zip(requests, batch.results, strict=True)]
    tokens = sum(len(res) for _, res in rows)
    rollout_lp = [torch.tensor(res.logprobs or [], dtype=torch.float32) for res in batch.results]

    fast = isinstance(trainer, FastActorTrainer)
    began = begin("teacher_scoring")
    teacher_lp = (score_rows(teacher, rows, device, pad_id, study.training.max_tokens_per_micro_batch, trainer.kernel)
                  if fast else token_logprobs(teacher, rows, device, pad_id, micro))
    end("teacher_scoring", began)

    began = begin("actor_scoring")
    actor_lp = (trainer.score(rows, device, pad_id) if fast
                else token_logprobs(trainer.actor, rows, device, pad_id, micro))
    end("actor_scoring", began)
    mismatch = _mismatch(rollout_lp, actor_lp)

    rewards = sequence_rewards([res for _, res in rows], scores)
    baseline = statistics.fmean(rewards) if rewards else 0.0
    advantages = [r - baseline for r in rewards]
    spec = study.algorithms.pg_k1

    def loss_for(indices, logprobs):
        if algorithm == "direct_gkd":
            return gkd_loss(logprobs, [teacher_lp[i] for i in indices], tokens)
        return pg_k1_loss(logprobs, [rollout_lp[i] for i in indices], [advantages[i] for i in indices],
                          spec.kl_coefficient, tokens)

    began = begin("actor_update")
    update = trainer.step(loss_for, rows, device, pad_id)
    end("actor_update", began)
    by_process["actor_update_end"] = process_memory(device)

    if sleep:
        # the trainer gives its allocator's cached blocks back before the engine takes its memory
        # again: cached, unused blocks count in the process tree as much as live ones
        progress["phase"] = "engine_wake"
        engine["trainer_cache_release_s"], engine["trainer_cache_released_bytes"] = _timed_freeing(
            device, lambda: _timed(_empty_cache, device))
        engine["wake_s"], freed = _timed_freeing(device, backend.wake_up)
        engine["wake_reclaimed_bytes"] = -freed if freed is not None else None
    began = begin("policy_sync")
    live = read_policy_from_peft(trainer.actor)
    trained = TrainedPolicy(version=policy.version + 1, base_digest=policy.base_digest, arch=policy.arch,
                            lora=policy.lora, live=live)
    if hasattr(backend, "actor_holds") and trainer.actor is backend.actor:
        backend.actor_holds(trained)  # read from the actor just now: no stand-in write back into it
    served = backend.sync_policy(trained)
    end("policy_sync", began)
    complete = time.perf_counter() - cycle_started
    rollout_s = phases["rollout"]["seconds"]
    teacher_kl = [float((a - t).mean()) for a, t in zip(actor_lp, teacher_lp, strict=True) if len(a)]
    return {"record": "cycle", "cycle": index, "policy_version": policy.version, "policy_identity": policy.identity,
            "generated_tokens": tokens, "requests": len(requests), "phases": phases,
            "engine_sleep": engine or {"status": "not_applicable", "reason": "no engine sleep in this run"},
            "complete_cycle_s": complete, "rollout_tokens_per_s": tokens / rollout_s if rollout_s > 0 else None,
            "full_cycle_tokens_per_s": tokens / complete if complete > 0 else None,
            "memory": peaks, "memory_by_process": by_process, "loss": update["loss"], "grad_norm": update["grad_norm"],
            "trainable_parameters": update["trainable_parameters"],
            "optimizer_state_bytes": trainer.optimizer_state_bytes(),
            "mean_reward": baseline if algorithm == "pg_k1" else None,
            "mean_actor_minus_teacher_logprob": statistics.fmean(teacher_kl) if teacher_kl else None,
            "mismatch": mismatch, "next_policy_identity": trained.identity, "served_identity": served,
            "sync_exact": served == trained.identity,
            "served_bf16_identity": getattr(backend, "served_bf16_identity", None), "_next_policy": trained}


def _empty_cache(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


def _timed(action, *args) -> float:
    started = time.perf_counter()
    action(*args)
    return time.perf_counter() - started


def _mismatch(rollout_lp: list, actor_lp: list) -> dict[str, Any]:
    """What RL frameworks log: |d logprob| between the rollout backend and the actor, and the
    importance ratio exp(actor - rollout) on the sampled tokens."""
    diffs, ratios, missing = [], [], 0
    for rollout, actor in zip(rollout_lp, actor_lp, strict=True):
        if len(rollout) != len(actor):
            missing += 1
            continue
        delta = (actor - rollout).tolist()
        diffs.extend(abs(d) for d in delta)
        ratios.extend(math.exp(d) for d in delta)
    if not diffs:
        return {"status": "not_measured", "reason": "the backend returned no per-token log-probabilities",
                "requests_without_logprobs": missing}
    return {"status": "measured", "mean_abs_logprob_diff": statistics.fmean(diffs),
            "max_abs_logprob_diff": max(diffs), "importance_ratio_min": min(ratios),
            "importance_ratio_mean": statistics.fmean(ratios), "importance_ratio_max": max(ratios),
            "tokens": len(diffs), "requests_without_logprobs": missing}
