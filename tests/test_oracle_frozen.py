"""The oracle's measurement code stays byte-stable while its campaign runs (DESIGN.md decisions 9, 12).

A cell cut off mid-way is continued only by a process whose measurement code digest equals the
one that measured the earlier segment. This test compares the files that `hf_reference`'s
measurement imports today with those recorded in the first raw file of the running campaign, and
names every file that changed. New work goes into new modules; the freeze ends when every
`hf_reference` cell of the campaign is valid.
"""

from __future__ import annotations

import json

import pytest

from rollout_lib.evidence.publish import campaign_cells
from rollout_lib.measure.identity import measurement_code

from .conftest import REPO

CAMPAIGN = "h200-v2"
RAW = REPO / "outputs" / "raw" / CAMPAIGN / "hf_reference"


def test_the_oracle_measurement_code_is_frozen_while_its_campaign_runs(prereg_study):
    files = sorted(RAW.glob("*.jsonl"))
    if not files:
        pytest.skip(f"campaign {CAMPAIGN} has no hf_reference raw file yet")
    if not campaign_cells(prereg_study, CAMPAIGN, REPO / "outputs")["hf_reference"]["to_measure"]:
        pytest.skip(f"every hf_reference cell of {CAMPAIGN} is valid: the freeze is over")
    recorded = json.loads(files[0].read_text().splitlines()[0])["measurement_code"]
    now = measurement_code(tuple(recorded["entry_modules"]))
    changed = sorted(f for f in set(recorded["files"]) | set(now["files"])
                     if recorded["files"].get(f) != now["files"].get(f))
    assert not changed, (f"the oracle's measurement code is frozen while campaign {CAMPAIGN} runs; changed: "
                         f"{', '.join(changed)}. Put new work in new modules (or finish the oracle campaign).")
    assert now["sha256"] == recorded["sha256"]
