"""Issue 43 item 4's ms targets in the campaign protocol: a study that names the hf_cached engine
(`hf_cached_engine`), the lab tool that derives such a profile from a study and the picker's choice
(tools/lab/engine_profile.py), and the engine reaching what the runner measures and records."""

from __future__ import annotations

import json

import pytest

from rollout_lib.backends import create_backend
from rollout_lib.measure.rawfile import read_raw
from rollout_lib.measure.runner import ParameterError, run, validate_parameters
from rollout_lib.study.prereg import load
from tools.lab.engine_profile import main

from .conftest import SMOKE


def _profile(tmp_path, engine: dict, name: str = "engine.yaml"):
    out = tmp_path / name
    assert main(["--base", str(SMOKE), "--engine", json.dumps(engine), "--out", str(out)]) == 0
    return out


def test_the_profile_is_the_base_study_with_its_engine_named(tmp_path):
    out = _profile(tmp_path, {"SAMPLER": "chunked", "LORA_SHRINK": "in_base_gemm"})
    base, study = load(SMOKE), load(out)
    assert study.study_id == f"{base.study_id}-engine" and study.preregistered is False
    assert dict(study.hf_cached_engine) == {"LORA_SHRINK": "in_base_gemm", "SAMPLER": "chunked"}
    assert study.workload == base.workload and study.protocol == base.protocol and study.actor == base.actor
    assert study.calculator == base.calculator and study.gates == base.gates
    text = out.read_text()
    assert text.startswith("# PROFILE - NOT PREREGISTERED.") and base.sha256 in text
    # the same bytes again are left as they are; other bytes at the same path are refused
    assert main(["--base", str(SMOKE), "--engine", '{"SAMPLER": "chunked", "LORA_SHRINK": "in_base_gemm"}',
                 "--out", str(out)]) == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["--base", str(SMOKE), "--engine", '{"SAMPLER": "row"}', "--out", str(out)])
    assert exit_info.value.code == 2 and out.read_text() == text


def test_values_yaml_would_read_as_booleans_stay_strings(tmp_path):
    """COMBO_KERNELS `on` (the picked engine's) is YAML 1.1's true unquoted: the profile quotes every value."""
    study = load(_profile(tmp_path, {"COMBO_KERNELS": "on", "SAMPLER": "chunked"}))
    assert dict(study.hf_cached_engine) == {"COMBO_KERNELS": "on", "SAMPLER": "chunked"}


def test_the_engine_is_read_from_the_pickers_last_json_line(tmp_path):
    choice = tmp_path / "engine-choice.txt"
    choice.write_text('kept +combo (-0.08 ms)\n{"not": "this one"} trailing words\n{"SAMPLER": "chunked"}\n')
    out = tmp_path / "picked.yaml"
    assert main(["--base", str(SMOKE), "--engine-choice", str(choice), "--out", str(out)]) == 0
    assert dict(load(out).hf_cached_engine) == {"SAMPLER": "chunked"}
    assert f"from {choice.as_posix()}" in out.read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--engine", '{"SAMPLER": "fastest"}'], "engine: SAMPLER 'fastest' is not allowed; allowed: row, chunked"),
    (["--engine", '{"WARP_SPEED": "on"}'], "engine: engine setting 'WARP_SPEED' is not allowed; allowed: LORA_SHRINK"),
    (["--engine", "{}"], "engine: empty; allowed: a mapping of engine settings"),
    (["--engine", "{SAMPLER"], "engine: not JSON"),
])
def test_a_bad_engine_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys, args, message):
    out = tmp_path / "never.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["--base", str(SMOKE), *args, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_a_base_that_already_names_an_engine_or_a_choice_without_one_is_refused(tmp_path, capsys):
    named = _profile(tmp_path, {"SAMPLER": "chunked"})
    with pytest.raises(SystemExit):
        main(["--base", str(named), "--engine", '{"SAMPLER": "row"}', "--out", str(tmp_path / "twice.yaml")])
    assert "base: already names an hf_cached_engine" in capsys.readouterr().err
    choice = tmp_path / "choice.txt"
    choice.write_text("nothing kept\n")
    with pytest.raises(SystemExit):
        main(["--base", str(SMOKE), "--engine-choice", str(choice), "--out", str(tmp_path / "none.yaml")])
    assert "has no JSON object line" in capsys.readouterr().err


