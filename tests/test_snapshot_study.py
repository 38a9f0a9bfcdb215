"""A study whose actor is `source: snapshot` (a local Hugging Face snapshot) on CPU: it loads, the HF
backends serve it with the same digest and greedy tokens as the synthetic source of the same
weights, and the loader refuses each source's foreign keys by name (issue 16)."""

from __future__ import annotations

import pytest
import yaml

from rollout_lib.backends import create_backend
from rollout_lib.models.local_snapshot import SnapshotDigestMismatch
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.prereg import PreregistrationError, load, loads
from rollout_lib.study.workload import Workload

from .conftest import REPO, SMOKE, copy_as_local_snapshot, snapshot_source_study

CELL = "p16-r8-n1-greedy"


@pytest.fixture()
def snapshot_copy(smoke_study, snapshot_cache, tmp_path):
    target = tmp_path / "models" / "tiny-actor"
    copy_as_local_snapshot(smoke_study.actor, target, snapshot_cache)
    return target


def _snapshot_study(tmp_path, path, **changes):
    return snapshot_source_study(SMOKE, tmp_path, path, **({"revision": "test"} | changes))


def _greedy(study, snapshot_cache, backend_name):
    backend = create_backend(backend_name, study, device="cpu", compute_dtype="float32", cache_dir=snapshot_cache)
    backend.cold_start()
    work = Workload(study)
    backend.sync_policy(policy_versions(work.arch, study.actor.lora, study.actor.payload_digest, 2)[-1])
    tokens = [r.token_ids for r in backend.generate(work.requests(work.cell(CELL))).results]
    digest = backend.snapshot.payload_digest
    backend.teardown()
    return tokens, digest


@pytest.mark.parametrize("backend_name", ["hf_reference", "hf_cached"])
def test_both_sources_give_the_same_digest_and_greedy_tokens(smoke_study, snapshot_cache, snapshot_copy, tmp_path,
                                                              backend_name):
    study = _snapshot_study(tmp_path, "models/tiny-actor")  # relative to the study file
    assert study.actor.source == "snapshot" and study.actor.synthetic_seed is None
    synthetic = _greedy(smoke_study, snapshot_cache, backend_name)
    local = _greedy(study, snapshot_cache, backend_name)
    assert local == synthetic


def test_a_tampered_snapshot_refuses_to_measure(smoke_study, snapshot_cache, snapshot_copy, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(snapshot_copy / "model.safetensors"))
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(snapshot_copy / "model.safetensors"))
    study = _snapshot_study(tmp_path, snapshot_copy)
    backend = create_backend("hf_cached", study, device="cpu", cache_dir=snapshot_cache)
    with pytest.raises(SnapshotDigestMismatch, match=f"the study pins {smoke_study.actor.payload_digest}"):
        backend.cold_start()
    backend.teardown()


def test_each_source_refuses_the_others_keys(tmp_path, snapshot_copy):
    with pytest.raises(PreregistrationError, match=r"actor\.logit_scale: not allowed with source: snapshot"):
        _snapshot_study(tmp_path, snapshot_copy, logit_scale=9.5)
    with pytest.raises(PreregistrationError, match=r"actor\.path: missing required key \(source: snapshot\)"):
        _snapshot_study(tmp_path, "")
    text = SMOKE.read_text()
    missing_seed = r"actor\.synthetic_seed: missing required key \(source: synthetic\)"
    with pytest.raises(PreregistrationError, match=missing_seed):
        data = yaml.safe_load(text)
        data["actor"].pop("synthetic_seed")
        loads(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(PreregistrationError, match=r"teacher\.path: not allowed with source: synthetic"):
        data = yaml.safe_load(text)
        data["teacher"]["path"] = "models/x"
        loads(yaml.safe_dump(data, sort_keys=False))


def test_the_hub_example_asks_for_its_digest():
    with pytest.raises(PreregistrationError, match=r"actor\.payload_digest: .*`rollout models digest DIR`"):
        load(REPO / "params" / "examples" / "qwen3-0.6b-hub.yaml")
    filled = (REPO / "params" / "examples" / "qwen3-0.6b-hub.yaml").read_text().replace(
        "FILL-IN-with-rollout-models-digest", "0" * 64)  # quoted in the file: a string
    study = loads(filled)
    assert study.actor.source == study.teacher.source == "snapshot"
    assert study.actor.path == "../../models/qwen3-0.6b" and study.teacher.path == "../../models/qwen3-1.7b"
    assert study.workload == load(REPO / "params" / "rollout-runtime-v2.yaml").workload


def test_calibration_and_build_refuse_a_snapshot_model(tmp_path, snapshot_copy):
    from rollout_lib.models.calibration import calibrate_logit_scale

    study = _snapshot_study(tmp_path, snapshot_copy)
    with pytest.raises(ValueError, match=r"actor\.source: 'snapshot': the logit scale is calibrated for synthetic"):
        calibrate_logit_scale(study, "tiny", role="actor")
