"""What an RL-cycle run's GPU memory is made of, from its raw file(s): the trainer process and the
engine's processes (vLLM's API server and engine core) at the rollout's end and at the update's end,
the process-tree peak over all phases, and the options the run was given beyond the study's setting.
For a side by side of runs that no cycle aggregate holds together (lease 13's scheduler-sizing run is
in its own campaign, `h200-v2-sched`, beside the study's `h200-v2` run of the same hold).

    python tools/cycle_memory_split.py outputs/cycles/raw/h200-v2/vllm/*.jsonl [--json]

Every figure is the largest over the run's cycles, in GiB; `—` where a file has no such record (runs
before lease 12 list no processes). Reads raw files only; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rollout_lib.report.cycle import largest_memory_split

GIB = 2**30


def summarize(path: Path) -> dict[str, Any]:
    """One run's memory split and rates; raises ValueError naming the file if it is not a cycle run."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records or records[0].get("kind") != "rl_cycle":
        raise ValueError(f"{path}: not an RL-cycle raw file (its first line is not an rl_cycle header)")
    header, cycles = records[0], [r for r in records if r.get("record") == "cycle"]
    out: dict[str, Any] = {"file": str(path), "backend": header.get("backend"),
                           "vllm_memory_mode": header.get("vllm_memory_mode"), "cell_id": header.get("cell_id"),
                           "algorithm": header.get("algorithm"), "cycles": len(cycles),
                           "backend_options": header.get("backend_options", "not recorded")}
    for when in ("rollout_end", "actor_update_end"):
        split = largest_memory_split(cycles, when)
        out[f"trainer_{when}_gib"] = split[0] / GIB if split else None
        out[f"engine_{when}_gib"] = split[1] / GIB if split else None
    peaks = [m["nvml"]["peak_process_tree_bytes"] for c in cycles for m in c.get("memory", {}).values()
             if (m.get("nvml") or {}).get("status") == "measured"]
    out["peak_process_tree_gib"] = max(peaks) / GIB if peaks else None
    rates = [c["rollout_tokens_per_s"] for c in cycles if isinstance(c.get("rollout_tokens_per_s"), (int, float))]
    out["rollout_tokens_per_s_median"] = statistics.median(rates) if rates else None
    return out


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else "—" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true", help="one JSON object per file instead of a table")
    args = parser.parse_args(argv)
    try:
        rows = [summarize(path) for path in args.files]
    except (OSError, ValueError) as exc:
        print(f"cycle_memory_split: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return 0
    columns = ["trainer_rollout_end_gib", "engine_rollout_end_gib", "engine_actor_update_end_gib",
               "peak_process_tree_gib", "rollout_tokens_per_s_median"]
    print("\t".join(["file", "mode", "options", *columns]))
    for row in rows:
        print("\t".join([Path(row["file"]).name, str(row["vllm_memory_mode"]), json.dumps(row["backend_options"]),
                         *(_cell(row[c]) for c in columns)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
