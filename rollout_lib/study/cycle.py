"""The full-RL-cycle study (issue 15): its own preregistration, bound to the rollout study it reuses.

`params/rollout-runtime-v2-cycle.yaml` fixes what the rollout preregistration does not: the cells a
cycle runs, the number of cycles, the loss of each algorithm, the optimizer, the seeds and the
memory budget of the whole process tree. The actor, the teacher and the workload (prompts, sample
seeds, stop rule) come from the rollout preregistration it names, whose SHA-256 it pins: a cycle
study cannot silently run on another actor. It has its own SHA-256; the rollout preregistration
stays untouched.

One cycle: rollout by the serving backend -> teacher scoring (teacher-forced log-probabilities of
the sampled tokens) -> actor scoring (the NF4 actor's own log-probabilities of the same tokens) ->
one optimizer step on the NF4 + LoRA actor -> policy sync of the new live LoRA tensors into the
serving backend (identity verified) -> the next rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollout_lib.core import REPO_ROOT, sha256_bytes
from rollout_lib.safe_read import UnsafeInput, read_bytes, read_text
from rollout_lib.study.prereg import CalculatorSpec, Preregistration
from rollout_lib.study.prereg import load as load_rollout
from rollout_lib.study.strict import StrictLoadError, from_mapping, load_yaml

BACKENDS = ("hf_reference", "hf_cached", "vllm")
ALGORITHMS = ("direct_gkd", "pg_k1")


class CycleStudyError(StrictLoadError):
    """The cycle preregistration is malformed; the message names the key path and what is allowed."""


def _m(**kwargs: object) -> dict:
    return dict(kwargs)


@dataclass(frozen=True)
class DirectGkdSpec:
    """On-policy distillation: reverse KL to the teacher, estimated on the sampled tokens."""

    divergence: Literal["reverse_kl_sampled_tokens"]
    description: str


@dataclass(frozen=True)
class PgK1Spec:
    """REINFORCE on a fixed synthetic per-sequence reward with a batch-mean baseline, plus the k1 KL
    estimator against the rollout log-probabilities."""

    reward: Literal["mean_token_score"]
    reward_seed: int = field(metadata=_m(min=0))
    baseline: Literal["batch_mean"]
    kl_estimator: Literal["k1"]
    kl_coefficient: float = field(metadata=_m(min=0))
    description: str


@dataclass(frozen=True)
class AlgorithmsSpec:
    direct_gkd: DirectGkdSpec
    pg_k1: PgK1Spec


@dataclass(frozen=True)
class OptimizerSpec:
    name: Literal["adamw"]
    learning_rate: float = field(metadata=_m(min_exclusive=0, max=1.0))
    beta1: float = field(metadata=_m(min=0, max=1.0))
    beta2: float = field(metadata=_m(min=0, max=1.0))
    eps: float = field(metadata=_m(min_exclusive=0))
    weight_decay: float = field(metadata=_m(min=0))
    max_grad_norm: float | None = field(metadata=_m(min_exclusive=0))
    micro_batch_rows: int = field(metadata=_m(min=1))


@dataclass(frozen=True)
class SeedsSpec:
    """Cycle k samples with the workload's sample seeds + k * sample_seed_stride_per_cycle."""

    sample_seed_stride_per_cycle: int = field(metadata=_m(min=1))


@dataclass(frozen=True)
class CycleMemorySpec:
    budget_bytes: int = field(metadata=_m(min=1))
    gate_peak_total_bytes: int = field(metadata=_m(min=1))
    vllm_modes: tuple[Literal["sleep", "small_kv"], ...] = field(metadata=_m(min_items=1))
    vllm_sleep_level: int = field(metadata=_m(min=1, max=2))
    vllm_small_kv_fraction_of_budget: float = field(metadata=_m(min_exclusive=0, max=1.0))


@dataclass(frozen=True)
class TrainingSpec:
    """How the training half runs (issue 41). `reference`: `models.training.ActorTrainer` (NF4 + peft
    passes in micro-batches of `optimizer.micro_batch_rows`, gradient checkpointing, chunked float32
    head), the path h200-v2's cycles measured; a study without this section means it. `fused_mirror`:
    `models.fast_training.FastActorTrainer` (the dense mirror of the same dequantized weights, batched
    passes of at most `max_tokens_per_micro_batch` padded tokens, the fused float32 head), used for the
    update and for teacher and actor scoring alike. `logprob_kernel`: Liger's fused linear cross-entropy
    on float32 inputs, the reference's chunked float32 head, or float32 sums of exact bf16 products
    (`fast_training._Bf16OperandsLogprobs`, bf16 compute only)."""

    path: Literal["reference", "fused_mirror"]
    max_tokens_per_micro_batch: int = field(default=16384, metadata=_m(min=1))
    gradient_checkpointing: bool = False
    logprob_kernel: Literal["liger", "torch_chunked", "bf16_operands"] = "liger"
    # false (bf16_operands only): the teacher and a trainer-owned actor keep no float32 copy of their
    # head; the tied bf16 embedding is the head (models.actor.use_bf16_operand_head). True: as before.
    float32_head_copies: bool = True


