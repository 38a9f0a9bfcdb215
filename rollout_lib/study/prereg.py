"""Strict preregistration loader: YAML -> frozen dataclasses; any fault names its key path.

The preregistration (`params/rollout-runtime-v2.yaml`) fixes the study before the first
measurement: models and their digests, workload, protocol, memory budget, tolerances, gates,
invalidation rules and the calculator's hash. Its SHA-256 is the SHA-256 of the file's bytes.
Profiles under `params/profiles/` use the same schema with `preregistered: false`.

    rollout prereg params/rollout-runtime-v2.yaml     # validates, prints the SHA-256
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollout_lib.core import REPO_ROOT, sha256_bytes
from rollout_lib.safe_read import UnsafeInput, read_bytes
from rollout_lib.study.arch import ARCHITECTURES, Qwen3Arch
from rollout_lib.study.model_source import SHA256_PATTERN, SYNTHETIC_ONLY_KEYS
from rollout_lib.study.real_prompts import PromptSourceSpec
from rollout_lib.study.strict import StrictLoadError, from_mapping, load_yaml

DEFAULT_PREREG = REPO_ROOT / "params" / "rollout-runtime-v2.yaml"
SMOKE_PROFILE = REPO_ROOT / "params" / "profiles" / "smoke.yaml"
CALCULATOR_PENDING = "pending"
BACKEND_NAMES = ("hf_reference", "hf_cached", "vllm")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PreregistrationError(StrictLoadError):
    """The preregistration or profile is malformed; the message names the key path and what is allowed."""


def _m(**kwargs: object) -> dict:
    return dict(kwargs)


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str = field(metadata=_m(choices=tuple(sorted(ARCHITECTURES))))
    vocab_size: int = field(metadata=_m(min=2))
    hidden_size: int = field(metadata=_m(min=1))
    intermediate_size: int = field(metadata=_m(min=1))
    num_hidden_layers: int = field(metadata=_m(min=1))
    num_attention_heads: int = field(metadata=_m(min=1))
    num_key_value_heads: int = field(metadata=_m(min=1))
    head_dim: int = field(metadata=_m(min=1))
    tie_word_embeddings: bool
    rope_theta: float = field(metadata=_m(min_exclusive=0))
    rms_norm_eps: float = field(metadata=_m(min_exclusive=0))
    max_position_embeddings: int = field(metadata=_m(min=1))
    first_special_id: int = field(metadata=_m(min=1))
    bos_token_id: int = field(metadata=_m(min=0))
    eos_token_id: int = field(metadata=_m(min=0))


@dataclass(frozen=True)
class LogitCalibration:
    target_mean_entropy_nats: float = field(metadata=_m(min_exclusive=0))
    measured_mean_entropy_nats: float = field(metadata=_m(min_exclusive=0))
    unscaled_mean_entropy_nats: float = field(metadata=_m(min_exclusive=0))
    positions: int = field(metadata=_m(min=1))
    compute_dtype: Literal["float32"]
    method: str


@dataclass(frozen=True)
class QuantizationSpec:
    method: Literal["bitsandbytes"]
    quant_type: Literal["nf4", "fp4"]
    double_quant: bool
    compute_dtype: Literal["bfloat16", "float32"]
    quant_storage: Literal["uint8"]
    skip_modules: tuple[str, ...]


@dataclass(frozen=True)
class LoraSpec:
    rank: int = field(metadata=_m(min=1, max=1024))
    alpha: float = field(metadata=_m(min_exclusive=0))
    dropout: float = field(metadata=_m(min=0, max=0))  # rollouts are inference: dropout must be 0
    target_modules: tuple[str, ...] = field(metadata=_m(min_items=1))
    seed: int = field(metadata=_m(min=0))
    dtype: Literal["float32"]
    init_a_bound: Literal["kaiming_uniform_1_over_sqrt_in"]
    update_std_b: float = field(metadata=_m(min_exclusive=0))
    update_std_a: float = field(metadata=_m(min=0))


@dataclass(frozen=True)
class ModelSpec:
    """A study's actor or teacher. `source: synthetic`: weights drawn from `synthetic_seed`, scaled by
    `logit_scale` (with its `logit_calibration`); `source: snapshot`: a local Hugging Face snapshot at
    `path` (relative to the study file), optionally labelled with a `revision`. Both pin `payload_digest`."""

    role: Literal["actor", "teacher"]
    source: Literal["synthetic", "snapshot"]
    architecture: ArchitectureSpec
    weights_dtype: Literal["bfloat16"]
    payload_digest: str = field(metadata=_m(pattern=SHA256_PATTERN,
                                            pattern_help="64 lowercase hex digits; `rollout models digest DIR`"))
    serving_dtype: Literal["bfloat16"]
    synthetic_seed: int | None = field(default=None, metadata=_m(min=0))
    logit_scale: float | None = field(default=None, metadata=_m(min_exclusive=0))
    logit_calibration: LogitCalibration | None = None
    path: str | None = None
    revision: str | None = None
    quantization: QuantizationSpec | None = None
    lora: LoraSpec | None = None

    def arch(self) -> Qwen3Arch:
        return ARCHITECTURES[self.architecture.name]


@dataclass(frozen=True)
class SamplingSpec:
    name: Literal["greedy", "stochastic"]
    temperature: float = field(metadata=_m(min=0))
    top_p: float = field(metadata=_m(min_exclusive=0, max=1))
    top_k: int | None = field(metadata=_m(min=1))
    seeded: bool


@dataclass(frozen=True)
class StopRule:
    eos_token_ids: tuple[int, ...] = field(metadata=_m(min_items=1, min=0))
    max_new_tokens: Literal["response_tokens"]
    ignore_eos: bool


@dataclass(frozen=True)
class WorkloadSpec:
    logical_prompts: int = field(metadata=_m(min=1, max=64))
    prompt_tokens: tuple[int, ...] = field(metadata=_m(min_items=1, min=1))
    response_tokens: tuple[int, ...] = field(metadata=_m(min_items=1, min=1))
    samples_per_prompt: tuple[int, ...] = field(metadata=_m(min_items=1, min=1))
    samples_are_independent_requests: bool
    samplings: tuple[SamplingSpec, ...] = field(metadata=_m(min_items=1))
    prompt_seeds: tuple[int, ...] = field(metadata=_m(min=0))
    sample_seeds: tuple[tuple[int, ...], ...]
    measured_partition: tuple[int, ...] = field(metadata=_m(min_items=1, min=1))
    batch_partitions: tuple[tuple[int, ...], ...] = field(metadata=_m(min_items=1))
    stop_rule: StopRule
    # absent (the frozen v2 studies): prompts are seeded random ids; heldout_text: real corpus text
    prompt_source: PromptSourceSpec | None = None


@dataclass(frozen=True)
class ProtocolSpec:
    warmup_repetitions: int = field(metadata=_m(min=0, max=10))
    measured_repetitions: int = field(metadata=_m(min=1, max=100))
    statistic: Literal["median"]
    cuda_synchronize_at_boundaries: bool
    reset_peak_memory_per_cell: bool
    fresh_process_per_backend: bool


@dataclass(frozen=True)
class MemorySpec:
    budget_bytes: int = field(metadata=_m(min=1, max=2**40))  # at most 1 TiB: no GPU has more
    gate_peak_total_bytes: int = field(metadata=_m(min=1, max=2**40))
    enforce_budget_on_larger_gpus: bool
    oom_downshift: Literal["none"]


@dataclass(frozen=True)
class TolerancesSpec:
    nf4_sampled_logprob_abs: float = field(metadata=_m(min_exclusive=0))
    lm_head_compute_dtype: Literal["float32"]
    greedy_exactness_compute_dtype: Literal["float32"]
    bf16_teacher_forced_tie_margin_logits: float = field(metadata=_m(min=0))


@dataclass(frozen=True)
class GateSpec:
    id: str = field(metadata=_m(pattern=r"[a-z][a-z0-9_]*", pattern_help="lower_snake_case"))
    kind: Literal["speedup", "peak_memory", "policy_refresh", "conformance"]
    description: str
    candidate: str = field(metadata=_m(choices=(*BACKEND_NAMES, "all")))
    baseline: str | None = field(metadata=_m(choices=BACKEND_NAMES))
    comparison: Literal[">=", "<", "<="]
    threshold: float = field(metadata=_m(min=0))
    unit: Literal["ratio", "bytes", "nats", "count"]
    response_tokens: tuple[int, ...] = field(metadata=_m(min_items=1, min=1))
    rule: Literal["every_paired_cell", "every_cell", "every_version", "every_request"]


@dataclass(frozen=True)
class PolicyRefreshSpec:
    versions: int = field(metadata=_m(min=1, max=64))
    require_unique_identities: bool
    forbid_monotonic_memory_growth: bool
    require_port_closed_after_teardown: bool


@dataclass(frozen=True)
class InvalidationRule:
    id: str = field(metadata=_m(pattern=r"INV-[A-Z0-9-]+", pattern_help="INV-UPPER-CASE"))
    definition: str


@dataclass(frozen=True)
class SelectionSpec:
    direct_gkd_requires: tuple[str, ...]
    pg_k1_requires: tuple[str, ...]
    candidate: str = field(metadata=_m(choices=BACKEND_NAMES))
    fallback: str = field(metadata=_m(choices=BACKEND_NAMES))


@dataclass(frozen=True)
class CalculatorSpec:
    path: str = field(metadata=_m(pattern=r"[A-Za-z0-9_][A-Za-z0-9_./-]*\.py",
                                  pattern_help="a relative path to a .py file inside the repository"))
    sha256: str = field(metadata=_m(pattern=f"{SHA256_PATTERN}|{CALCULATOR_PENDING}",
                                    pattern_help=f"64 lowercase hex digits, or {CALCULATOR_PENDING!r} "
                                                 "before the calculator exists"))


@dataclass(frozen=True)
class Preregistration:
    schema_version: Literal[1]
    study_id: str = field(metadata=_m(pattern=r"[a-z0-9][a-z0-9-]*"))
    preregistered: bool
    description: str
    actor: ModelSpec
    teacher: ModelSpec
    workload: WorkloadSpec
    protocol: ProtocolSpec
    memory: MemorySpec
    tolerances: TolerancesSpec
    gates: tuple[GateSpec, ...] = field(metadata=_m(min_items=1))
    policy_refresh: PolicyRefreshSpec
    invalidation_rules: tuple[InvalidationRule, ...] = field(metadata=_m(min_items=1))
    selection: SelectionSpec
    calculator: CalculatorSpec
    # The hf_cached engine the study measures (issue 43): compact_qwen3's engine settings by name, e.g.
    # {LORA_SHRINK: in_base_gemm}. Absent (h200-v2, every study before it): the engine's defaults. Part of the
    # hashed text like every key, so a campaign's raw files are bound to the engine they measured. The names and
    # values are checked against the backend's table where the backend is at hand (`check_study_engine` in
    # rollout_lib.backends.compact_qwen3: the CLI's commands that run it, the measure notebook's parameter check);
    # here their form. A plain dict whichever way the study was built (the strict loader gives a read-only view,
    # which cannot be pickled or deep-copied).
    hf_cached_engine: dict[str, str] = field(default_factory=dict, hash=False)  # a mapping is not hashable
    # Filled by load(): not part of the YAML.
    source_path: str = field(default="", compare=False, init=True)
    sha256: str = field(default="", compare=False, init=True)
    # SHA-256 of the same text with the calculator pin reading `pending`: what a measurement depends
    # on. A calculator repin changes `sha256` but not this, so it orphans no raw file.
    measurement_sha256: str = field(default="", compare=False, init=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hf_cached_engine", dict(self.hf_cached_engine))

    def model_for_arch(self, arch_name: str, role: str | None = None) -> ModelSpec:
        for spec in (self.actor, self.teacher):
            if spec.architecture.name == arch_name and role in (None, spec.role):
                return spec
        raise PreregistrationError("actor.architecture.name",
                                   f"no model with architecture {arch_name!r} in {self.source_path}; "
                                   f"have {self.actor.architecture.name!r}, {self.teacher.architecture.name!r}")

    def gate(self, gate_id: str) -> GateSpec:
        for gate in self.gates:
            if gate.id == gate_id:
                return gate
        raise KeyError(f"unknown gate {gate_id!r}; known: {', '.join(g.id for g in self.gates)}")

    @property
    def status_label(self) -> str:
        return "preregistered" if self.preregistered else "NOT PREREGISTERED (profile)"

    def require_calculator_pinned(self) -> str:
        """The pinned calculator hash; a placeholder fails loudly instead of passing."""
        if self.calculator.sha256 == CALCULATOR_PENDING:
            raise PreregistrationError("calculator.sha256",
                                       f"is the placeholder {CALCULATOR_PENDING!r}: the calculator is not "
                                       "frozen yet, so nothing may be computed with it")
        return self.calculator.sha256


def _validate_source(spec: ModelSpec, role: str) -> None:
    """The keys each source takes: a synthetic model its seed, scale and calibration; a snapshot its
    path (and a revision label); each refuses the other's keys by name."""
    err = PreregistrationError
    snapshot_keys = ("path", "revision")
    if spec.source == "snapshot":
        for key in SYNTHETIC_ONLY_KEYS:
            if getattr(spec, key) is not None:
                raise err(f"{role}.{key}", "not allowed with source: snapshot (the weights are the snapshot's "
                          "own; only synthetic weights take a seed and a logit scale)")
        if not (spec.path or "").strip():
            raise err(f"{role}.path", "missing required key (source: snapshot): the snapshot's local directory")
        return
    for key in SYNTHETIC_ONLY_KEYS:
        if getattr(spec, key) is None:
            raise err(f"{role}.{key}", "missing required key (source: synthetic)")
    for key in snapshot_keys:
        if getattr(spec, key) is not None:
            raise err(f"{role}.{key}", "not allowed with source: synthetic (only a local snapshot has a path)")


