"""The full RL cycle on CPU with the tiny smoke actor and teacher (issue 15): the cycle study's
bad-input refusals, the losses decreasing on a fixed batch, the sync carrying the exact updated
tensors, every phase present with its status, and the memory plan refusing a budget that is too small."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from rollout_lib.backends import create_backend
from rollout_lib.core import REPO_ROOT
from rollout_lib.measure.cycle import PHASES, CycleBudgetError, run_cycles
from rollout_lib.measure.rawfile import read_raw, read_seals
from rollout_lib.models.policy import read_policy_from_peft
from rollout_lib.models.synthetic import ensure_snapshot, load_causal_lm
from rollout_lib.models.training import (
    LOGPROB_CHUNK_TOKENS,
    ActorTrainer,
    TrainedPolicy,
    gkd_loss,
    lora_parameters,
    pg_k1_loss,
    token_logprobs,
)
from rollout_lib.study.cycle import CycleStudyError, load, loads

from .conftest import oracle_rollout

SMOKE_CYCLE = REPO_ROOT / "params" / "profiles" / "smoke-cycle.yaml"
PREREGISTERED = REPO_ROOT / "params" / "rollout-runtime-v2-cycle.yaml"


@pytest.fixture(scope="module")
def cycle_study():
    return load(SMOKE_CYCLE)


def test_the_preregistered_cycle_study_loads_and_pins_the_rollout_study():
    study = load(PREREGISTERED)
    assert study.cycles == 8 and set(study.cells) == {"p128-r256-n4-stochastic", "p512-r512-n4-stochastic"}
    assert study.rollout.sha256 == study.rollout_preregistration_sha256 and len(study.sha256) == 64
    assert study.sha256 != study.rollout.sha256


@pytest.mark.parametrize(("edit", "field", "message"), [
    (("rollout_preregistration_sha256: 3bd6", "rollout_preregistration_sha256: 0bd6"),
     "rollout_preregistration_sha256", "the cycle study pins"),
    (("cells: [p16-r24-n2-stochastic", "cells: [p16-r24-n9-stochastic"), "cells[0]", "is not a cell of smoke.yaml"),
    (("cells: [p16-r24-n2-stochastic", "cells: [p16-r24-n2-greedy"), "cells[0]", "allowed: the stochastic cells"),
    (("name: adamw", "name: sgd"), "optimizer.name", "allowed: 'adamw'"),
    (("cycles: 3", "cycles: 0"), "cycles", "below the minimum"),
    (("kl_coefficient: 0.05", "kl_coefficient: 0.05\n    kl_target: 1"), "algorithms.pg_k1.kl_target", "unknown key"),
    (("backends: [hf_cached, vllm, hf_reference]", "backends: [sglang]"), "backends[0]", "allowed: 'hf_reference'"),
    (("micro_batch_rows: 2", "micro_batch_rows: two"), "optimizer.micro_batch_rows", "expected an integer"),
])
def test_a_malformed_cycle_study_is_refused_naming_the_field(edit, field, message):
    text = SMOKE_CYCLE.read_text()
    assert edit[0] in text
    with pytest.raises(CycleStudyError) as caught:
        loads(text.replace(edit[0], edit[1], 1))
    assert caught.value.key_path == field and message in str(caught.value)


@pytest.fixture(scope="module")
def tiny(cycle_study, tmp_path_factory):
    """The smoke actor (NF4 + LoRA, float32 compute on CPU), the smoke teacher and one fixed batch."""
    cache = str(tmp_path_factory.mktemp("cycle-snapshots"))
    rollout = cycle_study.rollout
    backend, workload, start, _, batch, rows = oracle_rollout(rollout, cache, "p16-r24-n2-stochastic")
    spec = rollout.teacher
    snapshot = ensure_snapshot(spec.architecture.name, spec.synthetic_seed, spec.logit_scale,
                               expected_digest=spec.payload_digest, cache_dir=cache)
    teacher = load_causal_lm(snapshot.path, torch.float32, "cpu")
    yield {"backend": backend, "rows": rows, "teacher": teacher, "pad": workload.arch.bos_token_id,
           "rollout_lp": [torch.tensor(res.logprobs) for res in batch.results], "cache": cache, "start": start}
    backend.teardown()


@pytest.mark.parametrize("chunk_tokens", [LOGPROB_CHUNK_TOKENS, 5])
def test_scoring_matches_the_backends_own_log_probabilities(tiny, chunk_tokens):
    """Micro-batched, right-padded teacher-forced scoring of the actor equals what the oracle recorded
    while generating (same float32 actor): the padding, the micro-batches and the LM-head chunks
    (5 positions: several per 24-token response, the last one short) change nothing."""
    scored = token_logprobs(tiny["backend"].model, tiny["rows"], "cpu", tiny["pad"], micro_batch_rows=3,
                            chunk_tokens=chunk_tokens)
    for got, expected in zip(scored, tiny["rollout_lp"], strict=True):
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-4)


def test_the_memory_strategy_leaves_the_gradient_unchanged(tiny):
    """Checkpointed decoder layers and checkpointed 5-position LM-head chunks (what the trainer does
    to stay inside 16 GiB) give the same loss and LoRA gradients as keeping every activation."""
    actor = tiny["backend"].model
    rows, pad = tiny["rows"], tiny["pad"]
    tokens = sum(len(r) for _, r in rows)
    params = lora_parameters(actor)
    for param in params:
        param.requires_grad_(True)

    decoder, head = actor.get_base_model().model, actor.get_base_model().get_output_embeddings()
    calls = {"layer": 0, "head": 0}
    hooks = [decoder.layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__("layer", calls["layer"] + 1)),
             head.register_forward_pre_hook(lambda *_: calls.__setitem__("head", calls["head"] + 1))]

    def gradients(chunk_tokens: int, checkpoint_head: bool) -> tuple[float, list[torch.Tensor]]:
        for param in params:
            param.grad = None
        calls.update(layer=0, head=0)
        losses = []

        def on_micro_batch(indices, logprobs):
            loss = pg_k1_loss(logprobs, [tiny["rollout_lp"][i] for i in indices], [0.5 - i % 2 for i in indices],
                              0.05, tokens)
            losses.append(float(loss.detach()))
            return loss

        actor.train()
        try:
            token_logprobs(actor, rows, "cpu", pad, 3, grad=True, on_micro_batch=on_micro_batch,
                           chunk_tokens=chunk_tokens, checkpoint_head=checkpoint_head)
        finally:
            actor.eval()
        return sum(losses), [p.grad.clone() for p in params]

    micro_batches = -(-len(rows) // 3)
    try:
        actor.gradient_checkpointing_disable()
        plain_loss, plain = gradients(10**6, checkpoint_head=False)
        assert calls == {"layer": micro_batches, "head": len(rows)}  # nothing recomputed
        actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        strategy_loss, strategy = gradients(5, checkpoint_head=True)
    finally:
        for hook in hooks:
            hook.remove()
    chunks = sum(-(-len(r) // 5) for _, r in rows)
    assert calls == {"layer": 2 * micro_batches, "head": 2 * chunks}  # each recomputed once in the backward
    assert any(float(g.abs().max()) > 0 for g in plain)
    assert strategy_loss == pytest.approx(plain_loss, rel=1e-6, abs=1e-9)
    for got, expected in zip(strategy, plain, strict=True):
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("algorithm", ["direct_gkd", "pg_k1"])
def test_the_loss_decreases_over_steps_on_a_fixed_batch(cycle_study, tiny, algorithm):
    """On one fixed batch, the objective each loss follows goes down step after step: for direct GKD,
    whose gradient is that of 1/2 mean (log pi - log p_T)^2 on a fixed batch, that squared gap; for
    PG-k1 the loss itself. (The actor's LoRA is restored afterwards.)"""
    actor = tiny["backend"].model
    saved = read_policy_from_peft(actor)
    rows, pad = tiny["rows"], tiny["pad"]
    tokens = sum(len(r) for _, r in rows)
    teacher = token_logprobs(tiny["teacher"], rows, "cpu", pad, 4)
    rewards = [float(i % 3) for i in range(len(rows))]  # any fixed advantages
    advantages = [r - sum(rewards) / len(rewards) for r in rewards]
    beta = cycle_study.algorithms.pg_k1.kl_coefficient

    def loss_for(indices, logprobs):
        if algorithm == "direct_gkd":
            return gkd_loss(logprobs, [teacher[i] for i in indices], tokens)
        return pg_k1_loss(logprobs, [tiny["rollout_lp"][i] for i in indices], [advantages[i] for i in indices],
                          beta, tokens)

    def objective(logprobs):
        if algorithm == "direct_gkd":
            return float(sum(((a - t) ** 2).sum() for a, t in zip(logprobs, teacher, strict=True)) / (2 * tokens))
        return float(loss_for(range(len(rows)), logprobs))

    trainer = ActorTrainer(actor, cycle_study.optimizer)
    try:
        values = [objective(token_logprobs(actor, rows, "cpu", pad, 4))]
        for _ in range(4):
            trainer.step(loss_for, rows, "cpu", pad)
            values.append(objective(token_logprobs(actor, rows, "cpu", pad, 4)))
    finally:
        from rollout_lib.models.policy import copy_lora_tensors

        copy_lora_tensors(actor, saved, tiny["start"].scaling)
    assert all(b < a for a, b in itertools.pairwise(values)), values


def test_the_sync_carries_the_exact_updated_tensors(cycle_study, tiny):
    """hf_cached (graphs path, CPU): after one optimizer step on its actor, the policy sync puts those
    exact float32 tensors into the engine's static buffers, and the identity says so."""
    rollout = cycle_study.rollout
    backend = create_backend("hf_cached", rollout, device="cpu", compute_dtype="float32", cache_dir=tiny["cache"])
    backend.cold_start()
    try:
        backend.sync_policy(tiny["start"])
        before = backend.engine.read_lora()
        trainer = ActorTrainer(backend.actor, cycle_study.optimizer)
        rows, pad = tiny["rows"], tiny["pad"]
        tokens = sum(len(r) for _, r in rows)
        teacher = token_logprobs(tiny["teacher"], rows, "cpu", pad, 4)
        trainer.step(lambda idx, lp: gkd_loss(lp, [teacher[i] for i in idx], tokens), rows, "cpu", pad)
        live = read_policy_from_peft(backend.actor)
        trained = TrainedPolicy(2, tiny["start"].base_digest, tiny["start"].arch, tiny["start"].lora, live)
        assert backend.sync_policy(trained) == trained.identity != tiny["start"].identity
        served = backend.engine.read_lora()
        assert set(served) == set(live) and all(torch.equal(served[k], live[k]) for k in live)
        assert any(not torch.equal(before[k], served[k]) for k in live), "the step must change the tensors"
    finally:
        backend.teardown()


@pytest.mark.parametrize("backend_name", ["hf_cached", "hf_reference"])
def test_a_cycle_run_records_every_phase_and_seals_its_raw_file(cycle_study, tiny, tmp_path, backend_name):
    path = run_cycles(cycle_study, backend_name, "pg_k1", "p16-r24-n2-stochastic", "cyc", run_id="t1",
                      output_dir=tmp_path, device="cpu", cache_dir=tiny["cache"], cycles=2)
    records, torn = read_raw(path)
    assert not torn and [r["record"] for r in records] == ["header", "cold_start", "cycle", "cycle", "teardown"]
    header = records[0]
    assert header["cycle_study_sha256"] == cycle_study.sha256 and header["algorithm"] == "pg_k1"
    assert sum(header["memory_plan_bytes"].values()) <= header["budget_bytes"]
    assert header["backend_options"] == {}, "the study's own setting: no options beyond it"
    policies = []
    for cycle in records[2:4]:
        assert set(cycle["phases"]) == set(PHASES)
        assert all(p["status"] == "measured" and p["seconds"] > 0 for p in cycle["phases"].values())
        assert all(m["status"] == "not_applicable" for m in cycle["memory"].values())  # CPU: no GPU memory
        assert cycle["complete_cycle_s"] >= sum(p["seconds"] for p in cycle["phases"].values())
        assert cycle["full_cycle_tokens_per_s"] < cycle["rollout_tokens_per_s"]
        assert cycle["sync_exact"] and cycle["served_identity"] == cycle["next_policy_identity"]
        assert cycle["mismatch"]["status"] == "measured" and cycle["mismatch"]["importance_ratio_min"] > 0
        policies.append((cycle["policy_identity"], cycle["next_policy_identity"]))
    assert policies[1][0] == policies[0][1], "cycle 2 rolls out with the policy cycle 1 trained"
    assert header["training_memory"] == {**header["training_memory"], "gradient_checkpointing": True,
                                         "logprob_chunk_tokens": LOGPROB_CHUNK_TOKENS}
    assert all(c["memory_by_process"]["rollout_end"]["status"] == "not_applicable" for c in records[2:4])
    seals = read_seals(tmp_path / "cycles" / "raw" / "cyc")
    assert f"{backend_name}/{path.name}" in seals


@pytest.mark.parametrize("failing_cycle", [0, 1])
def test_a_run_that_fails_mid_way_says_where_and_is_sealed(cycle_study, tiny, tmp_path, monkeypatch, failing_cycle):
    """An exception in the actor update (here a stand-in for lease 11's CUDA OOM) leaves a `failure`
    record naming the cycle and phase, tears the backend down, seals the file as abandoned and
    re-raises; cycle-publish names a run without one cycle as excluded with that reason, and a run
    with earlier cycles as an incomplete row."""
    from rollout_lib.evidence.cycles import publish_cycles

    steps = {"n": 0}
    real_step = ActorTrainer.step

    def failing_step(self, *args, **kwargs):
        if steps["n"] == failing_cycle:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 298.00 MiB (stand-in)")
        steps["n"] += 1
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(ActorTrainer, "step", failing_step)
    with pytest.raises(torch.OutOfMemoryError, match="stand-in"):
        run_cycles(cycle_study, "hf_cached", "pg_k1", "p16-r24-n2-stochastic", "cyc", run_id="f1",
                   output_dir=tmp_path, device="cpu", cache_dir=tiny["cache"], cycles=2)
    (path,) = (tmp_path / "cycles" / "raw" / "cyc" / "hf_cached").glob("*.jsonl")
    records, torn = read_raw(path)
    kinds = [r["record"] for r in records]
    assert not torn and kinds == ["header", "cold_start"] + ["cycle"] * failing_cycle + [
        "failure", "sealed_without_teardown"]
    failure = records[-2]
    assert (failure["cycle"], failure["phase"]) == (failing_cycle, "actor_update")
    assert failure["error"].startswith("OutOfMemoryError: CUDA out of memory.")
    assert read_seals(tmp_path / "cycles" / "raw" / "cyc")[f"hf_cached/{path.name}"]["ended"] == "abandoned"
    aggregate = json.loads(publish_cycles(cycle_study, "cyc", tmp_path).read_text())
    if failing_cycle == 0:
        (excluded,) = aggregate["excluded"]
        assert excluded["reason"].startswith("no cycle record: failed in cycle 0's actor_update: OutOfMemoryError")
        assert not aggregate["rows"]
    else:
        (row,) = aggregate["rows"]
        assert not row["complete"] and row["cycles"] == 1 and not aggregate["excluded"]


def test_the_budget_check_fires_when_the_budget_is_too_small(tmp_path):
    text = SMOKE_CYCLE.read_text().replace("budget_bytes: 17179869184", "budget_bytes: 1048576", 1)
    text = text.replace("gate_peak_total_bytes: 15569256448", "gate_peak_total_bytes: 1000000", 1)
    study = loads(text)
    with pytest.raises(CycleBudgetError, match=r"over the budget memory.budget_bytes 0.00 GiB \(actor_nf4_weights"):
        run_cycles(study, "hf_cached", "pg_k1", "p16-r24-n2-stochastic", "cyc", output_dir=tmp_path, device="cpu")
    assert not (tmp_path / "cycles").exists(), "a refused plan writes nothing"


def test_cycle_cli_refuses_an_unknown_algorithm(tmp_path, capsys):
    from rollout_lib.cli import main

    code = main(["cycle", "--params", str(SMOKE_CYCLE), "--backend", "hf_cached", "--algorithm", "ppo",
                 "--cell", "p16-r24-n2-stochastic", "--campaign", "c", "--output-dir", str(tmp_path)])
    assert code == 2
    assert "algorithm 'ppo' is not known; allowed: direct_gkd, pg_k1" in capsys.readouterr().err
    assert not Path(tmp_path, "cycles").exists()


def test_cycle_publish_derives_checks_and_refuses_tampering(cycle_study, tiny, tmp_path):
    from rollout_lib.evidence.cycles import check_cycles, publish_cycles
    from rollout_lib.evidence.publish import EvidenceRefused

    path = run_cycles(cycle_study, "hf_cached", "direct_gkd", "p16-r24-n2-stochastic", "cyc", run_id="p1",
                      output_dir=tmp_path, device="cpu", cache_dir=tiny["cache"])
    published = publish_cycles(cycle_study, "cyc", tmp_path)
    check_cycles(cycle_study, "cyc", tmp_path)
    aggregate = json.loads(published.read_text())
    (row,) = aggregate["rows"]
    assert row["complete"] and row["cycles"] == cycle_study.cycles and row["sync_exact"]
    assert all(p["status"] == "measured" and p["median_s"] > 0 for p in row["phases"].values())
    assert row["memory_gate"]["status"] == "fail" and "not_applicable" in row["memory_gate"]["reason"]
    assert row["full_cycle_tokens_per_s_median"] < row["rollout_tokens_per_s_median"]
    variants = len(cycle_study.backends) - 1 + len(cycle_study.memory.vllm_modes)  # vllm: one run per memory mode
    expected_missing = variants * 2 * len(cycle_study.cells) - 1
    assert len(aggregate["missing"]) == expected_missing
    with path.open("ab") as handle:  # a fabricated cycle after the seal
        handle.write(b'{"record": "cycle", "cycle": 9}\n')
    with pytest.raises(EvidenceRefused, match="changed after its run ended"):
        check_cycles(cycle_study, "cyc", tmp_path)


def test_report_full_cycle_section(cycle_study, tiny, tmp_path):
    from rollout_lib.evidence.cycles import publish_cycles
    from rollout_lib.report import cycle as cycle_report

    assert cycle_report.load_cycle_aggregate(tmp_path, "cyc") is None
    run_cycles(cycle_study, "hf_cached", "pg_k1", "p16-r24-n2-stochastic", "cyc", run_id="r1", output_dir=tmp_path,
               device="cpu", cache_dir=tiny["cache"], cycles=1)
    publish_cycles(cycle_study, "cyc", tmp_path)
    aggregate = cycle_report.load_cycle_aggregate(tmp_path, "cyc")
    table = cycle_report.cycle_table(aggregate)
    assert list(table.columns[4:9]) == [f"{p.replace('_', ' ')} s" for p in PHASES]
    assert table.loc[0, "cycles"] == f"1/{cycle_study.cycles} (incomplete)"
    cells = [str(v) for v in table.to_numpy().ravel()]
    assert not {"None", "True", "False", "nan"} & set(cells), cells  # issue 14: no bare values
    assert table.loc[0, "memory gate (peak)"] == "FAIL: no NVML peak per phase (not_applicable)"
    assert cycle_report.cycle_phase_figure(aggregate) is not None
    assert cycle_report.cycle_memory_figure(aggregate) is None  # CPU: no GPU memory to draw
    assert cycle_report.runs_not_counted(aggregate) is None
    header = json.loads((tmp_path / aggregate["rows"][0]["raw_file"]).read_text().splitlines()[0])
    commit = header["environment"]["source"].get("source_commit")
    with_source = cycle_report.cycle_table(aggregate, tmp_path)
    assert with_source.loc[0, "source commit"].startswith(commit[:7] if commit else header["environment"]["source"]
                                                          ["status"])
    assert with_source.loc[0, "trainer memory"] == f"checkpointed layers, head chunks of {LOGPROB_CHUNK_TOKENS}"
    run_cycles(cycle_study, "hf_cached", "pg_k1", "p16-r24-n2-stochastic", "cyc", run_id="r2", output_dir=tmp_path,
               device="cpu", cache_dir=tiny["cache"], cycles=1)
    publish_cycles(cycle_study, "cyc", tmp_path)
    not_counted = cycle_report.runs_not_counted(cycle_report.load_cycle_aggregate(tmp_path, "cyc"))
    assert list(not_counted["why"]) == ["superseded by cycles/raw/cyc/hf_cached/pg_k1-p16-r24-n2-stochastic-r2.jsonl"]


def test_vllm_memory_modes_are_checked(cycle_study, tmp_path):
    with pytest.raises(ValueError, match="vllm_memory_mode None is not allowed; allowed: sleep, small_kv"):
        run_cycles(cycle_study, "vllm", "pg_k1", "p16-r24-n2-stochastic", "c", output_dir=tmp_path)
    with pytest.raises(ValueError, match="vllm_memory_mode applies to the vllm backend only, not hf_cached"):
        run_cycles(cycle_study, "hf_cached", "pg_k1", "p16-r24-n2-stochastic", "c", output_dir=tmp_path,
                   vllm_memory_mode="sleep")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sleep_mode needs a CUDA device"):
            create_backend("vllm", cycle_study.rollout, sleep_mode=True)


def test_a_cycle_run_that_the_deadline_would_cut_is_not_started(cycle_study, tiny, tmp_path, capsys):
    """A cycle run cannot be continued (its training state lives in the process): `--deadline-s` starts none
    whose estimate, the newest complete run of its kind on this GPU model, does not fit."""
    import argparse

    from rollout_lib.cli import _cycle_deadline_refusal, main
    from rollout_lib.measure.cycle import estimated_run_s

    cell, full = "p16-r24-n2-stochastic", cycle_study.cycles
    assert estimated_run_s(tmp_path, "cyc", "hf_cached", "pg_k1", cell, full) is None  # nothing yet: no estimate
    path = run_cycles(cycle_study, "hf_cached", "pg_k1", cell, "cyc", run_id="e1", output_dir=tmp_path, device="cpu",
                      cache_dir=tiny["cache"])
    records = read_raw(path)[0]
    probe = run_cycles(cycle_study, "hf_cached", "pg_k1", cell, "cyc", run_id="e3", output_dir=tmp_path,
                       device="cpu", cache_dir=tiny["cache"], cycles=1)  # newer, but a probe: not a full run
    seconds, source = estimated_run_s(tmp_path, "cyc", "hf_cached", "pg_k1", cell, full)
    assert source == path.name != probe.name and 0 < seconds < 600
    assert abs(seconds - (_utc(records[-1]["utc"]) - _utc(records[0]["utc"]))) < 1e-6  # header to teardown
    cut = path.with_name(path.name.replace("-e1", "-e2"))  # a later run that never reached its teardown
    cut.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:-1]))
    assert estimated_run_s(tmp_path, "cyc", "hf_cached", "pg_k1", cell, full)[1] == path.name
    assert estimated_run_s(tmp_path, "cyc", "hf_cached", "pg_k1", cell, 1)[1] == probe.name  # its own count
    assert estimated_run_s(tmp_path, "cyc", "hf_cached", "direct_gkd", cell, full)[1] == path.name  # same rollout
    assert estimated_run_s(tmp_path, "cyc", "hf_reference", "pg_k1", cell, full) is None
    assert estimated_run_s(tmp_path, "cyc", "hf_cached", "pg_k1", cell, full,
                           gpu={"status": "measured", "name": "NVIDIA H200", "driver": "580"}) is None

    before = sorted(path.parent.iterdir())
    args = ["cycle", "--params", str(SMOKE_CYCLE), "--backend", "hf_cached", "--algorithm", "pg_k1", "--cell", cell,
            "--campaign", "cyc", "--output-dir", str(tmp_path), "--device", "cpu"]
    assert main([*args, "--deadline-s", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "cycle: skipped (deadline): estimate" in out and path.name in out and "no raw file written" in out
    assert sorted(path.parent.iterdir()) == before
    assert main([*args, "--deadline-s", "-3"]) == 2
    assert "deadline-s: -3.0 is not allowed" in capsys.readouterr().err
    roomy = argparse.Namespace(deadline_s=seconds * 2 + 60, output_dir=str(tmp_path), campaign="cyc",
                               backend="hf_cached", algorithm="pg_k1", cell=cell, vllm_memory_mode=None)
    assert _cycle_deadline_refusal(roomy, full) is None and "fits the" in capsys.readouterr().out


def _utc(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp).timestamp()


def test_the_cycle_memory_probe_runs_both_settings_with_the_same_gradient(tmp_path):
    """The device probe of the update's memory (tools/lab/cycle_memory_probe.py), on CPU with the
    tiny study: both settings run, and they compute the same gradient (only memory and time differ)."""
    from tools.lab import cycle_memory_probe

    out = tmp_path / "probe.json"
    assert cycle_memory_probe.main(["--params", str(SMOKE_CYCLE), "--cell", "p16-r24-n2-stochastic", "--device", "cpu",
                                    "--repeats", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    before, after = result["settings"]["before"][0], result["settings"]["after"][0]
    assert before["grad_norm"] > 0 and after["grad_norm"] == pytest.approx(before["grad_norm"], rel=1e-4)
    assert result["environment"]["model_digests"]["actor"]


def test_the_report_names_a_run_measured_before_the_memory_strategy(tmp_path):
    """A header without `training_memory` (lease 11's runs) reads as every activation kept, so a table
    that mixes trainers says so per row; a file whose cycles list no processes has no memory split."""
    from rollout_lib.report.cycle import _raw_facts

    (tmp_path / "old.jsonl").write_text(json.dumps({"record": "header", "environment": {"source": {
        "source_commit": "965c53016ff7c5b139cffb2aa6fd508ba6fe4b7d", "source_dirty": False}}}) + "\n")
    assert _raw_facts(tmp_path, "old.jsonl") == {
        "source commit": "965c530", "trainer memory": "every activation kept (before the memory strategy)",
        "trainer / engine GiB at rollout end": "—"}
    assert _raw_facts(tmp_path, "absent.jsonl")["trainer memory"] == "unreadable"


def test_the_report_splits_trainer_and_engine_memory_and_names_engine_options(tmp_path):
    """The cycle table says what a process-tree peak is made of (trainer vs the engine's processes at
    the rollout's end, the largest over cycles) and which runs had engine options beyond the study's."""
    from rollout_lib.report.cycle import _raw_facts, cycle_table

    gib = 2**30

    def cycle(trainer, engine):
        processes = [{"role": "this process", "used_bytes": trainer}] + (
            [{"role": "child", "used_bytes": engine}] if engine else [])
        return {"record": "cycle", "memory_by_process": {"rollout_end": {"status": "measured",
                                                                         "processes": processes}}}

    header = {"record": "header", "environment": {"source": {"source_commit": "a" * 40, "source_dirty": False}},
              "training_memory": {"gradient_checkpointing": True, "logprob_chunk_tokens": 128}}
    lines = [header | {"backend_options": {"extra_server_args": ["--max-num-seqs", "256"]}},
             cycle(7 * gib, 8 * gib), cycle(int(7.5 * gib), 6 * gib)]
    (tmp_path / "engine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "local.jsonl").write_text("".join(json.dumps(r) + "\n" for r in
                                                  [header | {"backend_options": {}}, cycle(12 * gib, 0)]))
    facts = _raw_facts(tmp_path, "engine.jsonl")
    assert facts["trainer / engine GiB at rollout end"] == "7.50 / 8.00"
    assert facts["backend options"] == '{"extra_server_args": ["--max-num-seqs", "256"]}'
    local = _raw_facts(tmp_path, "local.jsonl")
    assert local["trainer / engine GiB at rollout end"] == "12.00 / not_applicable"
    assert "backend options" not in local

    def row(raw_file):
        phase = {"status": "measured", "median_s": 1.0}
        return {"backend": "vllm", "vllm_memory_mode": "small_kv", "algorithm": "pg_k1", "cell_id": "c",
                "cycles": 8, "complete": True, "phases": {name: phase for name in
                                                          ("rollout", "teacher_scoring", "actor_scoring",
                                                           "actor_update", "policy_sync")},
                "complete_cycle_median_s": 5.0, "rollout_tokens_per_s_median": 1.0,
                "full_cycle_tokens_per_s_median": 1.0, "memory_gate": {"status": "pass",
                                                                       "peak_process_tree_bytes": gib},
                "mismatch": {"status": "not_measured"}, "sync_exact": True, "raw_file": raw_file}

    table = cycle_table({"rows": [row("engine.jsonl"), row("local.jsonl")], "cycles_required": 8}, tmp_path)
    assert list(table["backend options"]) == ['{"extra_server_args": ["--max-num-seqs", "256"]}', "none"]


def test_cycle_memory_split_reads_the_processes_and_refuses_other_files(tmp_path, capsys):
    """tools/cycle_memory_split.py: trainer vs engine at the rollout's and the update's end (largest over
    cycles), the tree's peak and the options a run had; a file that is not a cycle run is named, exit 2."""
    from tools import cycle_memory_split

    gib = 2**30

    def cycle(engine_awake, engine_asleep, peak, rate):
        def at(engine):
            return {"status": "measured", "processes": [{"role": "this process", "used_bytes": 7 * gib},
                                                        {"role": "child", "used_bytes": engine}]}
        return {"record": "cycle", "rollout_tokens_per_s": rate,
                "memory_by_process": {"rollout_end": at(engine_awake), "actor_update_end": at(engine_asleep)},
                "memory": {"rollout": {"nvml": {"status": "measured", "peak_process_tree_bytes": peak}},
                           "actor_update": {"nvml": {"status": "not_measured"}}}}

    header = {"record": "header", "kind": "rl_cycle", "backend": "vllm", "vllm_memory_mode": "sleep",
              "backend_options": {"extra_server_args": ["--max-num-seqs", "256"]}}
    run = tmp_path / "run.jsonl"
    run.write_text("".join(json.dumps(r) + "\n" for r in [header, cycle(8 * gib, 2 * gib, 15 * gib, 100.0),
                                                           cycle(6 * gib, gib, 14 * gib, 300.0)]))
    row = cycle_memory_split.summarize(run)
    assert (row["trainer_rollout_end_gib"], row["engine_rollout_end_gib"], row["engine_actor_update_end_gib"]) == (
        7.0, 8.0, 2.0)
    assert row["peak_process_tree_gib"] == 15.0 and row["rollout_tokens_per_s_median"] == 200.0
    assert row["backend_options"] == header["backend_options"] and row["cycles"] == 2
    assert cycle_memory_split.main([str(run)]) == 0
    assert "run.jsonl\tsleep\t" in capsys.readouterr().out
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"record": "header", "kind": "rollout"}) + "\n")
    assert cycle_memory_split.main([str(run), str(other)]) == 2
    assert "other.jsonl: not an RL-cycle raw file" in capsys.readouterr().err


