"""The serving mirror that vLLM loads from disk (`actor.write_mirror_snapshot`), on the tiny synthetic
Qwen3, CPU, real NF4: one writer for bf16 (preregistered) and float32 (the precision ladder)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rollout_lib.models.actor import write_mirror_snapshot
from rollout_lib.models.local_snapshot import resolve_model_snapshot
from rollout_lib.models.synthetic import payload_digest_of_tensors, read_snapshot_tensors


@pytest.fixture(scope="module")
def actor_snapshot(smoke_study, snapshot_cache, tmp_path_factory):
    """A copy of the smoke actor's snapshot that also carries a slow tokenizer's files (as a hub snapshot
    may) and no generation_config.json (not every snapshot has one)."""
    built = resolve_model_snapshot(smoke_study.actor, cache_dir=snapshot_cache)
    copy = tmp_path_factory.mktemp("actor") / "snapshot"
    shutil.copytree(built.path, copy)
    (copy / "generation_config.json").unlink(missing_ok=True)
    (copy / "vocab.json").write_text('{"a": 0}\n')
    (copy / "merges.txt").write_text("#version: 0.2\n")
    return copy


@pytest.fixture(scope="module")
def mirrors(smoke_study, actor_snapshot, tmp_path_factory):
    out = tmp_path_factory.mktemp("mirrors")
    quant = smoke_study.actor.quantization
    return {dtype: (out / dtype, write_mirror_snapshot(str(actor_snapshot), quant, out / dtype, "cpu", dtype=dtype))
            for dtype in ("bfloat16", "float32")}


def test_each_mirror_holds_its_dtype_and_the_digest_it_returns(mirrors, actor_snapshot):
    source = read_snapshot_tensors(str(actor_snapshot))
    for dtype, (path, digest) in mirrors.items():
        tensors = read_snapshot_tensors(str(path))
        assert payload_digest_of_tensors(tensors) == digest
        marker = json.loads((path / "rollout_mirror.json").read_text())
        assert marker["mirror_payload_digest"] == digest and marker["source"] == str(actor_snapshot)
        assert marker.get("dtype", "bfloat16") == dtype and ("dtype" in marker) == (dtype == "float32")
        assert {str(t.dtype) for t in tensors.values()} == {f"torch.{dtype}"}
        assert set(tensors) == set(source)
    bf16 = read_snapshot_tensors(str(mirrors["bfloat16"][0]))
    f32 = read_snapshot_tensors(str(mirrors["float32"][0]))
    projections = [k for k in source if k.endswith("_proj.weight")]
    assert projections
    for key, weight in source.items():
        if key in projections:  # the dequantized NF4 weight: bf16 is the float32 one up to bf16 rounding
            torch.testing.assert_close(f32[key].to(torch.bfloat16), bf16[key], rtol=2 ** -7, atol=0)
            assert not torch.equal(f32[key], weight.to(torch.float32)), f"{key}: the NF4 dequantization, not the source"
        else:  # norms and embeddings: the snapshot's, exactly (upcast exactly in float32)
            assert torch.equal(bf16[key], weight) and torch.equal(f32[key], weight.to(torch.float32))
    assert mirrors["bfloat16"][1] != mirrors["float32"][1]


def test_config_and_tokenizer_files_travel_beside_the_weights(mirrors, actor_snapshot):
    for path, _ in mirrors.values():
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
            assert (path / name).read_bytes() == (actor_snapshot / name).read_bytes(), name
        assert not (path / "generation_config.json").exists()  # optional: the source has none


def test_an_unknown_mirror_dtype_is_refused_with_the_allowed_values(smoke_study, actor_snapshot, tmp_path):
    quant = smoke_study.actor.quantization
    with pytest.raises(ValueError, match=r"mirror dtype 'float16' is not allowed; allowed: bfloat16, float32"):
        write_mirror_snapshot(str(actor_snapshot), quant, tmp_path / "m", "cpu", dtype="float16")
    assert not (tmp_path / "m").exists()
