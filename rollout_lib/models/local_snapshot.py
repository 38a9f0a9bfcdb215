"""A study's model from a local Hugging Face snapshot (`source: snapshot`) instead of synthetic weights.

A team with the real Qwen3-0.6B / Qwen3-1.7B on disk names the directory and pins its payload
digest; nothing is downloaded. Before anything is measured this module verifies, and refuses with a
message naming the field:
- the study block (`study/model_source.py`): `path`, `payload_digest`, optional `revision`; `synthetic_seed`,
  `logit_scale` and `logit_calibration` belong to synthetic weights and are refused;
- the directory: `config.json`, one or more `*.safetensors` shards and a tokenizer (`tokenizer.json`);
- the payload digest (the same SHA-256 over tensors in canonical order as for synthetic snapshots,
  `synthetic.payload_digest`): a mismatch names both digests;
- the architecture: every shape and token-id field of the study against the snapshot's config.json;
- the vocabulary: the tokenizer's size is recorded, and every prompt id of the workload must be a
  valid embedding row (prompts stay token ids drawn from seeds; stop ids come from the study).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_lib.study.model_source import SnapshotSource, parse_snapshot_source
from rollout_lib.study.prereg import ArchitectureSpec
from rollout_lib.study.workload import Workload

__all__ = ["LocalSnapshot", "SnapshotDigestMismatch", "SnapshotError", "SnapshotSource", "check_prompt_ids",
           "inspect_snapshot", "parse_snapshot_source", "verify_snapshot"]

# study field -> config.json key (transformers 5 may nest rope_theta under rope_parameters)
CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_theta", "rms_norm_eps",
                 "max_position_embeddings", "bos_token_id", "eos_token_id")


class SnapshotError(ValueError):
    """A local snapshot does not fit the study; the message names the field or file."""


class SnapshotDigestMismatch(SnapshotError):
    pass


@dataclass(frozen=True)
class LocalSnapshot:
    """A verified snapshot: where it is, what it is, what its tokenizer holds."""

    path: str
    payload_digest: str
    revision: str | None
    config_vocab_size: int
    tokenizer_vocab_size: int
    model_type: str


def resolve_path(spec: SnapshotSource, study_path: str | Path | None) -> Path:
    """The snapshot directory: absolute as written, or relative to the study file's directory."""
    path = Path(spec.path).expanduser()
    if not path.is_absolute() and study_path:
        path = Path(study_path).resolve().parent / path
    return path


def config_architecture(config: dict[str, Any]) -> dict[str, Any]:
    """The study's architecture fields as a snapshot's config.json states them."""
    out = {}
    for name in CONFIG_FIELDS:
        if name == "rope_theta" and "rope_theta" not in config:
            value = (config.get("rope_parameters") or {}).get("rope_theta")
        elif name == "head_dim" and "head_dim" not in config and config.get("num_attention_heads"):
            value = config["hidden_size"] // config["num_attention_heads"]
        else:
            value = config.get(name)
        if isinstance(value, list) and name == "eos_token_id":
            value = tuple(value)
        out[name] = value
    return out


def architecture_mismatches(study: ArchitectureSpec, config: dict[str, Any]) -> list[str]:
    """`field: study X, snapshot Y` for every field where the two disagree (an eos list in the config
    agrees when it contains the study's eos id)."""
    stated = config_architecture(config)
    problems = []
    for name in CONFIG_FIELDS:
        want, have = getattr(study, name), stated[name]
        if name == "eos_token_id" and isinstance(have, tuple):
            if want in have:
                continue
        elif isinstance(want, float) and isinstance(have, (int, float)) and not isinstance(have, bool):
            if float(have) == want:
                continue
        elif have == want:
            continue
        problems.append(f"{name}: study {want!r}, snapshot {have!r}")
    return problems


