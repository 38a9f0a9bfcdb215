"""The report's first screen: the answer. One sentence per role (local rollouts, direct GKD, PG-k1)
with what to use, how fast and why; one figure (tokens/s per cell, log scale, the speedup gates drawn
in); the gate table, compact; one line on what would change the verdict and the command that decides it.

Everything is read from the frozen calculator's aggregate and the evidence files it names; the
attribution of an exactness failure (backend or stand-in model, DESIGN decision 13) follows from the
evidence: float32 exact + bf16 beyond tolerance on a synthetic stand-in reads as the stand-in's.
"""

from __future__ import annotations

import base64
import html
import io
import statistics
from pathlib import Path
from typing import Any

from rollout_lib.core import project_root
from rollout_lib.report.standins import trained_reading
from rollout_lib.report.summary import BACKEND_ORDER, GIB, gate_outcome, read_evidence
from rollout_lib.study.prereg import Preregistration
from rollout_lib.study.workload import Workload

COLOURS = {"hf_reference": "#718096", "hf_cached": "#2b6cb0", "vllm": "#38a169"}
OUTCOME_COLOURS = {"PASS": "#276749", "FAIL": "#c53030", "INCOMPLETE": "#b7791f"}
SMOKE_LINE = ("Smoke profile: these numbers are a plumbing check on a tiny synthetic model on this machine, "
              "not a verdict. The outcomes below show the pipeline ran end to end; a FAIL here is timing noise "
              "or the tiny model, never a broken product.")


# a link to an anchor inside folded detail (the gate table's "details") opens the <details> around it
OPEN_TARGET_SCRIPT = ("<script>document.addEventListener('click', function (event) {"
                      " var link = event.target.closest('a[href^=\"#\"]'); if (!link) return;"
                      " var target = document.getElementById(link.getAttribute('href').slice(1));"
                      " for (var d = target && target.closest('details'); d; d = d.parentElement.closest('details'))"
                      " d.open = true; });</script>")


# ---------------------------------------------------------------- small readers


def evidence_report(path: str) -> dict[str, Any] | None:
    """An evidence file the aggregate names (relative to the repository, or absolute); None when absent."""
    file = Path(path) if Path(path).is_absolute() else project_root() / path
    if not file.is_file():
        return None
    try:
        return read_evidence(path)
    except (ValueError, UnicodeDecodeError):  # UnsafeInput is a ValueError
        return None


def gate(aggregate: dict[str, Any], gate_id: str) -> dict[str, Any] | None:
    return next((g for g in aggregate["gates"] if g["id"] == gate_id), None)


def gate_of_kind(aggregate: dict[str, Any], kind: str, candidate: str | None = None) -> dict[str, Any] | None:
    return next((g for g in aggregate["gates"] if g["kind"] == kind
                 and (candidate is None or g.get("candidate") == candidate)), None)


def rates(aggregate: dict[str, Any], backend: str) -> list[float]:
    return [c["tokens_per_s"] for c in aggregate["cells"]
            if c["backend"] == backend and c["valid"] and c.get("tokens_per_s") is not None]


def rate_range(aggregate: dict[str, Any], backend: str) -> str:
    found = rates(aggregate, backend)
    if not found:
        return "— (no valid cell measured)"
    return f"{_n(min(found))}–{_n(max(found))} tok/s"


