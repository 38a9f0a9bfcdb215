"""The report's exactness ladder by stand-in (issue 42): rows from the files under perf/standins-*/, labelled
by the preregistration each file was measured under, with not_measured where a rung has no file."""

from __future__ import annotations

import json

from rollout_lib.core import sha256_file
from rollout_lib.report.sections import _standin_ladder_html
from rollout_lib.report.standins import standin_ladder
from rollout_lib.study.prereg import load

from .conftest import SMOKE


def _local(prereg_sha, max_diff, agreement):
    return {"kind": "local_conformance", "preregistration_sha256": prereg_sha,
            "settings": {"prompt_tokens": [128], "response_tokens": [64, 256]},
            "float32": {"greedy_free_running_identical": 8, "greedy_free_running_requests": 8,
                        "partitions_identical": 16, "partitions_requests": 16},
            "bfloat16": {"sampled_logprob": {"max_abs_diff": max_diff},
                         "teacher_forced": {"argmax_agreement_rate": agreement, "disagreements_beyond_tie_margin": 1}}}


def test_two_stand_ins_side_by_side_with_their_rungs(tmp_path):
    study = load(SMOKE)
    folder = tmp_path / "perf" / "standins-lease99"
    folder.mkdir(parents=True)
    prereg = folder / "trained.yaml"
    prereg.write_text("study_id: trained\n")
    trained_sha = sha256_file(prereg)
    (folder / "actor.json").write_text(json.dumps({
        "payload_digest": "ab" * 32, "role": "actor", "arch": "qwen3-0.6b", "trained_tokens": 4194304,
        "final_metrics": {"heldout_loss_nats": 3.7378, "mean_entropy_nats": 3.7337}}))
    (folder / "conformance-R.json").write_text(json.dumps(_local(study.sha256, 0.356, 0.9672)))
    (folder / "conformance-T.json").write_text(json.dumps(_local(trained_sha, 0.0325, 0.99921875)))
    (folder / "oracle-T.json").write_text(json.dumps({
        "kind": "oracle_self_consistency", "preregistration_sha256": trained_sha, "max_abs_diff": 0.02,
        "scoring_noise": {"run_to_run_max_abs_diff": 0.0, "batch_composition_max_abs_diff": 0.0123}}))
    (folder / "notes.json").write_text("not json")
    rows = {r["stand-in"]: r for r in standin_ladder(tmp_path, study.sha256)}
    random_row = rows["this study's actor (random weights, logit-scaled)"]
    trained_row = rows["trained qwen3-0.6b (4.2M tokens, held-out loss 3.74 nats, entropy 3.73, no logit scale)"]
    assert random_row["bf16 hf_cached vs oracle: sampled max |Δ log p|"] == "0.356"
    assert trained_row["bf16 hf_cached vs oracle: sampled max |Δ log p|"] == "0.0325"
    assert trained_row["bf16 argmax agreement (beyond tie margin)"] == "99.92 % (1)"
    assert trained_row["float32 exact (greedy, partitions)"] == "8/8, 16/16"
    assert trained_row["oracle's scoring vs itself: run to run / batch composition"] == "0 / 0.0123"
    assert trained_row["oracle vs itself, the same check: its generation vs its scoring"] == "0.02"
    assert random_row["oracle's scoring vs itself: run to run / batch composition"] == "not_measured"
    assert trained_row["vLLM PG-k1 vs oracle: sampled max |Δ log p|"] == "not_measured"
    assert trained_row["evidence"] == ("perf/standins-lease99/conformance-T.json, "
                                       "perf/standins-lease99/oracle-T.json")
    page = _standin_ladder_html(tmp_path, study)
    assert "0.356 (prompts 128, responses 64,256)" in page and "0.0325" in page
    assert f"tolerance is {study.tolerances.nf4_sampled_logprob_abs:g}" in page


def test_no_stand_in_folder_adds_nothing(tmp_path):
    study = load(SMOKE)
    assert standin_ladder(tmp_path, study.sha256) == []
    assert _standin_ladder_html(tmp_path, study) == ""


