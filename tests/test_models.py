"""Synthetic snapshots: bit-identical builds, pinned digests, HF loading, tokenizer, hub-style shards."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rollout_lib.models.synthetic import (
    build_snapshot,
    ensure_snapshot,
    load_causal_lm,
    payload_digest,
    payload_digest_of_tensors,
    read_snapshot_tensors,
)
from rollout_lib.study.arch import ARCHITECTURES, UnknownArchitectureError, get_architecture

from .conftest import REPO


def test_build_twice_is_bit_identical(tmp_path, smoke_study):
    spec = smoke_study.actor
    a = build_snapshot(spec.arch(), spec.synthetic_seed, tmp_path / "a", spec.logit_scale)
    b = build_snapshot(spec.arch(), spec.synthetic_seed, tmp_path / "b", spec.logit_scale)
    assert a.payload_digest == b.payload_digest == spec.payload_digest
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_other_seed_other_digest(tmp_path, smoke_study):
    spec = smoke_study.actor
    other = build_snapshot(spec.arch(), spec.synthetic_seed + 1, tmp_path / "c", spec.logit_scale)
    assert other.payload_digest != spec.payload_digest


def test_from_pretrained_round_trip(tmp_path, smoke_study):
    spec = smoke_study.actor
    info = build_snapshot(spec.arch(), spec.synthetic_seed, tmp_path / "snap", spec.logit_scale)
    model = load_causal_lm(info.path, torch.bfloat16)
    arch = spec.arch()
    assert model.config.hidden_size == arch.hidden_size and model.config.vocab_size == arch.vocab_size
    assert model.config.tie_word_embeddings is True
    loaded = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert payload_digest_of_tensors(loaded) == info.payload_digest
    assert torch.equal(model.model.norm.weight, torch.full((arch.hidden_size,), spec.logit_scale, dtype=torch.bfloat16))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, arch.vocab_size)


def test_digest_ignores_sharding(tmp_path, smoke_study):
    """A hub snapshot may be sharded; the payload digest depends on tensors, not on files."""
    from safetensors.torch import save_file

    spec = smoke_study.actor
    info = build_snapshot(spec.arch(), spec.synthetic_seed, tmp_path / "one", spec.logit_scale)
    tensors = read_snapshot_tensors(info.path)
    names = sorted(tensors)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    save_file({n: tensors[n] for n in names[::2]}, str(shard_dir / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(shard_dir / "model-00002-of-00002.safetensors"))
    assert payload_digest(shard_dir) == info.payload_digest


def test_digest_sees_one_changed_value(smoke_study):
    spec = smoke_study.actor
    from rollout_lib.models.synthetic import synthetic_state_dict

    tensors = synthetic_state_dict(spec.arch(), spec.synthetic_seed, spec.logit_scale)
    before = payload_digest_of_tensors(tensors)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 7] += 1
    assert payload_digest_of_tensors(tensors) != before


def test_tokenizer_one_token_per_id_with_qwen3_specials(tmp_path):
    from transformers import AutoTokenizer

    arch = get_architecture("tiny")
    info = build_snapshot(arch, 1, tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(info.path)
    assert len(tokenizer) == arch.vocab_size
    ids = [5, 999, 17, 42]
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids
    assert tokenizer.convert_ids_to_tokens(arch.eos_token_id) == "<|im_end|>"
    assert tokenizer.convert_ids_to_tokens(arch.first_special_id) == "<|endoftext|>"


def test_full_size_architectures_match_qwen3():
    a = ARCHITECTURES["qwen3-0.6b"]
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_hidden_layers) == (151936, 1024, 3072, 28)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (16, 8, 128)
    assert 0.59e9 < a.parameter_count() < 0.61e9  # Qwen3-0.6B: 0.6B with tied embeddings
    assert 1.7e9 < ARCHITECTURES["qwen3-1.7b"].parameter_count() < 1.75e9


def test_unknown_architecture_lists_known():
    with pytest.raises(UnknownArchitectureError, match=r"known: qwen3-0\.6b, qwen3-1\.7b, tiny"):
        get_architecture("llama-7b")


def test_ensure_snapshot_refuses_digest_mismatch(tmp_path, smoke_study):
    from rollout_lib.models.synthetic import DigestMismatchError

    spec = smoke_study.actor
    with pytest.raises(DigestMismatchError, match="pins"):
        ensure_snapshot("tiny", spec.synthetic_seed, spec.logit_scale, "0" * 64, cache_dir=tmp_path)


def test_cli_build_prints_pinned_digest(tmp_path, smoke_study):
    out = subprocess.run([sys.executable, "-m", "rollout_lib.cli", "models", "build", "--arch", "tiny", "--out",
                          str(tmp_path / "cli")], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == smoke_study.actor.payload_digest