def _n(value: float) -> str:
    """A rate or ratio as a reader wants it: 3 significant figures, thousands separated."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _ratio_range(g: dict[str, Any] | None) -> str:
    if g is None or g.get("observed_min") is None:
        return "—"
    low, high = g["observed_min"], g["observed_max"]
    return f"{_n(low)}×" if abs(high - low) < 1e-9 else f"{_n(low)}–{_n(high)}×"


def _used_evidence(g: dict[str, Any] | None) -> tuple[str | None, dict[str, Any] | None]:
    if g is None or not g.get("used_evidence"):
        return None, None
    path = g["used_evidence"][-1]
    return path, evidence_report(path)


def short(path: str | None) -> str:
    return Path(path).name if path else "—"


# ---------------------------------------------------------------- exactness, in plain words


# exactness_reading's sources in which the stand-in model has a share (the rest may be undecided or the backend's)
STAND_IN_SOURCES = ("stand-in model", "stand-in model and backend")


def _beside_the_oracle(value: float, own: float, tolerance: float) -> tuple[str, str]:
    """(source, source in words) of a trained stand-in's bf16 gap `value` beside the oracle's own (`own`: its
    generation-time log-probabilities against its teacher-forced scoring, the same check)."""
    if own >= value:
        return "stand-in model", "the stand-in model and bf16 noise the oracle shows too"
    if own > tolerance:
        return ("stand-in model and backend",
                "mostly the stand-in model; the tolerance is below the oracle's own bf16 noise; the rest the backend")
    return "stand-in model and backend", "mostly the stand-in model; the rest the backend"


def _trained_clause(ladder: dict[str, Any], tolerance: float) -> tuple[str, str, str, str]:
    """(where the bf16 gap comes from, its short form, source, source in words) when the exactness ladder
    (report/standins.py: `trained_reading`) has the same check on a stand-in trained on real text: a diagnostic
    beside the gates."""
    value = ladder["local_max"]
    lower = (f", {ladder['random_max'] / value:.0f}× lower than this study's actor on the same cells"
             if ladder.get("random_max") else "")
    trained = (f"a stand-in trained on real text reads {value:.3g} on the same check{lower} ({ladder['cells']}; "
               "a diagnostic beside the gates)")
    if value <= tolerance:
        return (f"that comes from the random stand-in model, which amplifies bf16 rounding, not from the backend: "
                f"{trained}, within the tolerance", f"from the stand-in model; a trained one reads {value:.3g}",
                "stand-in model", "stand-in model")
    own, noise = ladder.get("oracle_self_max"), ladder.get("oracle_batch_max")
    if own is not None:
        beside = (f" ({ladder['random_oracle_self_max']:.3g} on this study's actor, where hf_cached reads "
                  f"{ladder['random_max']:.3g})" if ladder.get("random_oracle_self_max") is not None
                  and ladder.get("random_max") is not None else "")
        floor = (f"the oracle's own generation-time log-probabilities miss its teacher-forced scoring by {own:.3g} on "
                 f"the same check{beside}")
        source, words = _beside_the_oracle(value, own, tolerance)
        if own >= value:
            rest = f"{floor}: as much, bf16 noise every incremental decoder shows, not the backend's"
        elif own > tolerance:
            rest = (f"{floor}, so no incremental decoder, the oracle included, meets {tolerance:g} in bf16; "
                    f"hf_cached's {value:.3g} is {value / own:.1f}× the oracle's own")
        else:
            rest = f"{floor}, within the tolerance: the rest, up to {value:.3g}, is the backend's"
    elif noise is None:
        rest, source, words = ("whether that rest is the backend's or bf16 noise the oracle shows against itself is "
                               "not measured yet", "stand-in model", "mostly the stand-in model; the rest undecided")
    elif noise >= value:
        rest, source, words = (f"the oracle itself differs by {noise:.3g} between batch compositions, as much: bf16 "
                               "noise, not the backend's", "stand-in model",
                               "the stand-in model and the oracle's own bf16 noise")
    else:
        rest, source, words = (f"the oracle itself differs by only {noise:.3g} between batch compositions: the rest, "
                               f"up to {value:.3g}, is the backend's", "stand-in model and backend",
                               "mostly the stand-in model; the rest the backend")
    return (f"most of it comes from the random stand-in model, which amplifies bf16 rounding: {trained}, still "
            f"{value / tolerance:.1f}× the tolerance; {rest}",
            f"mostly from the stand-in model; a trained one reads {value:.3g}, still above", source, words)


def _trained_vllm(ladder: dict[str, Any], observed: float, tolerance: float, gap: str) -> dict[str, str]:
    """The vLLM gate's source, short form and sentence where the exactness ladder has vLLM PG-k1 on the trained
    stand-in: its gap there beside hf_cached's and the oracle's own (the same check with the oracle as the
    candidate: its generation-time log-probabilities against its teacher-forced scoring)."""
    value, own, local = ladder["vllm_max"], ladder.get("oracle_self_max"), ladder["local_max"]
    where = (f"on a stand-in trained on real text vLLM reads {value:.3g} on the same check ({ladder['cells']}), "
             f"hf_cached {local:.3g}")
    if own is None:
        source, words = "stand-in model", "mostly the stand-in model; the rest undecided"
        where += "; whether the rest is the backend's or bf16 noise the oracle shows too is not measured yet"
    else:
        source, words = _beside_the_oracle(value, own, tolerance)
        where += (f", where the oracle misses its own scoring by {own:.3g}: vLLM's is {value / own:.1f}× the oracle's "
                  f"own bf16 noise (hf_cached's {local / own:.1f}×), the rest the backend's" if value > own else
                  f", within the {own:.3g} by which the oracle misses its own scoring")
    if ladder.get("random_vllm_max") is not None and ladder.get("random_oracle_self_max") is not None:
        where += (f"; on this study's actor, same cells, vLLM reads {ladder['random_vllm_max']:.3g} where the oracle "
                  f"misses its own scoring by {ladder['random_oracle_self_max']:.3g}")
    return {"source": source, "source_text": words,
            "short": f"bf16 gap {observed:.3g} ({observed / tolerance:.0f}× the tolerance), mostly from the "
                     f"stand-in model; a trained one reads {value:.3g}, still above",
            "sentence": f"bf16 only, {gap}; most of it comes from the random stand-in model: {where}"}


def exactness_reading(aggregate: dict[str, Any], study: Preregistration, gate_id: str,
                      ladder: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a conformance gate's failure is, by how much, and where it comes from, from its evidence file
    (and, for the local gate on a synthetic actor, the exactness ladder's trained stand-in, `ladder`, when
    measured). Keys: outcome, sentence (plain words), source ('backend', 'stand-in model', 'stand-in model and
    backend', 'undecided', or None when it passes or lacks evidence), evidence (path)."""
    g = gate(aggregate, gate_id)
    if g is None:
        return {"outcome": None, "sentence": f"— (no gate {gate_id} in this study)", "source": None, "evidence": None}
    outcome = gate_outcome(g)
    path, report = _used_evidence(g)
    if outcome == "INCOMPLETE" or report is None:
        return {"outcome": outcome, "source": None, "evidence": path,
                "sentence": f"{gate_id} is undecided: no accepted evidence file yet"}
    tolerance, observed = g["threshold"], g.get("observed_max")
    gap = (f"sampled-token |Δ log-prob| {observed:.3g} against {tolerance:g}"
           + (f" ({observed / tolerance:.0f}× the tolerance)" if observed and observed > tolerance else ""))
    if outcome == "PASS":
        return {"outcome": outcome, "source": None, "evidence": path, "sentence": f"exact within tolerance: {gap}"}
    checks = (report.get("verdict") or {}).get("checks") or {}
    float32 = report.get("float32") or {}
    synthetic = getattr(study.actor, "source", "synthetic") == "synthetic"
    float32_checks = {k: v for k, v in checks.items() if "float32" in k}
    if float32_checks:
        exact = all(float32_checks.values())
        f32 = (f"greedy {float32.get('greedy_free_running_identical')}/{float32.get('greedy_free_running_requests')}, "
               f"batch partitions {float32.get('partitions_identical')}/{float32.get('partitions_requests')}")
        if not exact:
            return {"outcome": outcome, "source": "backend", "evidence": path,
                    "sentence": f"not exact even in float32 ({f32} identical): a backend bug; in bf16 {gap}"}
        words = None
        if synthetic and ladder is not None:
            where, origin, source, words = _trained_clause(ladder, tolerance)
        else:
            where = ("that comes from the random stand-in model, which amplifies bf16 rounding, not from the backend"
                     if synthetic else "that comes from bf16 rounding on this model (the algorithm is exact in "
                                       "float32)")
            origin = f"from the {'stand-in model' if synthetic else 'backend'}"
            source = "stand-in model" if synthetic else "backend"
        return {"outcome": outcome, "source": source, "source_text": words or source, "evidence": path,
                "short": f"float32-exact; bf16 gap {observed:.3g} ({observed / tolerance:.0f}× the tolerance), "
                         f"{origin}",
                "sentence": f"exact in float32 ({f32} identical), but in bf16 its {gap}: {where}"}
    # no float32 run in this gate's evidence (vLLM serves bf16 only)
    local = (exactness_reading(aggregate, study, "local_conformance", ladder) if gate_id != "local_conformance"
             else None)
    if local and local["source"] in STAND_IN_SOURCES and ladder and ladder.get("vllm_max") is not None:
        return {"outcome": outcome, "evidence": path, **_trained_vllm(ladder, observed, tolerance, gap)}
    if local and local["source"] in STAND_IN_SOURCES:
        local_gate = gate(aggregate, "local_conformance")
        return {"outcome": outcome, "source": "undecided", "evidence": path,
                "short": f"bf16 gap {observed:.3g} ({observed / tolerance:.0f}× the tolerance); "
                         "backend's share undecided",
                "sentence": f"bf16 only, {gap}; the stand-in alone gives float32-exact hf_cached a "
                            f"{local_gate['observed_max']:.3g} gap, so this evidence cannot separate vLLM's share"}
    return {"outcome": outcome, "source": "undecided", "evidence": path,
            "sentence": f"measured in bf16 only: {gap}; no float32 run says whether the backend or the model causes it"}


