"""The top of the report: one line per gate, the selection and what decided it, coverage at a glance.

Everything here is read from the aggregate the frozen calculator produced; nothing is recomputed.
A gate reads INCOMPLETE (not FAIL) when it fails only for lack of evidence (missing cells or no
accepted evidence file): the study has not decided it yet.
"""

from __future__ import annotations

from typing import Any

from rollout_lib.report.summary import BACKEND_ORDER, GIB
from rollout_lib.study.prereg import Preregistration
from rollout_lib.study.workload import Workload

COLOURS = {"PASS": "#276749", "FAIL": "#c53030", "INCOMPLETE": "#b7791f"}
SELECTION_LABELS = {"local": "Local backend", "direct_gkd": "Direct GKD", "pg_k1": "PG-k1"}


def _number(gate: dict[str, Any]) -> str:
    """The deciding number: the conservative end of the observed range, with its unit."""
    value = gate["observed_min"] if gate["comparison"] == ">=" else gate["observed_max"]
    if value is None and gate.get("per_backend_passed"):  # a gate of checks (refresh), not of a number
        return "checks " + "; ".join(f"{backend}: {'passed' if ok else 'failed'}"
                                     for backend, ok in gate["per_backend_passed"].items())
    if value is None:
        return "no observation yet"
    if gate["unit"] == "bytes":
        return f"peak {value / GIB:.2f} GiB (gate {gate['comparison']} {gate['threshold'] / GIB:.1f} GiB)"
    if gate["unit"] == "ratio":
        return f"min {value:.2f}x (gate {gate['comparison']} {gate['threshold']:g}x)"
    if gate["unit"] == "nats":
        return f"max |d logprob| {value:.4f} (gate {gate['comparison']} {gate['threshold']:g})"
    return f"{value:g} {gate['unit']}"


def _covered(gate: dict[str, Any], cells: list[str]) -> str:
    if gate["kind"] == "speedup":
        total = sum(1 for c in cells if _response(c) in gate["response_tokens"])
        return f"{gate.get('paired_cells', 0)} of {total} paired cells"
    if gate["kind"] == "peak_memory":
        backends = gate.get("backends") or list(BACKEND_ORDER)
        total = len(backends) * sum(1 for c in cells if _response(c) in gate["response_tokens"])
        measured = total - sum(1 for f in gate["failing_cells"] if "missing" in f["reason"])
        return f"{measured} of {total} backend-cells"
    used = gate.get("used_evidence") or []
    return f"{len(used)} evidence file(s)"


def _response(cell_id: str) -> int:
    return int(cell_id.split("-")[1][1:])


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
