"""Coverage at a glance: per cell and backend, measured, invalid or missing (the evidence section).

Everything here is read from the aggregate the frozen calculator produced; nothing is recomputed.
"""

from __future__ import annotations

from typing import Any

from rollout_lib.report.summary import BACKEND_ORDER
from rollout_lib.study.prereg import Preregistration
from rollout_lib.study.workload import Workload


def coverage(aggregate: dict[str, Any], study: Preregistration) -> dict[str, Any]:
    """Per cell and backend: valid / invalid / missing; and the counts out of cells x backends."""
    cells = Workload(study).cell_ids()
    index = {(c["backend"], c["cell_id"]): c for c in aggregate["cells"]}
    matrix = {}
    for cell_id in cells:
        matrix[cell_id] = {}
        for backend in BACKEND_ORDER:
            cell = index.get((backend, cell_id))
            matrix[cell_id][backend] = "missing" if cell is None else ("valid" if cell["valid"] else "invalid")
    counts = {state: sum(row[b] == state for row in matrix.values() for b in BACKEND_ORDER)
              for state in ("valid", "invalid", "missing")}
    return {"matrix": matrix, "counts": counts, "total": len(cells) * len(BACKEND_ORDER)}


def coverage_html(aggregate: dict[str, Any], study: Preregistration) -> str:
    """How many backend-cells are measured, invalid or missing, and the cells-by-backend matrix."""
    cov = coverage(aggregate, study)
    symbols = {"valid": ("&#10003;", "#276749"), "invalid": ("&#10007;", "#c53030"), "missing": ("&middot;", "#a0aec0")}
    head = "".join(f"<th>{b}</th>" for b in BACKEND_ORDER)
    rows = "".join(
        f"<tr><td>{cell_id}</td>" + "".join(
            f'<td style="text-align:center;color:{symbols[s][1]}" title="{s}">{symbols[s][0]}</td>'
            for s in (states[b] for b in BACKEND_ORDER)) + "</tr>"
        for cell_id, states in cov["matrix"].items())
    counts = cov["counts"]
    return (f'<p id="coverage">Coverage: {counts["valid"]} measured, {counts["invalid"]} invalid, {counts["missing"]} '
            f'missing of {cov["total"]} backend-cells (&#10003; measured, &#10007; invalid, &middot; missing)</p>'
            f"<table><thead><tr><th>cell</th>{head}</tr></thead><tbody>{rows}</tbody></table>")