def _validate(study: Preregistration) -> None:
    """Cross-field rules the per-field schema cannot express."""
    err = PreregistrationError
    for name, value in study.hf_cached_engine.items():
        if not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
            raise err(f"hf_cached_engine.{name}", "is not an engine setting's name; allowed: UPPER_SNAKE_CASE names "
                      "such as LORA_SHRINK (`rollout prereg` lists the engine's settings)")
        if not re.fullmatch(r"[a-z0-9][a-z0-9_]*", value):
            raise err(f"hf_cached_engine.{name}", f"{value!r} is not an engine setting's value; allowed: "
                      "lower_snake_case values such as in_base_gemm")
    for role in ("actor", "teacher"):
        spec: ModelSpec = getattr(study, role)
        if spec.role != role:
            raise err(f"{role}.role", f"must be {role!r}, got {spec.role!r}")
        _validate_source(spec, role)
        registry = ARCHITECTURES[spec.architecture.name]
        for name, value in vars(spec.architecture).items():
            if getattr(registry, name) != value:
                raise err(f"{role}.architecture.{name}",
                          f"{value!r} differs from the {registry.name!r} architecture ({getattr(registry, name)!r})")
    actor = study.actor
    if actor.quantization is None:
        raise err("actor.quantization", "missing required key: the actor is NF4 (bitsandbytes) + LoRA")
    if actor.lora is None:
        raise err("actor.lora", "missing required key: the actor is NF4 (bitsandbytes) + LoRA")
    for index, target in enumerate(actor.lora.target_modules):
        if target not in LORA_TARGETS:
            raise err(f"actor.lora.target_modules[{index}]",
                      f"{target!r} is not allowed; allowed: {', '.join(LORA_TARGETS)}")
    if study.teacher.quantization is not None or study.teacher.lora is not None:
        raise err("teacher", "the teacher is a plain bf16 model: no quantization or lora keys")

    work = study.workload
    for key in ("prompt_tokens", "response_tokens", "samples_per_prompt"):
        values = getattr(work, key)
        if len(set(values)) != len(values):
            raise err(f"workload.{key}", f"values must be unique, got {list(values)}")
    names = [s.name for s in work.samplings]
    if len(set(names)) != len(names):
        raise err("workload.samplings", f"sampling names must be unique, got {names}")
    for index, sampling in enumerate(work.samplings):
        path = f"workload.samplings[{index}]"
        if sampling.name == "greedy" and (sampling.temperature != 0 or sampling.seeded):
            raise err(f"{path}.temperature", "greedy means temperature 0 and seeded false")
        if sampling.name == "stochastic" and (sampling.temperature <= 0 or not sampling.seeded):
            raise err(f"{path}.temperature", "stochastic sampling needs temperature > 0 and seeded true")
    if len(work.prompt_seeds) != work.logical_prompts:
        raise err("workload.prompt_seeds",
                  f"needs one seed per logical prompt ({work.logical_prompts}), got {len(work.prompt_seeds)}")
    if len(work.sample_seeds) != work.logical_prompts:
        raise err("workload.sample_seeds", f"needs one row per logical prompt ({work.logical_prompts}), "
                                           f"got {len(work.sample_seeds)}")
    max_n = max(work.samples_per_prompt)
    flat = []
    for index, row in enumerate(work.sample_seeds):
        if len(row) != max_n:
            raise err(f"workload.sample_seeds[{index}]",
                      f"needs one seed per sample index (max samples_per_prompt = {max_n}), got {len(row)}")
        for j, seed in enumerate(row):
            if isinstance(seed, bool) or seed < 0:
                raise err(f"workload.sample_seeds[{index}][{j}]", "seeds are integers >= 0")
        flat.extend(row)
    if len(set(flat)) != len(flat):
        raise err("workload.sample_seeds", "each (prompt, sample index) needs its own seed; duplicates found")
    partitions = (("measured_partition", (work.measured_partition,)), ("batch_partitions", work.batch_partitions))
    for key, parts in partitions:
        for index, partition in enumerate(parts):
            path = f"workload.{key}" + (f"[{index}]" if key == "batch_partitions" else "")
            if sum(partition) != work.logical_prompts or any(p < 1 for p in partition):
                raise err(path, f"a partition of the {work.logical_prompts} logical prompts into positive batch "
                                f"sizes is needed, got {list(partition)}")
    vocab = actor.architecture.vocab_size
    for index, token in enumerate(work.stop_rule.eos_token_ids):
        if token >= vocab:
            raise err(f"workload.stop_rule.eos_token_ids[{index}]", f"{token} is outside the vocabulary (< {vocab})")
    if work.prompt_source is not None:
        from rollout_lib.study.bpe_tokenizer import MIN_BPE_VOCAB
        from rollout_lib.study.corpus import CorpusError, load_manifest

        bpe = work.prompt_source.bpe_vocab_size
        if not MIN_BPE_VOCAB <= bpe <= actor.architecture.first_special_id:
            raise err("workload.prompt_source.bpe_vocab_size", f"{bpe}; allowed {MIN_BPE_VOCAB}.."
                      f"{actor.architecture.first_special_id} (regular ids stop at the first special id)")
        try:
            load_manifest(work.prompt_source.corpus_manifest)
        except CorpusError as exc:
            raise err("workload.prompt_source.corpus_manifest", str(exc)) from None
    max_len = max(work.prompt_tokens) + max(work.response_tokens)
    if max_len > actor.architecture.max_position_embeddings:
        raise err("workload.response_tokens", f"prompt + response ({max_len}) exceeds max_position_embeddings")

    calc_path = study.calculator.path
    if ".." in Path(calc_path).parts or not (REPO_ROOT / calc_path).resolve().is_relative_to(REPO_ROOT):
        raise err("calculator.path", f"{calc_path!r} is outside the repository; allowed: a relative path inside it")
    if study.memory.gate_peak_total_bytes > study.memory.budget_bytes:
        raise err("memory.gate_peak_total_bytes", "the gate must not exceed the memory budget")
    ids = [g.id for g in study.gates]
    if len(set(ids)) != len(ids):
        raise err("gates", f"gate ids must be unique, got {ids}")
    for index, gate in enumerate(study.gates):
        for j, tokens in enumerate(gate.response_tokens):
            if tokens not in work.response_tokens:
                raise err(f"gates[{index}].response_tokens[{j}]",
                          f"{tokens} is not a workload response length; allowed: {list(work.response_tokens)}")
        if gate.kind == "speedup" and gate.baseline is None:
            raise err(f"gates[{index}].baseline", "a speedup gate needs a baseline backend")
    for key in ("direct_gkd_requires", "pg_k1_requires"):
        for index, gate_id in enumerate(getattr(study.selection, key)):
            if gate_id not in ids:
                raise err(f"selection.{key}[{index}]", f"unknown gate {gate_id!r}; allowed: {', '.join(ids)}")
    rule_ids = [r.id for r in study.invalidation_rules]
    if len(set(rule_ids)) != len(rule_ids):
        raise err("invalidation_rules", f"rule ids must be unique, got {rule_ids}")


