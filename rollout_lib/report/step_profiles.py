"""The report's "decode step, kernel by kernel" table (issue 43, item 1): the breakdown records that
`rollout profile-breakdown --json` wrote under `<output-dir>/perf/` (kind "decode_step_breakdown"), one row per
profiled trace, a cell's traces in the order they were taken, and one sentence per cell profiled more than once:
its first and its last trace's kernels and span a step.

A diagnostic beside the gates, never part of them: each row names its trace's SHA-256 (the trace's bytes, as the
record says them) and its GPU; rows of different GPUs compare only loosely.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_lib.measure.step_profile import COLUMNS, RECORD_KIND, column_us
from rollout_lib.report.diagnostics import evidence_of_kind

if TYPE_CHECKING:
    import pandas as pd

PATTERNS = ("perf/breakdown-*.json", "perf/*/breakdown-*.json")  # the output tree's perf folder and its subfolders


def step_profile_records(output_dir: Path, campaign: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """(path, record) of every breakdown record under the output tree's perf/ folder and, with `campaign`, those
    the measure notebook saved beside its profiles of that campaign (profiles/<campaign>/<backend>/), ordered by
    cell, then by when the trace was taken (a record without a start time last), then by path. A file that cannot
    be read as a record (not JSON, a dangling link, another kind, categories that are not numbers) is left out."""
    patterns = PATTERNS + ((f"profiles/{campaign}/*/*.breakdown.json",) if campaign else ())
    found = [(path, record) for path, record in evidence_of_kind(output_dir, patterns, (RECORD_KIND,))
             if _well_formed(record)]
    return sorted(found, key=lambda item: (str(item[1].get("cell")), _started(item[1]) or "~", str(item[0])))


def _well_formed(record: dict[str, Any]) -> bool:
    """Every category a mapping with a number of us: what the table sums (a hand-edited file is left out)."""
    categories = record.get("categories")
    return isinstance(categories, dict) and isinstance(record.get("trace", {}), dict) and all(
        isinstance(v, dict) and isinstance(v.get("us"), int | float) and not isinstance(v.get("us"), bool)
        for v in categories.values())


def _started(record: dict[str, Any]) -> str | None:
    started = (record.get("trace") or {}).get("started_utc")
    return started if isinstance(started, str) and started != "not_measured" else None


def _us(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, int | float) and not isinstance(value, bool) else "not_measured"


def step_profile_table(records: list[tuple[Path, dict[str, Any]]]) -> pd.DataFrame:
    """One row per record: what was profiled, where, and us per decode step by kind of kernel."""
    import pandas as pd

    rows = []
    for path, record in records:
        trace = record.get("trace") or {}
        columns = column_us(record)
        rows.append({"cell": record.get("cell", "not_measured"), "profiled": record.get("label", "not_measured"),
                     "GPU": record.get("gpu", "not_measured"), "taken (UTC)": _started(record) or "not_measured",
                     "kernels / step": _us(record.get("kernels_per_step")),
                     "span µs / step": _us(record.get("span_us_per_step")),
                     "GPU active µs": _us(record.get("gpu_active_us_per_step")),
                     "gaps µs": _us(record.get("gaps_us_per_step")),
                     **{f"{heading} µs": _us(columns[heading]) for heading, _ in COLUMNS},
                     "other µs": _us(columns["other"]),
                     "record / trace SHA-256": f"{path.name} / {str(trace.get('sha256', 'not_measured'))[:12]}"})
    return pd.DataFrame(rows)


def step_profile_sentence(records: list[tuple[Path, dict[str, Any]]]) -> str:
    """Per cell profiled more than once: the first trace's and the last trace's kernels and span a step."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for _, record in records:
        by_cell.setdefault(str(record.get("cell")), []).append(record)
    parts = []
    for cell, found in by_cell.items():
        if len(found) < 2 or cell == "not_measured":
            continue
        first, last = found[0], found[-1]
        same_gpu = first.get("gpu") == last.get("gpu")
        parts.append(f"{cell}: {_us(first.get('kernels_per_step'))} → {_us(last.get('kernels_per_step'))} kernels "
                     f"and {_us(first.get('span_us_per_step'))} → {_us(last.get('span_us_per_step'))} µs a step "
                     + (f"(both on {first.get('gpu')})" if same_gpu
                        else f"({first.get('gpu')} → {last.get('gpu')}: different GPUs, compare loosely)"))
    return "; ".join(parts)
