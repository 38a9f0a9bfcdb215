"""The preregistration loader rejects every malformed input with the right key path."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from rollout_lib.study.prereg import CALCULATOR_PENDING, PreregistrationError, loads

from .conftest import PREREG, REPO, SMOKE


def _mutated(mutate) -> str:
    data = yaml.safe_load(PREREG.read_text())
    mutate(data)
    return yaml.safe_dump(data, sort_keys=False)


def _set(path, value):
    def mutate(data):
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _delete(path):
    def mutate(data):
        node = data
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return mutate


FAULTS = [
    ("unknown top-level key", _set(["surprise"], 1), "surprise", "unknown key"),
    ("unknown nested key", _set(["actor", "lora", "rnak"], 16), "actor.lora.rnak", "unknown key"),
    ("missing key", _delete(["protocol", "measured_repetitions"]), "protocol.measured_repetitions", "missing"),
    ("wrong type: string for int", _set(["protocol", "warmup_repetitions"], "1"), "protocol.warmup_repetitions",
     "expected an integer"),
    ("bool is not an int", _set(["workload", "logical_prompts"], True), "workload.logical_prompts",
     "expected an integer"),
    ("negative list item", _set(["workload", "prompt_tokens"], [128, -5]), "workload.prompt_tokens[1]", "minimum"),
    ("bad literal", _set(["memory", "oom_downshift"], "halve_batch"), "memory.oom_downshift", "allowed: 'none'"),
    ("bad sampling name", lambda d: d["workload"]["samplings"][1].update(name="nucleus"),
     "workload.samplings[1].name", "allowed"),
    ("bad digest", _set(["actor", "payload_digest"], "abc"), "actor.payload_digest", "64 lowercase hex"),
    ("architecture drift", _set(["actor", "architecture", "hidden_size"], 1536), "actor.architecture.hidden_size",
     "differs"),
    ("unknown architecture", _set(["teacher", "architecture", "name"], "qwen3-8b"), "teacher.architecture.name",
     "allowed"),
    ("seed row too short", lambda d: d["workload"]["sample_seeds"].__setitem__(2, [1, 2]),
     "workload.sample_seeds[2]", "one seed per sample index"),
    ("duplicate sample seeds", lambda d: d["workload"]["sample_seeds"].__setitem__(1, [1101, 1, 2, 3]),
     "workload.sample_seeds", "duplicates"),
    ("partition does not cover prompts", _set(["workload", "batch_partitions"], [[4], [2, 1]]),
     "workload.batch_partitions[1]", "partition"),
    ("gate on unknown response length", lambda d: d["gates"][0].update(response_tokens=[256, 1024]),
     "gates[0].response_tokens[1]", "not a workload response length"),
    ("selection names unknown gate", lambda d: d["selection"]["pg_k1_requires"].append("speed_of_light"),
     "selection.pg_k1_requires[4]", "unknown gate"),
    ("gate above budget", _set(["memory", "gate_peak_total_bytes"], 2**40), "memory.gate_peak_total_bytes",
     "must not exceed"),
    ("greedy with temperature", lambda d: d["workload"]["samplings"][0].update(temperature=0.7),
     "workload.samplings[0].temperature", "greedy"),
    ("lora dropout in rollouts", _set(["actor", "lora", "dropout"], 0.1), "actor.lora.dropout", "maximum"),
    ("bad lora target", _set(["actor", "lora", "target_modules"], ["q_proj", "lm_head"]),
     "actor.lora.target_modules[1]", "allowed"),
    ("calculator hash malformed", _set(["calculator", "sha256"], "TODO"), "calculator.sha256", "pending"),
    ("top_p out of range", lambda d: d["workload"]["samplings"][1].update(top_p=1.5),
     "workload.samplings[1].top_p", "maximum"),
    ("loader-owned key in file", _set(["sha256"], "x"), "sha256", "unknown key"),
    ("engine as a list", _set(["hf_cached_engine"], ["SAMPLER"]), "hf_cached_engine", "expected a mapping"),
    ("engine setting lower case", _set(["hf_cached_engine"], {"sampler": "chunked"}), "hf_cached_engine.sampler",
     "UPPER_SNAKE_CASE"),
    ("engine value not a name", _set(["hf_cached_engine"], {"SAMPLER": "Chunked!"}), "hf_cached_engine.SAMPLER",
     "lower_snake_case"),
    ("engine value a number", _set(["hf_cached_engine"], {"SAMPLER": 3}), "hf_cached_engine.SAMPLER",
     "expected a string"),
]


@pytest.mark.parametrize(("fault", "mutate", "key_path", "message"), FAULTS, ids=[f[0] for f in FAULTS])
def test_bad_preregistration_is_rejected_with_key_path(fault, mutate, key_path, message):
    with pytest.raises(PreregistrationError) as excinfo:
        loads(_mutated(mutate))
    assert excinfo.value.key_path == key_path, str(excinfo.value)
    assert message in str(excinfo.value)


def test_duplicate_yaml_key_is_rejected():
    text = PREREG.read_text().replace("study_id: rollout-runtime-v2\n", "study_id: a\nstudy_id: b\n", 1)
    with pytest.raises(PreregistrationError, match="duplicate key"):
        loads(text)


def test_not_a_mapping():
    with pytest.raises(PreregistrationError, match="expected a mapping"):
        loads("- just\n- a list\n")


def test_preregistration_and_profile_load(prereg_study, smoke_study):
    assert prereg_study.preregistered is True
    assert smoke_study.preregistered is False
    assert "NOT PREREGISTERED" in smoke_study.status_label
    assert prereg_study.workload.response_tokens == (64, 256, 512)
    assert prereg_study.memory.budget_bytes == 16 * 2**30
    assert prereg_study.memory.gate_peak_total_bytes == int(14.5 * 2**30)
    assert {g.id for g in prereg_study.gates} >= {"hf_cached_speedup", "vllm_speedup", "peak_memory",
                                                   "policy_refresh", "local_conformance", "vllm_pgk1_conformance"}
    assert prereg_study.policy_refresh.versions == 8
    assert all(re.fullmatch(r"INV-[A-Z0-9-]+", r.id) for r in prereg_study.invalidation_rules)


def test_calculator_placeholder_fails_loudly(prereg_study):
    pinned = prereg_study.require_calculator_pinned()
    assert len(pinned) == 64
    placeholder = loads(PREREG.read_text().replace(f"sha256: {pinned}", f"sha256: {CALCULATOR_PENDING}"))
    with pytest.raises(PreregistrationError, match="placeholder"):
        placeholder.require_calculator_pinned()


def test_sha256_is_of_the_file_bytes(prereg_study):
    import hashlib

    assert prereg_study.sha256 == hashlib.sha256(PREREG.read_bytes()).hexdigest()


def test_cli_validates_and_prints_sha(prereg_study):
    out = subprocess.run([sys.executable, "-m", "rollout_lib.cli", "prereg", str(PREREG)], cwd=REPO,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"valid: {PREREG} (sha256 {prereg_study.sha256})"


def test_cli_rejects_bad_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMOKE.read_text().replace("measured_repetitions: 3", "measured_repetitions: zero"))
    out = subprocess.run([sys.executable, "-m", "rollout_lib.cli", "prereg", str(bad)], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "protocol.measured_repetitions" in out.stderr


def test_the_study_names_its_hf_cached_engine_and_the_cli_checks_it(tmp_path, prereg_study):
    """Issue 43: a study may name the hf_cached engine it measures (hash-bound); the frozen h200-v2 study names
    none. `rollout prereg` prints it and refuses a setting the engine does not have, in one line."""
    assert dict(prereg_study.hf_cached_engine) == {}
    text = PREREG.read_text() + "hf_cached_engine:\n  SAMPLER: chunked\n  LORA_SHRINK: in_base_gemm\n"
    study = loads(text)
    assert dict(study.hf_cached_engine) == {"SAMPLER": "chunked", "LORA_SHRINK": "in_base_gemm"}
    assert study.sha256 != prereg_study.sha256 and study.measurement_sha256 != prereg_study.measurement_sha256
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(study)) == study == copy.deepcopy(study) != prereg_study  # a plain mapping
    named = tmp_path / "named.yaml"
    named.write_text(text)
    out = subprocess.run([sys.executable, "-m", "rollout_lib.cli", "prereg", str(named)], cwd=REPO,
                         capture_output=True, text=True, check=True)
    assert "hf_cached engine: LORA_SHRINK=in_base_gemm, SAMPLER=chunked" in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(PREREG.read_text() + "hf_cached_engine:\n  SAMPLER: fastest\n")
    out = subprocess.run([sys.executable, "-m", "rollout_lib.cli", "prereg", str(bad)], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"rollout prereg: error: {bad}: hf_cached_engine.SAMPLER: SAMPLER 'fastest' is not allowed; allowed: row, "
        "chunked, triton"]
