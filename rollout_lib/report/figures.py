"""Figures of the report that a reader looks at instead of reading tables: tokens/s per cell and
backend, phase breakdown, refresh sync time. Each returns None when it would be empty, and
`missing_line` says in one sentence what is missing instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_lib.report.summary import BACKEND_ORDER, refresh_reports


def missing_line(what: str, why: str) -> str:
    return f"*{what}: {why}.*"


def throughput_heatmap(aggregate: dict[str, Any], study=None):
    """One panel per backend: rows prompt x response, columns n x sampling (the whole workload's
    axes when `study` is given), tokens/s written in; unmeasured cells read 'missing'."""
    import matplotlib.pyplot as plt
    import numpy as np

    cells = [c for c in aggregate["cells"] if c.get("tokens_per_s") is not None]
    if not cells:
        return None
    if study is not None:
        work = study.workload
        prompts, responses = sorted(work.prompt_tokens), sorted(work.response_tokens)
        columns = sorted((n, s.name) for n in work.samples_per_prompt for s in work.samplings)
    else:
        prompts = sorted({c["prompt_tokens"] for c in aggregate["cells"]})
        responses = sorted({c["response_tokens"] for c in aggregate["cells"]})
        columns = sorted({(c["samples_per_prompt"], c["sampling"]) for c in aggregate["cells"]})
    rows = [(p, r) for p in prompts for r in responses]
    backends = [b for b in BACKEND_ORDER if any(c["backend"] == b for c in aggregate["cells"])]
    fig, axes = plt.subplots(1, len(backends), figsize=(4.2 * len(backends), 0.55 * len(rows) + 1.8), squeeze=False)
    peak = max(c["tokens_per_s"] for c in cells)
    for ax, backend in zip(axes[0], backends, strict=True):
        grid = np.full((len(rows), len(columns)), np.nan)
        labels = [["missing"] * len(columns) for _ in rows]
        for c in aggregate["cells"]:
            if c["backend"] != backend:
                continue
            i = rows.index((c["prompt_tokens"], c["response_tokens"]))
            j = columns.index((c["samples_per_prompt"], c["sampling"]))
            if c.get("tokens_per_s") is not None:
                grid[i, j] = np.log10(c["tokens_per_s"])
                labels[i][j] = f"{c['tokens_per_s']:.0f}" + ("" if c["valid"] else "\n(invalid)")
            else:
                labels[i][j] = "invalid"
        ax.imshow(grid, cmap="viridis", vmin=0, vmax=np.log10(max(peak, 10)), aspect="auto")
        for i in range(len(rows)):
            for j in range(len(columns)):
                ax.text(j, i, labels[i][j], ha="center", va="center", fontsize=7,
                        color="white" if not np.isnan(grid[i, j]) else "#718096")
        ax.set_xticks(range(len(columns)), [f"n={n}\n{s}" for n, s in columns], fontsize=7)
        ax.set_yticks(range(len(rows)), [f"p{p} r{r}" for p, r in rows], fontsize=7)
        ax.set_title(f"{backend}: tokens/s", fontsize=9)
    fig.tight_layout()
    return fig


def phase_figure(aggregate: dict[str, Any]):
    """Stacked prefill / decode / other seconds (medians) for cells whose phases were measured."""
    import matplotlib.pyplot as plt

    cells = [c for c in aggregate["cells"] if c.get("median_wall_s") is not None
             and all(c.get("phases", {}).get(k, {}).get("status") == "measured" for k in ("prefill_s", "decode_s"))]
    if not cells:
        return None
    labels = [f"{c['backend']}\n{c['cell_id']}" for c in cells]
    prefill = [c["phases"]["prefill_s"]["median_s"] for c in cells]
    decode = [c["phases"]["decode_s"]["median_s"] for c in cells]
    other = [max(0.0, c["median_wall_s"] - a - b) for c, a, b in zip(cells, prefill, decode, strict=True)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(cells) + 2), 3.6))
    x = range(len(cells))
    ax.bar(x, prefill, label="prefill (= TTFT)", color="#dd6b20")
    ax.bar(x, decode, bottom=prefill, label="decode", color="#2b6cb0")
    ax.bar(x, other, bottom=[a + b for a, b in zip(prefill, decode, strict=True)], label="other (wall - phases)",
           color="#a0aec0")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("seconds (median of measured repetitions)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("phase breakdown where the backend exposes phases")
    fig.tight_layout()
    return fig


def refresh_figure(aggregate: dict[str, Any]):
    """Sync seconds per policy version, one line per refresh evidence file."""
    import matplotlib.pyplot as plt

    series = []
    for entry, report in refresh_reports(aggregate):
        syncs = [row["sync_s"] for row in report.get("rows", [])]
        if syncs:
            series.append((f"{report.get('backend')} ({Path(entry['path']).name})", syncs))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for label, syncs in series:
        ax.plot(range(1, len(syncs) + 1), syncs, marker="o", label=label)
    ax.set_xlabel("policy version")
    ax.set_ylabel("sync seconds")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("policy sync time per refresh")
    fig.tight_layout()
    return fig


def caveats(aggregate: dict[str, Any], study, notes: str | None) -> list[str]:
    """What qualifies the charts, computed from the evidence, plus the campaign notes' caveats."""
    out = []
    if not study.preregistered:
        out.append("Smoke profile on a tiny synthetic model, not the study: the numbers only show the pipeline.")
    if study.protocol.measured_repetitions < 3:
        out.append(f"{study.protocol.measured_repetitions} measured repetition(s) per cell: whiskers and medians "
                   "carry little.")
    missing = sum(len(v) for v in aggregate["missing_cells"].values())
    if missing:
        out.append(f"{missing} backend-cells still missing: gates that need them read INCOMPLETE.")
    if notes and "## Caveats" in notes:
        out += notes_caveats(notes)
    return out


def notes_caveats(notes: str) -> list[str]:
    """The `- ` items of the notes' `## Caveats` section, each whole: an item's wrapped lines (indented,
    as markdown continues a list item) are joined to it; any other line ends it."""
    section = notes.split("## Caveats", 1)[1].split("\n## ", 1)[0]
    items: list[str] = []
    open_item = False
    for line in section.splitlines():
        if line.startswith("- "):
            items.append(line[2:].strip())
            open_item = True
        elif open_item and line[:1] in (" ", "\t") and line.strip():
            items[-1] += " " + line.strip()
        elif line.strip():
            open_item = False
    return items