def load_tokenizer(path: Path):
    """The snapshot's own fast tokenizer, from its files only (no hub access, no remote code)."""
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").is_file():
        raise SnapshotError(f"{path}: no tokenizer.json (a snapshot study takes its tokenizer from the snapshot)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def inspect_snapshot(path: Path, arch: ArchitectureSpec, *, key_path: str = "actor",
                     revision: str | None = None) -> LocalSnapshot:
    """A local snapshot checked against the study's architecture, with its payload digest computed
    (not compared: `verify_snapshot` compares it with the pinned one)."""
    from rollout_lib.models.synthetic import payload_digest

    if not path.is_dir():
        raise SnapshotError(f"{key_path}.path: {path} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SnapshotError(f"{key_path}.path: {path} has no config.json (not a Hugging Face snapshot)")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != "qwen3":
        raise SnapshotError(f"{key_path}.path: model_type {config.get('model_type')!r}, the study's "
                            "architectures are Qwen3 ('qwen3')")
    problems = architecture_mismatches(arch, config)
    if problems:
        raise SnapshotError(f"{key_path}.architecture: the snapshot's config.json disagrees with the study: "
                            + "; ".join(problems))
    tokenizer = load_tokenizer(path)
    return LocalSnapshot(path=str(path), payload_digest=payload_digest(path), revision=revision,
                         config_vocab_size=int(config["vocab_size"]), tokenizer_vocab_size=len(tokenizer),
                         model_type=config["model_type"])


def verify_snapshot(spec: SnapshotSource, arch: ArchitectureSpec, *, study_path: str | Path | None = None,
                    key_path: str = "actor") -> LocalSnapshot:
    """Check a local snapshot against the study before anything is measured (see the module docstring)."""
    snapshot = inspect_snapshot(resolve_path(spec, study_path), arch, key_path=key_path, revision=spec.revision)
    if snapshot.payload_digest != spec.payload_digest:
        raise SnapshotDigestMismatch(f"{key_path}.payload_digest: the snapshot at {snapshot.path} has payload "
                                     f"digest {snapshot.payload_digest}, the study pins {spec.payload_digest}; "
                                     "refusing to measure")
    return snapshot


def check_prompt_ids(workload: Workload, snapshot: LocalSnapshot) -> int:
    """Every prompt id of the workload (each logical prompt at its longest length: shorter prompts are
    its prefixes) must be an embedding row of the snapshot; returns the largest id. Ids past the
    tokenizer's vocabulary but inside the embedding (the hub's Qwen3 pads it) are allowed."""
    study = workload.study.workload
    largest = -1
    for index in range(study.logical_prompts):
        ids = workload.prompt(index, max(study.prompt_tokens))
        bad = [i for i in ids if not 0 <= i < snapshot.config_vocab_size]
        if bad:
            raise SnapshotError(f"workload prompt {index}: token ids {bad[:5]} are outside the snapshot's "
                                f"vocabulary (0..{snapshot.config_vocab_size - 1})")
        largest = max(largest, *ids)
    return largest


def resolve_model_snapshot(spec: Any, *, cache_dir: str | Path | None = None,
                           study_path: str | Path | None = None):
    """The snapshot directory of a study's actor or teacher, verified: a synthetic model is built once
    into the cache and checked against its pinned digest (`synthetic.ensure_snapshot`); a `source:
    snapshot` model is the named directory, checked by `verify_snapshot`. Returns an object with
    `.path` and `.payload_digest` either way."""
    from rollout_lib.models.synthetic import ensure_snapshot

    if getattr(spec, "source", "synthetic") == "snapshot":
        source = SnapshotSource(source="snapshot", path=spec.path, payload_digest=spec.payload_digest,
                                revision=getattr(spec, "revision", None))
        return verify_snapshot(source, spec.architecture, study_path=study_path, key_path=spec.role)
    return ensure_snapshot(spec.architecture.name, spec.synthetic_seed, spec.logit_scale,
                           expected_digest=spec.payload_digest, cache_dir=cache_dir)
