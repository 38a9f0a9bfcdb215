"""tools/lora_fold_error.py on the smoke actor: the fold's error is measured per projection and version,
each between 0 and 1 of the policy's delta; bad input refused."""

from __future__ import annotations

import json

import pytest

from tools.lora_fold_error import main


def test_the_fold_error_of_the_smoke_actor(tmp_path, snapshot_cache):
    out = tmp_path / "fold.json"
    assert main(["--params", "params/profiles/smoke.yaml", "--versions", "2,1", "--cache-dir", snapshot_cache,
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "lora_fold_error" and set(result["versions"]) == {"1", "2"}
    for projections in result["versions"].values():
        assert projections, "one row per LoRA target"
        for row in projections.values():
            assert 0.0 < row["relative_error_median"] <= row["relative_error_max"] < 1.0
            assert row["mean_abs_delta"] > 0 and row["mean_abs_weight"] > 0
    with pytest.raises(SystemExit):
        main(["--params", "params/profiles/smoke.yaml", "--cache-dir", snapshot_cache, "--out", str(out)])
    with pytest.raises(SystemExit):
        main(["--versions", "0", "--out", str(tmp_path / "other.json")])

