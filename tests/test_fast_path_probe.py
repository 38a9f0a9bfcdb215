"""tools/lab/fast_path_probe.py on CPU with the smoke profile: a variant that fails is recorded with its
error and the probe goes on with the next one (a lease's probe must not lose the other variants)."""

from __future__ import annotations

import json
import sys

from tools.lab import fast_path_probe
from tools.lab.fast_path_probe import greedy_agreement

from .conftest import SMOKE


def test_a_failing_variant_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch, snapshot_cache):
    real = fast_path_probe.create_backend

    def create_backend(name, study, **options):
        if options.get("step_compile") == "inductor":
            raise RuntimeError("compile option refused (simulated)")
        return real(name, study, cache_dir=snapshot_cache, **options)

    monkeypatch.setattr(fast_path_probe, "create_backend", create_backend)
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["fast_path_probe.py", "--params", str(SMOKE), "--out", str(out),
                                      "--cells", "p16-r8-n1-greedy", "--repetitions", "1", "--device", "cpu",
                                      "--variants", "inductor+perrows,off"])
    assert fast_path_probe.main() == 0
    report = json.loads(out.read_text())
    assert report["inductor+perrows"] == {"error": "RuntimeError: compile option refused (simulated)"}
    cell = report["off"]["cells"]["p16-r8-n1-greedy"]
    assert cell["generated_tokens"] > 0 and cell["ms_per_decode_step"] > 0
    agreement = cell["greedy_against_first_variant"]  # the first measured variant, against itself
    assert agreement["rows"] > 0 and agreement["identical_rows"] == agreement["rows"]
    assert agreement["mean_first_difference"] == cell["generated_tokens"] / agreement["rows"]


def test_option_suffixes_merge_and_are_restored_after_their_variant(tmp_path, monkeypatch, snapshot_cache):
    """`+cdt+det` sets both inductor options (dict settings merge, not replace); the next variant
    runs with the module's own settings again. Read where the engine reads them: when it is built."""
    from rollout_lib.backends import compact_qwen3

    real = fast_path_probe.create_backend
    seen = []

    def create_backend(name, study, **options):
        seen.append((dict(compact_qwen3.INDUCTOR_OPTIONS), compact_qwen3.STEP_SHAPES))
        return real(name, study, cache_dir=snapshot_cache, **options)

    monkeypatch.setattr(fast_path_probe, "create_backend", create_backend)
    own = (dict(compact_qwen3.INDUCTOR_OPTIONS), compact_qwen3.STEP_SHAPES)
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["fast_path_probe.py", "--params", str(SMOKE), "--out", str(out),
                                      "--cells", "p16-r8-n1-greedy", "--repetitions", "1", "--device", "cpu",
                                      "--variants", "off+cdt+det+perrows,off"])
    assert fast_path_probe.main() == 0
    assert seen[0] == ({**own[0], "coordinate_descent_tuning": True, "deterministic": True}, "per_rows")
    assert seen[-1] == own
    assert (dict(compact_qwen3.INDUCTOR_OPTIONS), compact_qwen3.STEP_SHAPES) == own
    report = json.loads(out.read_text())
    assert report["off"]["inductor_cache"] == report["off+cdt+det+perrows"]["inductor_cache"] == "fresh"


def test_every_inductor_option_a_suffix_sets_is_one_this_torch_knows():
    """A misspelt option would cost a lease's variant: inductor's config refuses unknown keys by name."""
    import torch._inductor.config as inductor_config

    options = {suffix: value for suffix, (attribute, value) in fast_path_probe.SUFFIXES.items()
               if attribute == "INDUCTOR_OPTIONS"}
    assert {"pdl", "maxat", "det", "cdt"} <= set(options)
    assert fast_path_probe.SUFFIXES["combo"] == ("COMBO_KERNELS", "on")  # an engine setting since lease 30
    options["combo"] = {"combo_kernels": True}  # the option that setting gives the engine's compilations
    for suffix, settings in options.items():
        with inductor_config.patch(settings):  # raises on a key inductor does not have
            for key, value in settings.items():
                assert inductor_config.get_config_copy()[key] == value, (suffix, key)


def test_rows_are_compared_by_request_and_part_where_their_tokens_first_differ():
    reference = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 9, 2], "d": [1, 1, 1, 1]}
    got = {"a": [1, 2, 3, 4],  # identical: its length counts
           "b": [5, 6, 0, 8],  # parts at token 2
           "c": [9, 9],        # stopped early, the same so far: the shorter length
           "d": [2, 1, 1, 1]}  # parts at once
    assert greedy_agreement(reference, got) == {"rows": 4, "identical_rows": 1, "mean_first_difference": 2.0}
    assert greedy_agreement(reference, {}) == {"rows": 4, "identical_rows": 0, "mean_first_difference": 0.0}
