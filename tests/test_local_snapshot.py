"""`source: snapshot` verification on CPU (rollout_lib/models/local_snapshot.py): a tiny synthetic
snapshot written to disk and named as a local snapshot gives the synthetic source's digest and greedy
tokens; a tampered snapshot, a disagreeing config, synthetic-only keys and out-of-vocabulary prompts
are refused by name; a real-format tokenizer.json (a BPE built with `tokenizers`) loads."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_lib.models.local_snapshot import (
    SnapshotDigestMismatch,
    SnapshotError,
    SnapshotSource,
    check_prompt_ids,
    parse_snapshot_source,
    verify_snapshot,
)
from rollout_lib.models.synthetic import load_causal_lm
from rollout_lib.study.strict import StrictLoadError
from rollout_lib.study.workload import Workload

from .conftest import copy_as_local_snapshot


@pytest.fixture()
def local_copy(smoke_study, snapshot_cache, tmp_path):
    """The smoke actor's synthetic snapshot, copied to a directory a user would name."""
    target = tmp_path / "my-models" / "tiny-actor"
    return copy_as_local_snapshot(smoke_study.actor, target, snapshot_cache), target


def _spec(path, digest, revision=None) -> SnapshotSource:
    return parse_snapshot_source({"source": "snapshot", "path": str(path), "payload_digest": digest,
                                  **({"revision": revision} if revision else {})}, "actor")


def test_a_synthetic_snapshot_named_as_local_gives_the_same_digest_and_greedy_tokens(smoke_study, local_copy):
    info, path = local_copy
    snapshot = verify_snapshot(_spec(path, info.payload_digest, "synthetic-copy"), smoke_study.actor.architecture)
    assert snapshot.payload_digest == info.payload_digest == smoke_study.actor.payload_digest
    assert snapshot.revision == "synthetic-copy" and snapshot.config_vocab_size == 1024
    assert snapshot.tokenizer_vocab_size == 1024
    prompt = torch.tensor([Workload(smoke_study).prompt(0, 16)])
    outputs = []
    for directory in (info.path, snapshot.path):
        model = load_causal_lm(directory, torch.float32)
        outputs.append(model.generate(prompt, max_new_tokens=8, do_sample=False)[0].tolist())
    assert outputs[0] == outputs[1]
    assert check_prompt_ids(Workload(smoke_study), snapshot) < smoke_study.actor.architecture.first_special_id


def test_a_relative_path_is_read_from_the_study_files_directory(smoke_study, local_copy, tmp_path):
    info, path = local_copy
    spec = _spec("my-models/tiny-actor", info.payload_digest)
    snapshot = verify_snapshot(spec, smoke_study.actor.architecture, study_path=tmp_path / "study.yaml")
    assert snapshot.path == str(path)


def test_a_tampered_snapshot_is_refused_naming_both_digests(smoke_study, local_copy):
    from safetensors.torch import load_file, save_file

    info, path = local_copy
    tensors = load_file(str(path / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SnapshotDigestMismatch, match=rf"has payload digest [0-9a-f]{{64}}, the study pins "
                                                     rf"{info.payload_digest}; refusing to measure"):
        verify_snapshot(_spec(path, info.payload_digest), smoke_study.actor.architecture)


def test_a_config_that_disagrees_with_the_study_is_refused_by_field(smoke_study, local_copy):
    info, path = local_copy
    config = json.loads((path / "config.json").read_text())
    config["hidden_size"] = 96
    config["rope_theta"] = 10000.0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SnapshotError, match=r"actor.architecture: .*hidden_size: study 64, snapshot 96; "
                                            r"rope_theta: study 1000000.0, snapshot 10000.0"):
        verify_snapshot(_spec(path, info.payload_digest), smoke_study.actor.architecture)
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SnapshotError, match="model_type 'llama'"):
        verify_snapshot(_spec(path, info.payload_digest), smoke_study.actor.architecture)


def test_transformers5_rope_parameters_and_eos_lists_are_read(smoke_study, local_copy):
    info, path = local_copy
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    config["eos_token_id"] = [config["eos_token_id"], config["bos_token_id"]]
    (path / "config.json").write_text(json.dumps(config))
    verify_snapshot(_spec(path, info.payload_digest), smoke_study.actor.architecture)


