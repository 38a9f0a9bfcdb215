"""The report after its first screen, in a reader's order: speed, exactness, memory, refresh, full cycle,
then setup and evidence. Each section opens with a one-line finding computed from the evidence; its
caveats stand beside it (one or two sentences, naming their evidence file); detail is folded in
<details>. Nothing here changes a number: it lays out the frozen calculator's aggregate and the
evidence files it names.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from rollout_lib.core import REPO_ROOT
from rollout_lib.report import answer
from rollout_lib.report.answer import figure_html, rate_range, short
from rollout_lib.report.summary import BACKEND_ORDER, GIB, gate_outcome, styled
from rollout_lib.study.prereg import Preregistration


def section(anchor: str, title: str, finding: str, body: str = "", details: tuple[tuple[str, str], ...] = ()) -> str:
    folded = "".join(f"<details><summary>{html.escape(summary)}</summary>{content}</details>"
                     for summary, content in details if content)
    return (f'<section id="{anchor}"><h2>{html.escape(title)}</h2><p class="finding"><b>{finding}</b></p>'
            f"{body}{folded}</section>")


def caveat(text: str, evidence: str | None = None) -> str:
    where = f" <i>Evidence: {html.escape(evidence)}.</i>" if evidence else ""
    return f'<p class="caveat" style="color:#4a5568;font-size:0.92em">Caveat: {html.escape(text)}{where}</p>'


def table_html(frame) -> str:
    if frame is None or len(frame) == 0:
        return ""
    return styled(frame).to_html()


def _figure_or_line(fig, alt: str, what: str, why: str) -> str:
    return figure_html(fig, alt) if fig is not None else f"<p><i>{html.escape(what)}: — ({html.escape(why)}).</i></p>"


# ---------------------------------------------------------------- speed


def _gate_phrase(g: dict[str, Any] | None) -> str:
    if g is None:
        return ""
    if g.get("observed_min") is None:
        return (f"{g['candidate']} / {g['baseline']}: — (no paired cell measured; gate ≥ {g['threshold']:g}×: "
                f"{gate_outcome(g)})")
    return (f"{g['candidate']} is {answer._ratio_range(g)} {g['baseline']} "
            f"(gate ≥ {g['threshold']:g}×: {gate_outcome(g)})")


def speed_html(aggregate: dict[str, Any], study: Preregistration, inputs: dict[str, Any],
               output_dir: Path | None = None) -> str:
    import pandas as pd

    from rollout_lib.report import figures
    from rollout_lib.report import summary as report

    gates = [g for g in aggregate["gates"] if g["kind"] == "speedup"]
    finding = "; ".join(p for p in (_gate_phrase(g) for g in gates) if p) or "no speed gate in this study"
    rows = []
    for backend in BACKEND_ORDER:
        found = answer.rates(aggregate, backend)
        runs = sorted({Path(c["raw_file"]).stem for c in aggregate["cells"]
                       if c["backend"] == backend and c["valid"] and c.get("raw_file")})
        rows.append({"backend": backend, "valid cells": len(found), "tokens/s": rate_range(aggregate, backend),
                     "median tok/s": f"{answer._n(answer.median_rate(aggregate, backend))}" if found else "—",
                     "processes (raw files) behind the rows": len(runs) or "—"})
    body = table_html(pd.DataFrame(rows))
    by_backend = {b: sorted({c["raw_file"] for c in aggregate["cells"] if c["backend"] == b and c.get("raw_file")})
                  for b in BACKEND_ORDER}
    if by_backend["hf_cached"] and by_backend["vllm"]:
        body += caveat(f"vllm / hf_cached compares rows from {len(by_backend['vllm'])} vllm and "
                       f"{len(by_backend['hf_cached'])} hf_cached raw file(s), measured in separate processes "
                       "(machine holds of the same GPU kind).",
                       ", ".join(short(p) for p in by_backend["vllm"][:2] + by_backend["hf_cached"][:2]))
    segments = report.segment_summary(aggregate)
    if "more than one process" in segments:
        body += caveat("Some cells' repetitions come from several processes (a cell cut at a deadline is continued "
                       "later), so their spread includes the difference between machine holds: "
                       + segments.replace("\n\n", "; ") + ".", "the segments table below")
    if study.protocol.measured_repetitions < 3:
        body += caveat(f"{study.protocol.measured_repetitions} measured repetition(s) per cell: medians carry little.")
    fig = report.speedup_figure(aggregate, study)
    speed_alt = ("Bar charts of the speedup per paired cell, " + "; ".join(_gate_phrase(g) for g in gates)
                 + "; whiskers are the repetition extremes, grey bars are cells no gate covers.")
    phase = figures.phase_figure(aggregate)
    details = (("Speedup per paired cell, against the gate lines",
                _figure_or_line(fig, speed_alt, "speedups", "no paired cell measured yet")),
               ("Tokens/s and peak memory per cell (table)", table_html(report.throughput_table(aggregate))),
               ("Cells measured by more than one process (segments)",
                f"<p>{html.escape(segments)}</p>" + table_html(report.segment_table(aggregate))),
               ("Phase breakdown (prefill, decode) where the backend exposes it",
                _figure_or_line(phase, "Stacked bars of prefill, decode and other seconds per cell for the backends "
                                "that expose phases (hf_reference exposes none: not_measured).",
                                "phase breakdown", "no backend exposed prefill and decode in these cells")
                + table_html(report.phase_table(aggregate))),
               ("Cold start per raw file", table_html(report.cold_start_table(aggregate, inputs))
                or "<p>No cold start recorded in the raw files this campaign uses.</p>"))
    floor = report.decode_floor(aggregate, inputs, study)
    if floor["cells"]:
        details += ((f"Decode step against the memory-bandwidth floor ({floor['backend']})",
                     f"<p>{html.escape(report.decode_floor_sentence(floor))}</p>"
                     + table_html(report.decode_floor_table(floor))),)
    side_by_side = _side_by_side_html(output_dir) if output_dir is not None else ""
    if side_by_side:
        details += (("hf_cached beside vLLM's in-process engine without LoRA (diagnostic runs, beside the gates)",
                     side_by_side),)
    profiles = _step_profiles_html(output_dir, aggregate.get("campaign")) if output_dir is not None else ""
    if profiles:
        details += (("Decode step, kernel by kernel (profiled traces, beside the gates)", profiles),)
    return section("speed", "Speed", finding, body, details)


def _step_profiles_html(output_dir: Path, campaign: str | None = None) -> str:
    """The breakdown records `rollout profile-breakdown --json` wrote under the output tree's perf/ folder, and
    those the measure notebook saved beside its profiles of `campaign`."""
    from rollout_lib.report import step_profiles

    found = step_profiles.step_profile_records(output_dir, campaign)
    if not found:
        return ""
    sentence = step_profiles.step_profile_sentence(found)
    return ((f"<p>{html.escape(sentence)}.</p>" if sentence else "")
            + "<p>Each row is one torch-profiler trace of whole decode steps, broken down by <code>rollout "
              "profile-breakdown</code>: µs per decode step by kind of kernel, named by the kernels' names. GPU "
              "active is the span less its gaps; the L2 prefetch runs on a side stream beside other kernels, so the "
              "kinds' sum can pass the span. Rows of different GPUs compare only loosely.</p>"
            + table_html(step_profiles.step_profile_table(found)))


def _side_by_side_html(output_dir: Path) -> str:
    """The diagnostic files that measured hf_cached beside vLLM's engine (`rollout vllm-diagnostic --variants
    ...,hf_cached`), each with its caption and table: speed evidence, so shown here, not with exactness."""
    from rollout_lib.report import diagnostics

    found = diagnostics.diagnostic_files(output_dir)
    sentence, summary = diagnostics.side_by_side_summary(found)
    if not sentence:
        return ""
    return (f"<p>{_md(sentence)}</p>" + table_html(summary)
            + "".join(f"<p>{_md(diagnostics.caption(path, report))}</p>"
                      + table_html(diagnostics.diagnostic_table(path, report))
                      for path, report in found if diagnostics.with_hf_cached(report)))


# ---------------------------------------------------------------- exactness


def exactness_html(aggregate: dict[str, Any], study: Preregistration, reproducibility: dict[str, Any],
                   campaign: str, output_dir: Path) -> str:
    import pandas as pd

    from rollout_lib.report import diagnostics
    from rollout_lib.report import summary as report
    from rollout_lib.report.standins import trained_reading

    ladder = trained_reading(output_dir, study.sha256)
    rows, sentences = [], []
    for g in (g for g in aggregate["gates"] if g["kind"] == "conformance"):
        reading = answer.exactness_reading(aggregate, study, g["id"], ladder)
        evidence = answer.evidence_report(reading["evidence"]) if reading["evidence"] else None
        float32 = (evidence or {}).get("float32") or {}
        rows.append({"gate": g["id"], "outcome": gate_outcome(g),
                     "float32 greedy identical": _fraction(float32, "greedy_free_running"),
                     "float32 partitions identical": _fraction(float32, "partitions"),
                     "bf16 max |Δ log-prob|": (f"{g['observed_max']:.3g} (tolerance {g['threshold']:g})"
                                               if g.get("observed_max") is not None else "— (no evidence)"),
                     "the failure comes from": (reading.get("source_text") or reading["source"]
                                                or "— (passes or undecided)"),
                     "evidence": short(reading["evidence"])})
        sentences.append(f"{g['candidate']} {gate_outcome(g)}" + (f" ({reading['short']})" if reading.get("short")
                                                                   else ""))
    stable = [f"{r['backend']} {r['sampling']} {r['stable_requests']}/{r['requests']}" for r in reproducibility["rows"]]
    finding = ("; ".join(sentences) or "no conformance gate in this study") + (
        ". Tokens repeat across repetitions in: " + ", ".join(stable) if stable else "")
    body = table_html(pd.DataFrame(rows))
    if any(r["the failure comes from"] == "stand-in model" for r in rows):
        body += caveat("The stand-in is a random-weight network at the study's shape (DESIGN decision 13): float32 "
                       "runs show the algorithm is exact, bf16 rounding grows through its layers; a trained model is "
                       "needed to decide bf16 exactness.", ", ".join(r["evidence"] for r in rows))
    body += _standin_ladder_html(output_dir, study)
    repro_rows = [{"backend": r["backend"], "sampling": r["sampling"],
                   "requests stable": f"{r['stable_requests']} of {r['requests']}",
                   "with the warm-up": f"{r['stable_requests_with_warmup']} of {r['requests']}",
                   "measured over several processes, stable": (
                       f"{r['stable_over_several_processes']} of {r['requests_over_several_processes']}"
                       if r["requests_over_several_processes"] else "— (one process per cell)"),
                   "greedy batch mates agree": (f"{r['batch_mates_agree']} of {r['batch_mate_groups']} prompt groups"
                                                if r["batch_mate_groups"] else "— (no greedy n>1 cell)")}
                  for r in reproducibility["rows"]]
    body += ("<h3>Reproducibility: identical tokens across repetitions and engine starts</h3>"
             + (table_html(pd.DataFrame(repro_rows)) if repro_rows else
                "<p>— (no valid cell with token hashes yet)</p>")
             + caveat(f"Definition: {reproducibility['definition']}. Computed from the raw files by "
                      f"rollout reproducibility --campaign {campaign}; seeded stochastic samples of the oracle and "
                      "greedy tokens of vLLM that differ between repetitions make their token-level comparisons hold "
                      "for one run only.", f"outputs/raw/{campaign}/"))
    found = [(path, d) for path, d in diagnostics.diagnostic_files(output_dir) if not diagnostics.with_hf_cached(d)]
    diag = ""
    ladder = diagnostics.ladder_summary(found)
    if ladder is not None:
        diag += "<p><b>Precision ladder for PG-k1, newest measurement of each setting</b></p>" + table_html(ladder)
    for path, diagnostic in found:
        diag += f"<p>{_md(diagnostics.caption(path, diagnostic))}</p>" + table_html(
            diagnostics.diagnostic_table(path, diagnostic))
    details = (("Conformance evidence files, every check", table_html(report.conformance_table(aggregate))
                or "<p>No conformance evidence for this campaign yet.</p>"),
               ("vLLM diagnostics: LoRA tax, refresh paths, precision ladders (beside the gates, never part of them)",
                diag or "<p>No vLLM diagnostic runs in this output folder.</p>"))
    return section("exactness", "Exactness", html.escape(finding), body, details)


def _standin_ladder_html(output_dir: Path, study: Preregistration) -> str:
    """Issue 42's ladder: the same exactness checks on this study's actor and on a trained stand-in."""
    import pandas as pd

    from rollout_lib.report.standins import standin_ladder

    rows = standin_ladder(output_dir, study.sha256)
    if not rows:
        return ""
    key = "bf16 hf_cached vs oracle: sampled max |Δ log p|"
    measured = [r for r in rows if r[key] != "not_measured"]
    reading = ""
    if len(measured) >= 2:
        reading = "<p>" + html.escape("bf16 sampled-token max |Δ log p| of hf_cached against the oracle: "
                                      + "; ".join(f"{r['stand-in']} {r[key]} ({r['cells']})" for r in measured)
                                      + f". The gate's tolerance is {study.tolerances.nf4_sampled_logprob_abs:g}.") \
            + "</p>"
    return ("<h3>Exactness by stand-in model: how much of the bf16 gap the random stand-in makes</h3>" + reading
            + table_html(pd.DataFrame(rows))
            + caveat("Beside the gates, never part of them: the same checks (rollout conformance) run on this "
                     "study's actor and on a stand-in trained for a few GPU-minutes on text every machine has "
                     "(rollout models train, docs/standin.md), each with its own preregistration and prompts. "
                     "A rung without a file reads not_measured.", ", ".join(r["evidence"] for r in rows)))


def _md(text: str) -> str:
    """The diagnostics captions' **bold** and `code` as HTML."""
    import re

    escaped = html.escape(text)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", escaped)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)


def _fraction(block: dict[str, Any], prefix: str) -> str:
    same, total = block.get(f"{prefix}_identical"), block.get(f"{prefix}_requests")
    if same is None or total is None:
        return "— (not in this evidence)"
    return f"{same}/{total}"


# ---------------------------------------------------------------- memory


def memory_html(aggregate: dict[str, Any], study: Preregistration) -> str:
    from rollout_lib.report import summary as report

    g = answer.gate_of_kind(aggregate, "peak_memory")
    if g is None or g.get("observed_max") is None:
        finding = "— (no NVML peak measured: CPU run, not_applicable)"
    else:
        worst = max((c for c in aggregate["cells"] if c["memory"].get("nvml_peak_process_tree_bytes")),
                    key=lambda c: c["memory"]["nvml_peak_process_tree_bytes"])
        finding = (f"Peak GPU memory {g['observed_max'] / GIB:.2f} GiB ({worst['backend']}, {worst['cell_id']}) "
                   f"against the gate's {g['threshold'] / GIB:.1f} GiB: {gate_outcome(g)}")
    fig = report.memory_figure(aggregate, study)
    alt = "Scatter of peak GPU memory per cell and backend (NVML process tree and torch peak reserved) against the " \
          f"{study.memory.gate_peak_total_bytes / GIB:.1f} GiB gate and the {study.memory.budget_bytes / GIB:.0f} " \
          "GiB budget lines."
    body = _figure_or_line(fig, alt, "peak GPU memory", "no NVML peak measured (CPU run: not_applicable)")
    if fig is not None:
        body += caveat(f"Measured on a larger GPU under an emulated {study.memory.budget_bytes / GIB:.0f} GiB budget "
                       "(torch memory fraction; vLLM's KV-cache bytes); each raw file's cold-start record names it.",
                       "the raw files' cold_start records")
    return section("memory", "Memory", html.escape(finding), body)


# ---------------------------------------------------------------- refresh


def refresh_html(aggregate: dict[str, Any]) -> str:
    from rollout_lib.report import figures
    from rollout_lib.report import summary as report

    g = answer.gate_of_kind(aggregate, "policy_refresh")
    used = set((g or {}).get("used_evidence") or [])
    lines = []
    for entry, data in report.refresh_reports(aggregate):
        if entry["path"] not in used:
            continue
        syncs = [r["sync_s"] for r in data.get("rows", [])]
        lines.append(f"{data['backend']}: {data['versions']} versions, "
                     f"{'every check passed' if data['verdict']['passed'] else 'a check failed'}, sync "
                     + (f"{min(syncs):.2f}–{max(syncs):.2f} s" if syncs else "—")
                     + f" ({short(entry['path'])})")
    if g is None:
        finding = "no refresh gate in this study"
    elif not lines:
        finding = f"policy_refresh {gate_outcome(g)}: — (no accepted refresh evidence)"
    else:
        finding = f"policy_refresh {gate_outcome(g)}: " + "; ".join(lines)
    fig = figures.refresh_figure(aggregate)
    details = (("Every refresh evidence file", table_html(report.refresh_table(aggregate))),
               ("Sync time per policy version",
                _figure_or_line(fig, "Line chart of policy sync seconds per version, one line per refresh evidence "
                                "file.", "refresh sync-time series", "no policy-refresh evidence for this campaign")))
    return section("refresh", "Policy refresh", html.escape(finding), "", details)


# ---------------------------------------------------------------- full cycle


def cycle_campaigns(output_dir: Path, campaign: str, names: str = "") -> list[tuple[str, dict[str, Any]]]:
    """The cycle aggregates to show side by side: the named ones (comma-separated), else every aggregate under
    `<output_dir>/cycles/aggregate/` whose campaign is this campaign or starts with `<campaign>-`."""
    from rollout_lib.report.cycle import load_cycle_aggregate

    folder = Path(output_dir) / "cycles" / "aggregate"
    if names.strip():
        wanted = [n.strip() for n in names.split(",") if n.strip()]
    else:
        found = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
        wanted = [n for n in found if n == campaign or n.startswith(f"{campaign}-")]
    out = []
    for name in wanted:
        data = load_cycle_aggregate(Path(output_dir), name)
        if data is not None and data.get("rows") is not None:
            out.append((name, data))
    return out


def cycle_html(output_dir: Path, campaign: str, names: str = "") -> str:
    import pandas as pd

    from rollout_lib.report import cycle as cycle_report
    from rollout_lib.report.cycle import row_label

    campaigns = cycle_campaigns(output_dir, campaign, names)
    if not campaigns:
        return section("full-cycle", "Full cycle", f"— (no cycle campaign published for {html.escape(campaign)}: "
                       "<code>rollout cycle</code> then <code>rollout cycle-publish</code>)")
    findings, details = [], []
    for name, data in campaigns:
        rows = [r for r in data["rows"] if r.get("complete_cycle_median_s") is not None]
        if not rows:
            findings.append(f"{name}: — (no complete run yet)")
            continue
        cycle_s = [r["complete_cycle_median_s"] for r in rows]
        update = [r["phases"]["actor_update"]["median_s"] for r in rows
                  if r["phases"]["actor_update"]["status"] == "measured"]
        gates = [r["memory_gate"]["status"] for r in rows]
        text = f"{name}: one RL cycle takes {min(cycle_s):.1f}–{max(cycle_s):.1f} s over {len(rows)} runs"
        if update:
            text += f", of which the actor update is {min(update):.1f}–{max(update):.1f} s"
        if "fail" in gates:
            failing = sorted({row_label(r) for r in rows if r["memory_gate"]["status"] == "fail"})
            more = f" and {len(failing) - 3} more" if len(failing) > 3 else ""
            text += f"; the memory gate fails in {len(failing)} run(s) ({', '.join(failing[:3])}{more})"
        findings.append(text)
        not_counted = cycle_report.runs_not_counted(data)
        mem = cycle_report.cycle_memory_figure(data)
        details.append((f"{name}: every run (table), memory per phase, runs not counted",
                        table_html(cycle_report.cycle_table(data, Path(output_dir)))
                        + (figure_html(mem, f"Grouped bars of peak GPU memory per phase for each run of cycle "
                                            f"campaign {name}, against the budget and the gate lines.") if mem
                           else "<p><i>memory per phase: — (no GPU memory measured: CPU run, not_applicable)</i></p>")
                        + (f"<p>Still missing: {len(data['missing'])} run(s): "
                           + html.escape(", ".join(f"{m['backend']} {m['algorithm']} {m['cell_id']}"
                                                   for m in data["missing"])) + "</p>" if data.get("missing") else "")
                        + (table_html(pd.DataFrame(not_counted)) if not_counted is not None
                           else "")))
    fig = cycle_report.cycle_phase_figure_by_campaign(campaigns)
    alt = ("Horizontal stacked bars, one per cycle run, of the seconds spent in rollout, teacher scoring, actor "
           "scoring, actor update, policy sync and other, one panel per cycle campaign, top to bottom on one "
           "time axis ("
           + ", ".join(n for n, _ in campaigns) + "). " + " ".join(findings))
    body = _figure_or_line(fig, alt, "phases per cycle", "no complete cycle run")
    missing = [m for _, data in campaigns for m in data.get("missing") or []]
    if missing:
        body += caveat(f"{len(missing)} cycle run(s) not measured ("
                       + ", ".join(sorted({m['backend'] for m in missing})) + "): listed in the details.",
                       "outputs/cycles/aggregate/")
    return section("full-cycle", "Full cycle", html.escape("; ".join(findings)), body, tuple(details))


# ---------------------------------------------------------------- setup and evidence


def setup_html(study: Preregistration, aggregate: dict[str, Any], inputs: dict[str, Any]) -> str:
    """The frozen setup, and how long the whole campaign would take on 1, 2, 4 and 8 GPUs, estimated from
    the measured cells of the raw files the report already read (`campaign.scaling`)."""
    from rollout_lib.report import summary as report

    gpus = sorted({(r["records"][0].get("environment", {}).get("gpu", {}) or {}).get("name") or "no GPU (CPU)"
                   for r in inputs["raw_files"] if r["records"]})
    finding = (f"{study.study_id} ({study.status_label}); actor: {report.model_source_text(study.actor)}; "
               f"measured on {', '.join(gpus) or '—'}; {study.protocol.warmup_repetitions} warm-up + "
               f"{study.protocol.measured_repetitions} measured repetitions per cell, median")
    if study.hf_cached_engine:  # issue 43: the study names the engine hf_cached measured (else its defaults)
        finding += "; hf_cached engine: " + ", ".join(f"{k}={v}" for k, v in sorted(study.hf_cached_engine.items()))
    details = [("Frozen setup: preregistration, calculator, models, budget, each raw file's environment",
                table_html(report.setup_table(study, aggregate, inputs)))]
    scaling = _scaling(study, aggregate.get("campaign", ""), inputs)
    if scaling is not None:
        counts = scaling["gpu_counts"]
        # measured on the CPU (the smoke profile), a worker is a CPU process, not a GPU
        unit = "worker" if gpus == ["no GPU (CPU)"] else "GPU"
        finding += ("; the whole campaign, measured from scratch, would take "
                    + ", ".join(f"{_hours(scaling['campaign_s'][str(n)])} on {n} {unit}{'s' if n > 1 else ''}"
                                for n in counts)
                    + f" (estimated from its measured cells; {_hours(scaling['bound_s'])} at best, the longest cells)")
        details.append((f"Campaign duration on {', '.join(map(str, counts))} {unit}s: per backend, estimated from "
                        "the measured cells (rollout campaign scaling)", table_html(_scaling_frame(scaling, unit))
                        + caveat(f"Longest-first onto the least-loaded {unit} with no deadline, backends one after "
                                 f"another, one measured cold start per {unit}; process start, the Ray cluster's start "
                                 "and time between repetitions are left out. The bound is a cold start plus the "
                                 f"longest cell: no {unit} count finishes a backend faster.",
                                 "the campaign's raw files")))
    return section("setup", "Setup", html.escape(finding), "", tuple(details))


def _scaling(study: Preregistration, campaign: str, inputs: dict[str, Any]) -> dict[str, Any] | None:
    from rollout_lib.campaign.scaling import campaign_scaling
    from rollout_lib.study.prereg import BACKEND_NAMES

    files = {b: [r["records"] for r in inputs["raw_files"] if r["backend"] == b and r["records"]]
             for b in BACKEND_NAMES}
    try:
        return campaign_scaling(study, campaign, files)
    except ValueError:  # no raw file yet: the finding says nothing about duration
        return None


def _hours(seconds: float) -> str:
    """A duration at the precision a reader plans with: hours, minutes, or seconds under a minute and a half."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _scaling_frame(scaling: dict[str, Any], unit: str = "GPU"):
    import pandas as pd

    rows = []
    for b in scaling["backends"]:
        row = {"backend": b["backend"], "cells (measured)": f"{b['cells']} ({b['cells_measured']})",
               "cold start": f"{b['cold_start_s']:.0f} s"}
        row |= {f"{n} {unit}": _hours(b["makespan_s"][str(n)]) for n in scaling["gpu_counts"]}
        row |= {"bound": _hours(b["bound_s"]), "longest cell": f"{b['longest_cell']} ({b['longest_cell_s']:.0f} s)"}
        rows.append(row)
    total = {"backend": "campaign", "cells (measured)": "", "cold start": ""}
    total |= {f"{n} {unit}": f"{_hours(scaling['campaign_s'][str(n)])} ({scaling['speedup'][str(n)]:.2f}x, "
                          f"efficiency {scaling['efficiency'][str(n)]:.2f})" for n in scaling["gpu_counts"]}
    total |= {"bound": _hours(scaling["bound_s"]), "longest cell": ""}
    rows.append(total)
    return pd.DataFrame(rows).set_index("backend")


def evidence_html(study: Preregistration, aggregate: dict[str, Any], campaign: str, matches: bool,
                  stored: Path | None, waiting: dict[str, Any], notes_path: Path | None) -> str:
    from rollout_lib.report import summary as report
    from rollout_lib.report.verdict import coverage_html

    accepted = sum(1 for f in aggregate["raw_files"] if f["accepted"])
    where = stored.name if stored is not None else "—"
    finding = ((f"The published aggregate {where} re-derives byte for byte" if matches else
                "The published aggregate is missing or stale (run <code>rollout publish</code>)")
               + f" from {accepted} accepted raw file(s) and {len(aggregate['evidence_files'])} evidence file(s), "
               f"with the frozen calculator (sha256 {aggregate['calculator_sha256'][:12]}…)")
    body = ""
    sealed = aggregate.get("sealed_after_the_fact")
    if sealed:
        body += ("<h3>Files sealed after the fact</h3>"
                 + table_html(_sealed_frame(sealed))
                 + caveat("These files were sealed after their run ended; each row says why and whether the "
                          "allowlist accepts it.", "the seal manifests (SEALS.jsonl)"))
    if notes_path is not None:
        shown = notes_path.resolve().relative_to(REPO_ROOT) if notes_path.resolve().is_relative_to(REPO_ROOT) \
            else notes_path
        body += caveat(f"The campaign's human notes (context, not evidence; lease by lease) are in {shown}, outside "
                       "this report.")
    details = (("Coverage: cells by backend", coverage_html(aggregate, study)),
               ("Cells still missing", table_html(report.missing_table(aggregate, waiting,
                                                                       study.protocol.measured_repetitions))),
               ("Failing and missing entries, per gate", report.all_failures_html(aggregate)),
               ("Earlier and failed candidates (every raw file, excluded ones with their reason)",
                table_html(report.candidates_table(aggregate))),
               ("Integrity: every file and its SHA-256",
                table_html(report.integrity_table(study, aggregate, stored if matches else None))))
    return section("evidence", "Evidence", finding, body, details)


def _sealed_frame(entries: list[dict[str, Any]]):
    import pandas as pd

    from rollout_lib.report.summary import text

    rows = [{"file": text(e.get("file")), "sha256": (text(e.get("sha256")) or "—")[:16] + "…",
             "sealed at": text(e.get("sealed_at")), "reason": text(e.get("reason")),
             "allowlisted": text(e.get("allowlisted")),
             "allowlist reason": text(e.get("allowlist_reason")) if e.get("allowlist_reason") else "— (none given)"}
            for e in entries]
    return pd.DataFrame(rows)
