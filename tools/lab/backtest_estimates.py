"""Backtest the campaign planner's cost estimates on a campaign's own raw files.

For each raw file of a backend (in name order: the run ids are UTC stamps), the cells it measured that no
earlier file had measured ("fresh" cells: the ones the planner must estimate from its prior) are estimated
by `rollout_lib.campaign.driver.estimate_costs` from the earlier files only, once with the calibration per
sampling mode and once with one ratio for all; each measured repetition and each warm-up is then compared
with its estimate as |log(observed / estimated)| (0.10 = about 10% off either way).

    .venv/bin/python tools/lab/backtest_estimates.py --campaign h200-v2 [--backend hf_reference] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def backtest(study, backend: str, files: list[list[dict]], by_sampling_mode: bool) -> dict[str, list[float]]:
    from rollout_lib.campaign.driver import estimate_costs

    errors: dict[str, list[float]] = {"measured": [], "warmup": []}
    for k in range(1, len(files)):
        seen = {r["cell_id"] for records in files[:k] for r in records if r.get("record") == "repetition"}
        reps = [r for r in files[k] if r.get("record") == "repetition" and r.get("wall_s")]
        fresh = sorted({r["cell_id"] for r in reps} - seen)
        if not fresh:
            continue
        costs, _ = estimate_costs(study, backend, fresh, files[:k], by_sampling_mode=by_sampling_mode)
        by_cell = {c.cell_id: c for c in costs}
        for r in reps:
            if r["cell_id"] in by_cell:
                cost = by_cell[r["cell_id"]]
                estimate = cost.first_s if r.get("warmup") else cost.repetition_s
                errors["warmup" if r.get("warmup") else "measured"].append(abs(math.log(r["wall_s"] / estimate)))
    return errors


def summary(values: list[float]) -> dict[str, float | int | str]:
    if not values:
        return {"n": 0, "median": "not_applicable", "mean": "not_applicable", "p90": "not_applicable"}
    ordered = sorted(values)
    return {"n": len(values), "median": round(statistics.median(values), 3),
            "mean": round(statistics.mean(values), 3), "p90": round(ordered[int(0.9 * len(ordered))], 3)}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from rollout_lib.measure.rawfile import read_raw
    from rollout_lib.study.prereg import load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--campaign", required=True)
    parser.add_argument("--params", default=str(ROOT / "params" / "rollout-runtime-v2.yaml"))
    parser.add_argument("--output-dir", default=str(ROOT / "outputs"))
    parser.add_argument("--backend", action="append", help="default: every backend with raw files")
    parser.add_argument("--json", help="also write the table as JSON here")
    args = parser.parse_args(argv)
    study = load(args.params)
    raw_dir = Path(args.output_dir) / "raw" / args.campaign
    if not raw_dir.is_dir():
        parser.error(f"--campaign: no raw files under {raw_dir}")
    backends = args.backend or sorted(p.name for p in raw_dir.iterdir() if p.is_dir())
    rows = []
    for backend in backends:
        files = [read_raw(path)[0] for path in sorted((raw_dir / backend).glob("*.jsonl"))]
        for by_mode in (False, True):
            for kind, values in backtest(study, backend, files, by_mode).items():
                rows.append({"backend": backend, "calibration": "per sampling mode" if by_mode else "one ratio",
                             "repetition": kind, **summary(values)})
    print(f"{'backend':<14}{'calibration':<19}{'repetition':<11}{'n':>4}  |log(observed/estimate)| "
          "median / mean / p90")
    for row in rows:
        print(f"{row['backend']:<14}{row['calibration']:<19}{row['repetition']:<11}{row['n']:>4}  "
              f"{row['median']} / {row['mean']} / {row['p90']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