REFERENCE_TRAINING = TrainingSpec(path="reference")


@dataclass(frozen=True)
class CycleStudy:
    schema_version: Literal[1]
    study_id: str = field(metadata=_m(pattern=r"[a-z0-9][a-z0-9-]*"))
    preregistered: bool
    description: str
    rollout_preregistration: str
    rollout_preregistration_sha256: str = field(metadata=_m(pattern=r"[0-9a-f]{64}", pattern_help="hex SHA-256"))
    cells: tuple[str, ...] = field(metadata=_m(min_items=1))
    cycles: int = field(metadata=_m(min=1, max=1000))
    backends: tuple[Literal["hf_reference", "hf_cached", "vllm"], ...] = field(metadata=_m(min_items=1))
    algorithms: AlgorithmsSpec
    optimizer: OptimizerSpec
    seeds: SeedsSpec
    memory: CycleMemorySpec
    calculator: CalculatorSpec
    training: TrainingSpec = REFERENCE_TRAINING
    source_path: str = field(default="<string>", init=False)
    sha256: str = field(default="", init=False)
    rollout: Preregistration | None = field(default=None, init=False)


def loads(text: str, source_path: str = "<string>", root: Path = REPO_ROOT) -> CycleStudy:
    """Parse and validate cycle-study text, load the rollout preregistration it names and check its pin."""
    try:
        data = load_yaml(text)
        study = from_mapping(CycleStudy, data)
    except CycleStudyError:
        raise
    except StrictLoadError as exc:
        raise CycleStudyError(exc.key_path, exc.message) from None
    except Exception as exc:  # yaml errors: not a mapping we can read
        raise CycleStudyError("<root>", f"not valid YAML: {exc}") from None
    rollout_path = (root / study.rollout_preregistration) if not Path(study.rollout_preregistration).is_absolute() \
        else Path(study.rollout_preregistration)
    if not rollout_path.is_file():
        raise CycleStudyError("rollout_preregistration", f"{rollout_path} is not a file")
    found = sha256_bytes(read_bytes(rollout_path, kind="preregistration"))
    if found != study.rollout_preregistration_sha256:
        raise CycleStudyError("rollout_preregistration_sha256",
                              f"{rollout_path} has SHA-256 {found}; the cycle study pins "
                              f"{study.rollout_preregistration_sha256}")
    rollout = load_rollout(rollout_path)
    from rollout_lib.study.workload import Workload

    known = Workload(rollout).cell_ids()
    for index, cell in enumerate(study.cells):
        if cell not in known:
            raise CycleStudyError(f"cells[{index}]", f"{cell!r} is not a cell of {rollout_path.name}; "
                                                     f"valid cell ids: {', '.join(known)}")
        if not cell.endswith("-stochastic"):
            raise CycleStudyError(f"cells[{index}]", f"{cell!r}: a training cycle samples; allowed: the "
                                                     "stochastic cells")
    training = study.training
    if not training.float32_head_copies and (training.path != "fused_mirror"
                                             or training.logprob_kernel != "bf16_operands"):
        raise CycleStudyError("training.float32_head_copies",
                              "false needs training.path fused_mirror and training.logprob_kernel bf16_operands "
                              "(the tied bf16 embedding is then the head); allowed otherwise: true")
    if study.memory.gate_peak_total_bytes > study.memory.budget_bytes:
        raise CycleStudyError("memory.gate_peak_total_bytes", "must not exceed memory.budget_bytes")
    object.__setattr__(study, "source_path", source_path)
    object.__setattr__(study, "sha256", sha256_bytes(text.encode("utf-8")))
    object.__setattr__(study, "rollout", rollout)
    return study


def load(path: str | Path) -> CycleStudy:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"cycle preregistration {path} does not exist")
    try:  # a regular file, size checked before reading
        text = read_text(path, kind="preregistration")
    except UnsafeInput as exc:
        raise CycleStudyError("<file>", str(exc)) from None
    return loads(text, str(path))