def test_the_trained_reading_gives_the_numbers_the_verdict_cites(tmp_path):
    from rollout_lib.report.standins import trained_reading

    study = load(SMOKE)
    assert trained_reading(tmp_path, study.sha256) is None
    folder = tmp_path / "perf" / "standins-lease99"
    folder.mkdir(parents=True)
    prereg = folder / "trained.yaml"
    prereg.write_text("study_id: trained\n")
    trained_sha = sha256_file(prereg)
    (folder / "conformance-R.json").write_text(json.dumps(_local(study.sha256, 0.356, 0.9672)))
    assert trained_reading(tmp_path, study.sha256) is None, "the study's own actor is not a trained stand-in"
    (folder / "conformance-T.json").write_text(json.dumps(_local(trained_sha, 0.0325, 0.99921875)))
    assert trained_reading(tmp_path, study.sha256) is None, "no actor record beside it: not known to be trained"
    (folder / "qwen3-0.6b-actor.json").write_text(json.dumps({
        "payload_digest": "ab" * 32, "role": "actor", "arch": "qwen3-0.6b", "trained_tokens": 4194304,
        "final_metrics": {"heldout_loss_nats": 3.7378, "mean_entropy_nats": 3.7337}}))
    (folder / "conformance-other.json").write_text(json.dumps(_local("cd" * 32, 0.5, 0.9)))  # another study's
    reading = trained_reading(tmp_path, study.sha256)
    assert reading["label"].startswith("trained qwen3-0.6b")
    assert (reading["local_max"], reading["random_max"], reading["oracle_batch_max"]) == (0.0325, 0.356, None)
    assert reading["cells"] == "prompts 128, responses 64,256"
    (folder / "oracle-T.json").write_text(json.dumps({
        "kind": "oracle_self_consistency", "preregistration_sha256": trained_sha, "max_abs_diff": 0.02,
        "scoring_noise": {"run_to_run_max_abs_diff": 0.0, "batch_composition_max_abs_diff": 0.0123}}))
    reading = trained_reading(tmp_path, study.sha256)
    assert (reading["oracle_batch_max"], reading["oracle_run_max"]) == (0.0123, 0.0)
    assert (reading["oracle_self_max"], reading["random_oracle_self_max"]) == (0.02, None)
    assert reading["evidence"] == ["perf/standins-lease99/conformance-T.json", "perf/standins-lease99/oracle-T.json"]
    # the oracle against itself on this study's actor counts beside it only on the same cells
    (folder / "oracle-R.json").write_text(json.dumps({
        "kind": "oracle_self_consistency", "preregistration_sha256": study.sha256, "max_abs_diff": 0.353,
        "cells": {"p128-r64-n1-stochastic": []}, "scoring_noise": {}}))
    assert trained_reading(tmp_path, study.sha256)["random_oracle_self_max"] is None, "other cells than T's"
    (folder / "oracle-T.json").write_text(json.dumps({
        "kind": "oracle_self_consistency", "preregistration_sha256": trained_sha, "max_abs_diff": 0.02,
        "cells": {"p128-r64-n1-stochastic": []},
        "scoring_noise": {"run_to_run_max_abs_diff": 0.0, "batch_composition_max_abs_diff": 0.0123}}))
    assert trained_reading(tmp_path, study.sha256)["random_oracle_self_max"] == 0.353

    other = _local(study.sha256, 0.356, 0.9672)
    other["settings"] = {"prompt_tokens": [512], "response_tokens": [64]}
    (folder / "conformance-R.json").write_text(json.dumps(other))
    assert trained_reading(tmp_path, study.sha256)["random_max"] is None, "other cells: no ratio"
    # vLLM PG-k1 on the trained stand-in, and on this study's actor beside it only on the same cells
    def vllm(prereg_sha, max_diff, cells):
        return {"kind": "vllm_conformance", "preregistration_sha256": prereg_sha,
                "sampled_logprob": {"max_abs_diff": max_diff, "cells": {c: [] for c in cells}}}

    assert trained_reading(tmp_path, study.sha256)["vllm_max"] is None
    (folder / "vllm-T.json").write_text(json.dumps(vllm(trained_sha, 0.0584, ["p128-r64-n1-stochastic"])))
    (folder / "vllm-R.json").write_text(json.dumps(vllm(study.sha256, 0.2996, ["p128-r256-n1-stochastic"])))
    reading = trained_reading(tmp_path, study.sha256)
    assert (reading["vllm_max"], reading["random_vllm_max"]) == (0.0584, None), "other cells than T's"
    (folder / "vllm-R.json").write_text(json.dumps(vllm(study.sha256, 0.2996, ["p128-r64-n1-stochastic"])))
    assert trained_reading(tmp_path, study.sha256)["random_vllm_max"] == 0.2996


def test_a_stand_in_trained_with_other_kernels_is_its_own_row(tmp_path):
    """The same recipe trained with `--kernels fast` rounds differently: its files must not fill the reference
    stand-in's row (labels are the rows' keys)."""
    import dataclasses

    from rollout_lib.models.train_standin import KERNEL_PRESETS

    study = load(SMOKE)
    for name, kernels in (("standins-a", KERNEL_PRESETS["reference"]), ("standins-b", KERNEL_PRESETS["fast"])):
        folder = tmp_path / "perf" / name
        folder.mkdir(parents=True)
        (folder / "trained.yaml").write_text(f"study_id: {name}\n")
        (folder / "actor.json").write_text(json.dumps({
            "payload_digest": "ab" * 32, "role": "actor", "arch": "qwen3-0.6b", "trained_tokens": 4194304,
            "kernels": dataclasses.asdict(kernels) | {"sdpa_backend": None},
            "final_metrics": {"heldout_loss_nats": 3.7378, "mean_entropy_nats": 3.7337}}))
        (folder / "conformance-T.json").write_text(json.dumps(_local(sha256_file(folder / "trained.yaml"), 0.03,
                                                                     0.999)))
    labels = [r["stand-in"] for r in standin_ladder(tmp_path, study.sha256)]
    assert labels == ["trained qwen3-0.6b (4.2M tokens, held-out loss 3.74 nats, entropy 3.73, no logit scale)",
                      "trained qwen3-0.6b (4.2M tokens, kernels fast (sdpa, fused, fill uninitialized off), held-out "
                      "loss 3.74 nats, entropy 3.73, no logit scale)"]
    # a set of flags that is no named set lists what differs from the reference, without a name
    actor = json.loads((folder / "actor.json").read_text())
    (folder / "actor.json").write_text(json.dumps(actor | {"kernels": actor["kernels"] | {"optimizer": "foreach"}}))
    labels = [r["stand-in"] for r in standin_ladder(tmp_path, study.sha256)]
    assert labels[1].startswith("trained qwen3-0.6b (4.2M tokens, kernels sdpa, fill uninitialized off, held-out")