# ---------------------------------------------------------------- the role sentences


def _backend_speed(aggregate: dict[str, Any], backend: str) -> str:
    return f"{backend} ({rate_range(aggregate, backend)})"


def role_sentences(aggregate: dict[str, Any], study: Preregistration,
                   ladder: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(role, sentence) for local rollouts, direct GKD and PG-k1: what to use, how fast, and why (`ladder`: the
    exactness ladder's trained stand-in, see `exactness_reading`)."""
    selection = aggregate["selection"]
    out = []
    local = selection.get("local")
    if local is not None:
        chosen, candidate = local["backend"], local.get("candidate")
        speed = gate_of_kind(aggregate, "speedup", candidate)
        if local["candidate_qualified"]:
            why = f"it passes every gate it needs ({_ratio_range(speed)} the oracle)"
        else:
            reasons = []
            for failed in local["failed_requirements"]:
                g = gate(aggregate, failed)
                if g and g["kind"] == "conformance":
                    reasons.append(exactness_reading(aggregate, study, failed, ladder)["sentence"])
                elif g and g["kind"] == "speedup" and g.get("observed_min") is None:
                    reasons.append(f"its speed gate is {gate_outcome(g)}: no paired cell measured yet "
                                   f"(gate ≥ {g['threshold']:g}× the oracle)")
                elif g and g["kind"] == "speedup":
                    reasons.append(f"its speed gate is {gate_outcome(g)} ({_ratio_range(g)} the oracle, "
                                   f"gate ≥ {g['threshold']:g}×)")
                else:
                    reasons.append(f"{failed} is {gate_outcome(g) if g else 'missing'}")
            faster = (f"{candidate} is {_ratio_range(speed)} faster ({rate_range(aggregate, candidate)}) and "
                      if speed and speed.get("observed_min") and speed["observed_min"] > 1 else f"{candidate}: ")
            why = f"{faster}" + "; ".join(reasons)
        out.append(("Local rollouts", f"use {_backend_speed(aggregate, chosen)}, the oracle: {why}."))
    for key, label in (("direct_gkd", "Direct GKD"), ("pg_k1", "PG-k1")):
        entry = selection.get(key)
        if entry is None:
            continue
        candidate = entry.get("candidate")
        if entry["candidate_qualified"]:
            out.append((label, f"use {_backend_speed(aggregate, entry['backend'])}: every gate it needs passes."))
            continue
        reasons = []
        if not rates(aggregate, candidate):
            reasons.append(f"{candidate} has no valid cell in this campaign, so it cannot qualify")
        for failed in entry["failed_requirements"] if not reasons else []:
            g = gate(aggregate, failed)
            if g and g["kind"] == "speedup":
                baseline = g.get("baseline")
                speed = (f"{candidate} runs at {_ratio_range(g)} {baseline}'s speed "
                         f"({rate_range(aggregate, candidate)}; gate ≥ {g['threshold']:g}×)")
                reasons.append(speed if g.get("observed_min") is not None else f"{failed} is {gate_outcome(g)}")
            elif g and g["kind"] == "conformance":
                reading = exactness_reading(aggregate, study, failed, ladder)["sentence"]
                reasons.append(f"its log-probabilities miss the gate: {reading}")
            else:
                reasons.append(f"{failed} is {gate_outcome(g) if g else 'missing'}")
        out.append((label, f"stay on the local backend, {_backend_speed(aggregate, entry['backend'])}: "
                           + "; and ".join(reasons) + "."))
    return out


def what_would_change(aggregate: dict[str, Any], study: Preregistration, ladder: dict[str, Any] | None = None) -> str:
    """One line: the failing gates the stand-in model could explain, and the command that decides them on the
    user's own model (`source: snapshot`); with the ladder's trained stand-in (`ladder`), what it showed."""
    stand_in = [g["id"] for g in aggregate["gates"] if g["kind"] == "conformance" and not g["passed"]
                and exactness_reading(aggregate, study, g["id"], ladder)["source"]
                in (*STAND_IN_SOURCES, "undecided")]
    synthetic = getattr(study.actor, "source", "synthetic") == "synthetic"
    command = ("<code>rollout conformance --params params/examples/qwen3-0.6b-hub.yaml --candidate hf_cached "
               "--out outputs/conformance/conformance-&lt;campaign&gt;-hf_cached-&lt;utc&gt;.json</code>")
    if not study.preregistered:
        return ("<b>What would change it:</b> nothing on this page; a smoke run decides nothing. The answer "
                "comes from a preregistered campaign on a GPU (<code>make campaign</code>, then <code>make "
                "report</code>); on your own model, from a study whose actor and teacher are <code>source: "
                "snapshot</code> (<code>params/examples/qwen3-0.6b-hub.yaml</code>).")
    if stand_in and synthetic:
        trained = ""
        tolerance = study.tolerances.nf4_sampled_logprob_abs
        if ladder is not None and ladder["local_max"] > tolerance:
            own = ladder.get("oracle_self_max")
            floor = (f"; the oracle itself reads {own:.3g} against its own scoring there, so the gate decides only "
                     "with a tolerance at or above the oracle's own bf16 noise, measured in the same hold"
                     if own is not None and own > tolerance else "")
            trained = (f" (a stand-in trained for a few GPU-minutes on real text still reads {ladder['local_max']:.3g} "
                       f"on local conformance{floor}: see Exactness)")
        return (f"<b>What would change it:</b> {', '.join(stand_in)} passing on a trained model instead of the "
                f"random stand-in{html.escape(trained)}. Decide it on your own model: fill in "
                "<code>params/examples/qwen3-0.6b-hub.yaml</code> (<code>source: snapshot</code>, its digests), "
                f"commit it, then run {command} on the GPU (and <code>--candidate vllm</code> for PG-k1), and "
                "<code>rollout report</code>.")
    failing = [g["id"] for g in aggregate["gates"] if gate_outcome(g) != "PASS"]
    if not failing:
        return "<b>What would change it:</b> a gate failing on another model or GPU; every gate passes here."
    return (f"<b>What would change it:</b> {', '.join(failing)} passing on a new measurement of this study "
            "(<code>make campaign</code>, then <code>make report</code>).")


# ---------------------------------------------------------------- the figure


def figure_html(fig, alt: str, caption: str = "", dpi: int = 100) -> str:
    """A matplotlib figure as an embedded PNG with its alt text (what a screen reader and a text search see)
    and a caption; the figure is closed."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    cap = f"<figcaption>{caption}</figcaption>" if caption else ""
    return (f'<figure style="margin:0.4em 0"><img src="data:image/png;base64,{data}" alt="{html.escape(alt)}" '
            f'style="max-width:100%;height:auto">{cap}</figure>')


def _cells(aggregate: dict[str, Any], study: Preregistration) -> list[str]:
    return Workload(study).cell_ids()


def throughput_figure(aggregate: dict[str, Any], study: Preregistration):
    """Grouped bars, log scale: tokens/s per cell for each backend. In every gated cell a short line marks what
    the candidate must reach (threshold x its baseline's tokens/s): a bar under its line fails that gate.
    Returns (figure, alt text), or (None, reason) when no cell is measured."""
    import matplotlib.pyplot as plt

    cell_ids = _cells(aggregate, study)
    index = {(c["backend"], c["cell_id"]): c for c in aggregate["cells"]}
    backends = [b for b in BACKEND_ORDER if any(c["backend"] == b for c in aggregate["cells"])]
    if not any(c.get("tokens_per_s") for c in aggregate["cells"]):
        return None, "no cell measured yet"
    speed_gates = [g for g in aggregate["gates"] if g["kind"] == "speedup"]
    fig, ax = plt.subplots(figsize=(12.6, 3.1))
    width = 0.8 / max(len(backends), 1)
    for k, backend in enumerate(backends):
        xs, ys = [], []
        for i, cell_id in enumerate(cell_ids):
            cell = index.get((backend, cell_id))
            if cell and cell["valid"] and cell.get("tokens_per_s"):
                xs.append(i + (k - (len(backends) - 1) / 2) * width)
                ys.append(cell["tokens_per_s"])
        ax.bar(xs, ys, width, color=COLOURS[backend], label=backend)
    lines_drawn = set()
    for g in speed_gates:
        k = backends.index(g["candidate"]) if g["candidate"] in backends else None
        for i, cell_id in enumerate(cell_ids):
            if int(cell_id.split("-")[1][1:]) not in g["response_tokens"]:
                continue
            base = index.get((g["baseline"], cell_id))
            if not base or not base.get("tokens_per_s") or k is None:
                continue
            x = i + (k - (len(backends) - 1) / 2) * width
            label = (f"{g['candidate']} gate: {g['threshold']:g}× {g['baseline']}"
                     if g["id"] not in lines_drawn else None)
            lines_drawn.add(g["id"])
            ax.hlines(g["threshold"] * base["tokens_per_s"], x - width * 0.9, x + width * 0.9, colors="#c53030",
                      linewidth=2.2, label=label)
    gated = sorted({r for g in speed_gates for r in g["response_tokens"]})
    for i, cell_id in enumerate(cell_ids):
        if int(cell_id.split("-")[1][1:]) not in gated:
            ax.axvspan(i - 0.5, i + 0.5, color="#edf2f7", zorder=0)
    ax.set_yscale("log")
    ax.set_xlim(-0.6, len(cell_ids) - 0.4)
    ax.set_xticks(range(len(cell_ids)), cell_ids, rotation=40, ha="right", fontsize=8.5)
    ax.set_ylabel("tokens/s (log scale)")
    ax.grid(axis="y", which="major", color="#cbd5e0", linewidth=0.6)
    ax.legend(fontsize=8.5, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title("tokens/s per cell (median of the measured repetitions); grey columns: not gated; red line: what "
                 "the candidate must reach", fontsize=10)
    fig.tight_layout()
    parts = [f"{b} {rate_range(aggregate, b)}" for b in backends]
    verdicts = []
    for g in speed_gates:
        total = g.get("paired_cells", 0)
        failing = sum(1 for f in g["failing_cells"] if "ratio" in f["reason"])
        verdicts.append(f"{g['candidate']} reaches {g['threshold']:g}× {g['baseline']} in {total - failing} of "
                        f"{total} gated cells ({_ratio_range(g)})")
    alt = ("Bar chart, log scale, tokens per second for each of the " + str(len(cell_ids)) + " workload cells: "
           + "; ".join(parts) + ". " + "; ".join(verdicts) + ".")
    return fig, alt


# ---------------------------------------------------------------- the compact gate table


def gate_rows_html(aggregate: dict[str, Any], study: Preregistration) -> str:
    smoke = not study.preregistered
    rows = []
    for g in aggregate["gates"]:
        outcome = gate_outcome(g)
        colour = "#4a5568" if smoke else OUTCOME_COLOURS[outcome]
        label = f'<b style="color:{colour}">{outcome}</b>'
        if smoke:
            label += ' <small style="color:#4a5568">(plumbing check)</small>'
        link = f' <a href="#failures-{g["id"]}">details</a>' if g["failing_cells"] else ""
        rows.append(f"<tr><td>{label}</td><td>{html.escape(g['id'])}</td><td>{html.escape(_rule(g))}</td>"
                    f"<td>{html.escape(_observed(g))}{link}</td></tr>")
    head = "outcome (smoke: not a verdict)" if smoke else "outcome"
    return ('<style>#answer table.gates td, #answer table.gates th {text-align:left;padding:2px 10px}'
            " details {overflow-x:auto;margin:0.25em 0} details > summary {cursor:pointer}"
            " section h2 {margin-top:0.9em}</style>"
            f'<table class="gates"><thead><tr><th>{head}</th><th>gate</th><th>rule</th><th>observed</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def _rule(g: dict[str, Any]) -> str:
    if g["unit"] == "ratio":
        responses = ", ".join(map(str, g["response_tokens"]))
        return f"{g['candidate']} ≥ {g['threshold']:g}× {g['baseline']} (response {responses})"
    if g["unit"] == "bytes":
        return f"peak process tree < {g['threshold'] / GIB:.1f} GiB"
    if g["unit"] == "nats":
        return f"{g['candidate']} vs {g['baseline']}: |Δ log-prob| ≤ {g['threshold']:g}, greedy exact"
    return f"{g['threshold']:g} refreshes: unique exact identities, no memory growth, port closed"


def _observed(g: dict[str, Any]) -> str:
    if g["unit"] == "ratio":
        if g.get("observed_min") is None:
            return "— (no paired cell measured)"
        return f"{_ratio_range(g)} over {g.get('paired_cells', 0)} paired cells" + _missing(g)
    if g["unit"] == "bytes":
        return "— (no NVML peak: CPU run)" if g.get("observed_max") is None else \
            f"max {g['observed_max'] / GIB:.2f} GiB" + _missing(g)
    if g["unit"] == "nats":
        return "— (no accepted evidence)" if g.get("observed_max") is None else \
            f"{g['observed_max']:.3g}" + (" (" + short((g.get("used_evidence") or [None])[-1]) + ")")
    checks = g.get("per_backend_passed") or {}
    if gate_outcome(g) == "INCOMPLETE" and not g.get("used_evidence"):
        return "— (no accepted evidence)"
    missing = {reason.partition(":")[0] for reason in (c.get("reason", "") for c in g.get("failing_cells") or [])
               if "no accepted" in reason}

    def word(backend: str, ok: bool) -> str:
        return "passed" if ok else ("— (no accepted evidence)" if backend in missing else "failed")

    return ", ".join(f"{b}: {word(b, ok)}" for b, ok in checks.items()) or "— (no evidence)"


def _missing(g: dict[str, Any]) -> str:
    lacking = sum(1 for f in g["failing_cells"] if "missing" in f["reason"])
    return f"; {lacking} missing" if lacking else ""


def answer_html(aggregate: dict[str, Any], study: Preregistration, campaign: str,
                output_dir: str | Path | None = None) -> str:
    """The first screen: title, (smoke line), role sentences, the figure, the gate table, what would change it;
    with `output_dir`, the exactness ladder's trained stand-in (`<output_dir>/perf/standins-*`) qualifies the
    sentences about bf16 exactness."""
    ladder = trained_reading(Path(output_dir), study.sha256) if output_dir is not None else None
    title = (f'<h1 style="margin-top:0.2em">Which rollout backend? — campaign {html.escape(campaign)}</h1>')
    smoke = (f'<p id="smoke-line" style="font-size:1.05em;background:#fefcbf;padding:0.4em 0.6em">'
             f"<b>{html.escape(SMOKE_LINE)}</b></p>") if not study.preregistered else ""
    items = "".join(f"<li><b>{html.escape(role)}:</b> {html.escape(sentence)}</li>"
                    for role, sentence in role_sentences(aggregate, study, ladder))
    fig, alt = throughput_figure(aggregate, study)
    figure = (figure_html(fig, alt) if fig is not None
              else f"<p><i>tokens/s per cell: — ({alt}).</i></p>")
    return (f'<div id="answer">{title}{smoke}<ul id="verdict-sentences" style="font-size:1.02em">{items}</ul>'
            f'<p id="what-would-change">{what_would_change(aggregate, study, ladder)}</p>'
            f'{figure}{gate_rows_html(aggregate, study)}</div>{OPEN_TARGET_SCRIPT}')


def median_rate(aggregate: dict[str, Any], backend: str) -> float | None:
    found = rates(aggregate, backend)
    return statistics.median(found) if found else None
