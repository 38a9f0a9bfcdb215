"""The `source: snapshot` block of a study's actor or teacher: a local Hugging Face snapshot named by
path and pinned by payload digest (rollout_lib/models/local_snapshot.py verifies the directory).

The loader (prereg.py) imports the pattern and the synthetic-only keys from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from rollout_lib.study.strict import StrictLoadError, from_mapping

# the payload-digest pattern (this module must not import prereg: the loader imports it)
SHA256_PATTERN = r"[0-9a-f]{64}"
SYNTHETIC_ONLY_KEYS = ("synthetic_seed", "logit_scale", "logit_calibration")


@dataclass(frozen=True)
class SnapshotSource:
    """The `source: snapshot` fields of an actor or teacher block."""

    source: Literal["snapshot"]
    path: str
    payload_digest: str
    revision: str | None = None


def parse_snapshot_source(block: dict[str, Any], key_path: str) -> SnapshotSource:
    """The snapshot fields of a model block (`key_path`: e.g. `actor`): `source`, `path`,
    `payload_digest`, `revision`. The synthetic-only keys are refused by name; the block's other keys
    (role, architecture, quantization, lora, ...) are the model spec's, validated by the study loader."""
    if not isinstance(block, dict):
        raise StrictLoadError(key_path, f"expected a mapping, got {type(block).__name__}")
    for key in SYNTHETIC_ONLY_KEYS:
        if key in block:
            raise StrictLoadError(f"{key_path}.{key}", "not allowed with source: snapshot (the weights are the "
                                  "snapshot's own; only synthetic weights take a seed and a logit scale)")
    fields = {k: block[k] for k in ("source", "path", "payload_digest", "revision") if k in block}
    spec = from_mapping(SnapshotSource, fields, key_path)
    if not re.fullmatch(SHA256_PATTERN, spec.payload_digest):
        raise StrictLoadError(f"{key_path}.payload_digest", f"{spec.payload_digest!r}: expected 64 lowercase hex "
                              "digits (`rollout models digest DIR` prints it)")
    if not spec.path.strip():
        raise StrictLoadError(f"{key_path}.path", "empty: the snapshot's local directory")
    return spec