def test_a_first_cycle_run_is_bounded_by_its_rollouts_in_the_rollout_campaign(cycle_study, tmp_path, capsys):
    """With no earlier cycle run of its kind (the oracle's first), `--deadline-s` still refuses a run whose
    rollouts alone, each as fast as the cell's fastest repetition in the rollout campaign on this GPU
    model, would not fit: the oracle's eight p128-r256 rollouts outlast a machine hold."""
    from rollout_lib.cli import main
    from rollout_lib.measure.cycle import rollout_lower_bound_s
    from rollout_lib.measure.identity import gpu_identity

    cell, full = "p16-r24-n2-stochastic", cycle_study.cycles
    assert rollout_lower_bound_s(tmp_path, "cyc", "hf_reference", cell, full) is None
    folder = tmp_path / "raw" / "cyc" / "hf_reference"
    folder.mkdir(parents=True)

    def rep(cell_id, wall_s, **extra):
        return {"record": "repetition", "cell_id": cell_id, "wall_s": wall_s, **extra}

    lines = [{"record": "header", "environment": {"gpu": gpu_identity()}},
             rep(cell, 90.0, excluded_by="INV-WARMUP"), rep(cell, 120.0), rep(cell, 100.0), rep("other", 1.0)]
    (folder / "r1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    elsewhere = [{"record": "header", "environment": {"gpu": {"status": "measured", "name": "NVIDIA H200",
                                                              "driver": "580"}}}, rep(cell, 1.0)]
    (folder / "r2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in elsewhere))  # another GPU: ignored
    seconds, source = rollout_lower_bound_s(tmp_path, "cyc", "hf_reference", cell, full)
    assert seconds == 90.0 * full and "fastest of 3 repetitions" in source

    args = ["cycle", "--params", str(SMOKE_CYCLE), "--backend", "hf_reference", "--algorithm", "pg_k1", "--cell", cell,
            "--campaign", "cyc", "--output-dir", str(tmp_path), "--device", "cpu"]
    assert main([*args, "--deadline-s", str(90.0 * full)]) == 0  # x1.15 + 20 s does not fit
    out = capsys.readouterr().out
    assert "cycle: skipped (deadline)" in out and f"lower bound: {full} rollouts x 90.0 s" in out
    assert not (tmp_path / "cycles").exists(), "no raw file written"
