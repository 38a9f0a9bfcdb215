"""Canonical JSON and evidence writing."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys

import pytest

from rollout_lib.core import CanonicalJSONError, canonical_json, sha256_file, write_json_atomic
from rollout_lib.measure.identity import environment_identity

from .conftest import REPO

VALUE = {"b": [1, 2.5, 1e-7, None, True], "a": {"z": "ü", "y": 0.1 + 0.2}, "c": 12345678901234567890}


def test_canonical_json_is_sorted_compact_and_stable():
    text = canonical_json(VALUE)
    assert text.startswith('{"a":{"y":0.30000000000000004,"z":"ü"},"b":[1,2.5,1e-07,null,true]')
    reordered = {"c": VALUE["c"], "a": {"y": VALUE["a"]["y"], "z": "ü"}, "b": VALUE["b"]}
    assert canonical_json(reordered) == text


def test_canonical_json_stable_across_processes():
    code = ("from rollout_lib.core import canonical_json;"
            "print(canonical_json({'b':[1,2.5,1e-7,None,True],'a':{'z':'ü','y':0.1+0.2},'c':12345678901234567890}))")
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=REPO)
    assert out.stdout.strip() == canonical_json(VALUE)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused_with_path(bad):
    with pytest.raises(CanonicalJSONError, match=r"cells\[1\]\.wall_s"):
        canonical_json({"cells": [{}, {"wall_s": bad}]})


def test_non_json_types_are_refused():
    with pytest.raises(CanonicalJSONError, match="set"):
        canonical_json({"x": {1, 2}})


def test_write_json_atomic_never_overwrites(tmp_path):
    path = tmp_path / "raw" / "x.json"
    digest = write_json_atomic(path, VALUE)
    assert digest == sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(FileExistsError, match="never rewritten"):
        write_json_atomic(path, {"other": 1})
    assert sha256_file(path) == digest
    assert not list(path.parent.glob(".*tmp*"))


def test_environment_identity_fields():
    ident = environment_identity(model_digests={"actor": "ab"}, preregistration_sha256="cd")
    assert set(ident) >= {"source", "python", "packages", "gpu", "model_digests", "preregistration_sha256"}
    assert set(ident["packages"]) >= {"torch", "transformers", "peft", "bitsandbytes", "vllm"}
    assert ident["gpu"]["status"] in {"measured", "not_applicable"}
    assert ident["source"]["status"] in {"measured", "not_measured"}