def test_the_studys_engine_is_what_hf_cached_runs_unless_an_engine_option_replaces_it(tmp_path):
    study = load(_profile(tmp_path, {"SAMPLER": "chunked"}))
    assert create_backend("hf_cached", study, device="cpu").engine_settings == {"SAMPLER": "chunked"}
    replaced = create_backend("hf_cached", study, device="cpu", engine={"LORA_SHRINK": "in_base_gemm"})
    assert replaced.engine_settings == {"LORA_SHRINK": "in_base_gemm"}
    assert create_backend("hf_cached", load(SMOKE), device="cpu").engine_settings == {}


def test_a_campaign_measures_and_records_the_engine_its_study_names(tmp_path):
    """The runner measures the profile's engine and its raw file records it (the chunked sampler's reduction in
    the backend environment, the profile's hash in the header); the smoke study's own run records the default."""
    profile = _profile(tmp_path, {"SAMPLER": "chunked"})
    spec, study, workload = validate_parameters(backend="hf_cached", params=str(profile), campaign="engine",
                                                cells=["p16-r8-n1-greedy"], output_dir=str(tmp_path / "out"),
                                                run_id="e", device="cpu")
    (summary,) = list(run(spec, study, workload))
    assert summary.status == "completed"
    records, _ = read_raw(spec.path)
    header = records[0]
    cold = next(r for r in records if r.get("record") == "cold_start")
    assert header["preregistration"]["sha256"] == study.sha256 and header["preregistered"] is False
    assert cold["backend_environment"]["sampler_reduction"] == "chunked"
    # the report's setup names the engine the study measured
    from rollout_lib.evidence.publish import publish
    from rollout_lib.report.summary import render

    publish(study, "engine", tmp_path / "out")
    page = render("engine", str(profile), tmp_path / "out").read_text(encoding="utf-8")
    setup = page[page.index('<section id="setup">'):]
    assert "hf_cached engine: SAMPLER=chunked" in setup[:setup.index("</p>")]


def test_a_bad_engine_in_the_study_is_a_parameter_error_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMOKE.read_text() + "hf_cached_engine:\n  SAMPLER: fastest\n")
    with pytest.raises(ParameterError, match=r"^params: hf_cached_engine.SAMPLER: SAMPLER 'fastest' is not allowed"):
        validate_parameters(backend="hf_cached", params=str(bad), campaign="engine", output_dir=str(tmp_path / "o"),
                            device="cpu")
    assert not (tmp_path / "o").exists()


def test_conformance_runs_the_studys_engine_with_its_bf16_only_settings_left_out_of_float32(tmp_path, monkeypatch):
    """The float32 part of conformance cannot run a bf16-only setting: the study's engine reaches hf_cached
    filtered as a candidate's is (LORA_SHRINK in_base_gemm left out, the rest kept); the oracle gets none."""
    from rollout_lib.checks import conformance

    study = load(_profile(tmp_path, {"LORA_SHRINK": "in_base_gemm", "SAMPLER": "chunked"}))
    built = []

    class Stop(Exception):
        pass

    class Unstarted:
        def cold_start(self):
            raise Stop  # the first part's backends are built; nothing is run

    def create_backend(name, study, **options):
        built.append((name, options.get("compute_dtype"), options.get("engine")))
        return Unstarted()

    monkeypatch.setattr(conformance, "create_backend", create_backend)
    with pytest.raises(Stop):
        conformance.run_conformance(study, conformance.ConformanceSettings((16,), (8,)), device="cpu",
                                    show_progress=False)
    assert built == [("hf_reference", "float32", None), ("hf_cached", "float32", {"SAMPLER": "chunked"})]


@pytest.mark.parametrize("command", [["prereg"], ["campaign", "plan", "--campaign", "engine", "--backend", "hf_cached",
                                                  "--deadline-s", "100", "--params"]])
def test_an_engine_whose_settings_do_not_go_together_is_refused_before_anything_is_written(tmp_path, capsys, command):
    """DECODE_PREFIX shared needs FA3's or the Triton attention: a study naming it with the default attention is
    refused in one line naming the setting, by `rollout prereg` and before `rollout campaign` writes anything."""
    from rollout_lib.cli import main as rollout

    bad = tmp_path / "bad.yaml"
    bad.write_text(SMOKE.read_text() + "hf_cached_engine:\n  DECODE_PREFIX: shared\n")
    args = [*command, str(bad)] + (["--output-dir", str(tmp_path / "out")] if command[0] == "campaign" else [])
    assert rollout(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hf_cached_engine.DECODE_PREFIX: DECODE_PREFIX shared needs ATTENTION_BACKEND fa3 or " \
                               "triton" in err[0], err
    assert not (tmp_path / "out").exists()