def loads(text: str, source_path: str = "<string>") -> Preregistration:
    """Parse and validate preregistration text; raise PreregistrationError naming the key path."""
    try:
        data = load_yaml(text)
    except StrictLoadError as exc:
        raise PreregistrationError(exc.key_path, exc.message) from None
    except Exception as exc:  # yaml.YAMLError and friends: not a mapping we can read
        raise PreregistrationError("<root>", f"not valid YAML: {exc}") from None
    loader_keys = ("source_path", "sha256", "measurement_sha256")
    if isinstance(data, dict) and any(key in data for key in loader_keys):
        bad = next(key for key in loader_keys if key in data)
        raise PreregistrationError(bad, "unknown key (set by the loader, not by the file)")
    try:
        study = from_mapping(Preregistration, data)
    except StrictLoadError as exc:
        raise PreregistrationError(exc.key_path, exc.message) from None
    _validate(study)
    object.__setattr__(study, "source_path", source_path)
    object.__setattr__(study, "sha256", sha256_bytes(text.encode("utf-8")))
    object.__setattr__(study, "measurement_sha256",
                       sha256_bytes(text_with_calculator_pin(text, study.calculator.sha256, CALCULATOR_PENDING)))
    return study


def text_with_calculator_pin(text: str, current_pin: str, pin: str) -> bytes:
    """The study text as it read when `calculator.sha256` was `pin` (every other byte the same)."""
    line = f"sha256: {current_pin}"
    if text.count(line) != 1:
        raise PreregistrationError("calculator.sha256", f"the pin {current_pin!r} must appear exactly once in the text")
    return text.replace(line, f"sha256: {pin}").encode("utf-8")


