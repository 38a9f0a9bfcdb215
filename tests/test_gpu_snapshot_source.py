"""GPU-marked: the preregistered full-size actor named as `source: snapshot` (issue 16) on the H200.

The synthetic Qwen3-0.6B snapshot is copied to a plain directory (no synthetic marker) and the
preregistration's actor is rewritten to `source: snapshot` with the same pinned digest. Both HF
backends then load it through `resolve_model_snapshot` with real NF4 (bitsandbytes CUDA) and must
produce the synthetic source's greedy tokens exactly (float32 compute, as tests/test_gpu_hf.py), and a
tampered copy must be refused at cold start, naming both digests. Where vLLM imports (staged as for
tests/test_gpu_vllm.py), the vllm backend builds its own mirror from the local snapshot (the synthetic
source's mirror digest, the tokenizer files beside it) and serves the policy from it. The CPU twins with
a tiny model: tests/test_snapshot_study.py, tests/test_vllm_engine.py.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from rollout_lib.models.local_snapshot import SnapshotDigestMismatch
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.workload import Workload

from .conftest import PREREG, copy_as_local_snapshot, snapshot_source_study, started_backends

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_part4]  # docs/reliability.md: GPU suite parts

CELL = "p128-r64-n1-greedy"
LOCAL = "models/qwen3-0.6b-local"  # relative to the study file


@pytest.fixture(autouse=True, scope="module")
def _servers_die_with_this_process():
    """A test killed at its time limit must not leave its vLLM server holding GPU memory (issue 40): the
    reaper kills this process's descendants when it dies (rollout_lib/lifetime.py)."""
    from rollout_lib.lifetime import start_reaper

    start_reaper()


@pytest.fixture(scope="module")
def local_snapshot_dir(prereg_study, tmp_path_factory):
    target = tmp_path_factory.mktemp("snapshot-source") / LOCAL
    copy_as_local_snapshot(prereg_study.actor, target)
    return target


@pytest.fixture(scope="module")
def snapshot_study(local_snapshot_dir):
    return snapshot_source_study(PREREG, local_snapshot_dir.parent.parent, LOCAL, revision="gpu-test")


def _greedy_tokens(study, backend_name: str) -> tuple[list[list[int]], str]:
    work = Workload(study)
    policy = policy_versions(work.arch, study.actor.lora, study.actor.payload_digest, 2)[-1]
    backend = started_backends(study, policy, (("b", backend_name, {}),),
                               device="cuda", compute_dtype="float32")["b"]
    try:
        tokens = [r.token_ids for r in backend.generate(work.requests(work.cell(CELL))).results]
        return tokens, backend.snapshot.payload_digest
    finally:
        backend.teardown()


@pytest.mark.parametrize("backend_name", ["hf_reference", "hf_cached"])
def test_snapshot_source_serves_the_synthetic_sources_greedy_tokens_full_size(prereg_study, snapshot_study,
                                                                               backend_name):
    assert snapshot_study.actor.source == "snapshot" and snapshot_study.actor.synthetic_seed is None
    synthetic_tokens, synthetic_digest = _greedy_tokens(prereg_study, backend_name)
    local_tokens, local_digest = _greedy_tokens(snapshot_study, backend_name)
    assert local_digest == synthetic_digest == prereg_study.actor.payload_digest
    assert len(local_tokens) == 4 and all(len(t) == 64 for t in local_tokens)
    assert local_tokens == synthetic_tokens


def test_a_tampered_full_size_snapshot_is_refused_on_the_gpu(local_snapshot_dir, prereg_study, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from rollout_lib.backends import create_backend

    tampered = tmp_path / LOCAL
    shutil.copytree(local_snapshot_dir, tampered)
    weights = sorted(tampered.glob("*.safetensors"))[0]
    with safe_open(str(weights), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (no iterator)
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(weights))
    backend = create_backend("hf_cached", snapshot_source_study(PREREG, tmp_path, LOCAL), device="cuda")
    try:
        with pytest.raises(SnapshotDigestMismatch, match=f"the study pins {prereg_study.actor.payload_digest}"):
            backend.cold_start()
    finally:
        backend.teardown()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable here")
def test_vllm_serves_a_snapshot_source_from_its_own_mirror_full_size(prereg_study, snapshot_study,
                                                                      local_snapshot_dir, tmp_path):
    """The mirror written from the local snapshot is the synthetic source's, byte for byte (its digest),
    with the snapshot's tokenizer files beside it, and the engine serves the policy exactly from it.
    Greedy tokens are compared on the CPU engine (tests/test_vllm_engine.py), not here: on the H200,
    vLLM 0.26.0 gave two engine starts on the same mirror digest and adapter different greedy
    continuations (lease 20: row 0 of p128-r64-n1-greedy diverged at token 9 of 64,
    outputs/perf/gpu-snapshot-source-vllm-lease20.log), so equal tokens there are not a property of
    the source."""
    from rollout_lib.backends import create_backend

    work = Workload(prereg_study)
    policy = policy_versions(work.arch, prereg_study.actor.lora, prereg_study.actor.payload_digest, 1)[0]
    requests = work.requests(work.cell(CELL))

    def serve(study, **options):
        backend = create_backend("vllm", study, **options)
        try:
            backend.cold_start()
            served_identity = backend.sync_policy(policy)
            return served_identity, [r.token_ids for r in backend.generate(requests).results], backend.mirror_digest
        finally:
            backend.teardown()

    synthetic_identity, _, synthetic_mirror = serve(prereg_study)
    cache = tmp_path / "cache"  # a mirror of its own, written from the local snapshot
    local_identity, local_tokens, local_mirror = serve(snapshot_study, cache_dir=str(cache))
    assert local_mirror == synthetic_mirror is not None
    (mirror,) = cache.glob("mirror-*")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (mirror / name).read_bytes() == (local_snapshot_dir / name).read_bytes(), name
    assert local_identity == synthetic_identity == policy.identity
    assert len(local_tokens) == 4 and all(len(t) == 64 for t in local_tokens)
