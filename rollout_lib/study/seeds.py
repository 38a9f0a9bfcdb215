"""Seeded random streams: one independent PCG64 stream per (study seed, label).

Prompts, synthetic weights and policy versions all draw from these, so every draw is bit-identical
on any machine and independent of the order in which things are generated.
"""

from __future__ import annotations

import hashlib

import numpy as np


def tensor_stream(seed: int, label: str) -> np.random.Generator:
    """An independent PCG64 stream per (seed, label): order of generation does not matter."""
    key = hashlib.sha256(f"rollout-runtime-v2:{seed}:{label}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(key[:16], "little")))