MAX_STUDY_FILE_BYTES = 1 << 20  # a study file is a few KB


def load(path: str | Path = DEFAULT_PREREG) -> Preregistration:
    path = Path(path)
    if path.is_dir():
        raise PreregistrationError("<file>", f"{path} is a directory, not a preregistration file (a YAML file)")
    if not path.exists():
        raise FileNotFoundError(f"preregistration {path} does not exist")
    try:  # a regular file, size checked with fstat before a byte is read (a sparse 3 GiB file is refused)
        data = read_bytes(path, kind="preregistration", limit=MAX_STUDY_FILE_BYTES)
    except UnsafeInput as exc:
        raise PreregistrationError("<file>", str(exc)) from None
    if len(data) > MAX_STUDY_FILE_BYTES:
        raise PreregistrationError("<file>", f"{path} is {len(data)} bytes; a study file is at most "
                                             f"{MAX_STUDY_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PreregistrationError("<file>", f"{path} is not UTF-8 text (byte {exc.start}: "
                                             f"{data[exc.start:exc.start + 1]!r})") from None
    if "\x00" in text:
        raise PreregistrationError("<file>", f"{path} contains NUL bytes: a binary file, not YAML")
    study = loads(text, str(path))
    assert study.sha256 == sha256_bytes(data)
    return study
