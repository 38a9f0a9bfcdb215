"""tools/fast_path_probe.py on CPU with the smoke profile: a variant that fails is recorded with its
error and the probe goes on with the next one (a lease's probe must not lose the other variants)."""

from __future__ import annotations

import json
import sys

from tools import fast_path_probe

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