def test_the_study_block_refuses_synthetic_keys_and_bad_values(local_copy):
    info, path = local_copy
    block = {"source": "snapshot", "path": str(path), "payload_digest": info.payload_digest}
    for key, value in (("logit_scale", 9.5), ("synthetic_seed", 1), ("logit_calibration", {})):
        with pytest.raises(StrictLoadError, match=rf"actor\.{key}: not allowed with source: snapshot"):
            parse_snapshot_source(block | {key: value}, "actor")
    with pytest.raises(StrictLoadError, match=r"teacher\.payload_digest: 'abc': expected 64 lowercase hex"):
        parse_snapshot_source(block | {"payload_digest": "abc"}, "teacher")
    with pytest.raises(StrictLoadError, match=r"actor\.source: .*snapshot"):
        parse_snapshot_source(block | {"source": "hub"}, "actor")
    with pytest.raises(StrictLoadError, match=r"actor\.path: missing required key"):
        parse_snapshot_source({k: v for k, v in block.items() if k != "path"}, "actor")
    with pytest.raises(SnapshotError, match="is not a directory"):
        verify_snapshot(_spec(path / "nowhere", info.payload_digest), None)


def test_a_real_format_tokenizer_loads_and_its_size_is_recorded(smoke_study, local_copy):
    """A byte-level BPE tokenizer.json as the hub ships it (trained here on a few lines)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    info, path = local_copy
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["rollout runtime measures rollouts", "a policy refresh is exact"] * 20, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    snapshot = verify_snapshot(_spec(path, info.payload_digest), smoke_study.actor.architecture)
    assert snapshot.tokenizer_vocab_size == len(Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab())
    assert snapshot.tokenizer_vocab_size < snapshot.config_vocab_size  # padded embedding, as the hub's Qwen3
    (path / "tokenizer.json").unlink()
    with pytest.raises(SnapshotError, match=r"no tokenizer\.json"):
        verify_snapshot(_spec(path, info.payload_digest), smoke_study.actor.architecture)


def test_prompt_ids_outside_the_vocabulary_are_refused(smoke_study, local_copy):
    import dataclasses

    info, path = local_copy
    snapshot = verify_snapshot(_spec(path, info.payload_digest), smoke_study.actor.architecture)
    small = dataclasses.replace(snapshot, config_vocab_size=100)
    with pytest.raises(SnapshotError, match=r"workload prompt 0: token ids \[.*\] are outside the snapshot's "
                                            r"vocabulary \(0..99\)"):
        check_prompt_ids(Workload(smoke_study), small)


def test_models_verify_cli(local_copy, capsys):
    """`rollout models verify DIR --params P`: the flow of a user who downloaded a snapshot (README)."""
    from rollout_lib.cli import main

    info, path = local_copy
    assert main(["models", "verify", str(path), "--params", "params/profiles/smoke.yaml"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["payload_digest"] == info.payload_digest and report["digest_given"] is False
    assert main(["models", "verify", str(path), "--params", "params/profiles/smoke.yaml", "--digest", "0" * 64]) == 2
    assert f"has payload digest {info.payload_digest}" in capsys.readouterr().err
    # the preregistered actor is Qwen3-0.6B-shaped: the tiny snapshot is refused field by field
    assert main(["models", "verify", str(path)]) == 2
    assert "hidden_size: study 1024, snapshot 64" in capsys.readouterr().err


def test_resolve_model_snapshot_serves_both_sources(smoke_study, snapshot_cache, local_copy):
    """One entry for every path that needs a model's directory (vLLM's mirror, the cycle's actor and
    teacher; the HF backends once the oracle's freeze ends): synthetic -> the built, verified cache;
    snapshot -> the named directory, verified."""
    import types

    from rollout_lib.models.local_snapshot import resolve_model_snapshot

    info, path = local_copy
    synthetic = resolve_model_snapshot(smoke_study.actor, cache_dir=snapshot_cache)
    assert synthetic.payload_digest == info.payload_digest and synthetic.path == info.path
    as_snapshot = types.SimpleNamespace(source="snapshot", path="my-models/tiny-actor", role="actor",
                                        payload_digest=info.payload_digest, revision="r1",
                                        architecture=smoke_study.actor.architecture)
    local = resolve_model_snapshot(as_snapshot, study_path=path.parent.parent / "study.yaml")
    assert local.path == str(path) and local.payload_digest == info.payload_digest and local.revision == "r1"
    with pytest.raises(SnapshotDigestMismatch):
        resolve_model_snapshot(types.SimpleNamespace(**(vars(as_snapshot) | {"payload_digest": "0" * 64})),
                               study_path=path.parent.parent / "study.yaml")


def test_the_reports_setup_table_names_either_source(smoke_study):
    import types

    from rollout_lib.report.summary import model_source_text

    actor = smoke_study.actor
    assert model_source_text(actor) == (f"tiny synthetic seed {actor.synthetic_seed}, logit scale {actor.logit_scale}, "
                                        f"digest {actor.payload_digest[:16]}…")
    local = types.SimpleNamespace(source="snapshot", path="models/qwen3-0.6b", revision="c1899de",
                                  payload_digest="ab" * 32, architecture=actor.architecture)
    assert model_source_text(local) == ("tiny local snapshot models/qwen3-0.6b, revision c1899de, "
                                        "digest abababababababab…")
