"""Figures of the report's folded detail: phase breakdown per backend and refresh sync time. Each returns
None when it would be empty; the report then says in one line what is missing instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_lib.report.summary import BACKEND_ORDER, refresh_reports


def phase_figure(aggregate: dict[str, Any]):
    """Stacked prefill / decode / other seconds (medians) per cell, one panel per backend that exposes phases
    (hf_reference exposes none), at a width a 1280 px page shows without shrinking its labels."""
    import matplotlib.pyplot as plt

    cells = [c for c in aggregate["cells"] if c.get("median_wall_s") is not None
             and all(c.get("phases", {}).get(k, {}).get("status") == "measured" for k in ("prefill_s", "decode_s"))]
    if not cells:
        return None
    backends = [b for b in BACKEND_ORDER if any(c["backend"] == b for c in cells)]
    fig, axes = plt.subplots(len(backends), 1, figsize=(12.6, 2.9 * len(backends)), squeeze=False)
    for ax, backend in zip(axes[:, 0], backends, strict=True):
        mine = sorted((c for c in cells if c["backend"] == backend),
                      key=lambda c: (c["prompt_tokens"], c["response_tokens"], c["samples_per_prompt"], c["sampling"]))
        prefill = [c["phases"]["prefill_s"]["median_s"] for c in mine]
        decode = [c["phases"]["decode_s"]["median_s"] for c in mine]
        other = [max(0.0, c["median_wall_s"] - a - b) for c, a, b in zip(mine, prefill, decode, strict=True)]
        x = range(len(mine))
        ax.bar(x, prefill, label="prefill (= TTFT)", color="#dd6b20")
        ax.bar(x, decode, bottom=prefill, label="decode", color="#2b6cb0")
        ax.bar(x, other, bottom=[a + b for a, b in zip(prefill, decode, strict=True)], label="other (wall - phases)",
               color="#a0aec0")
        ax.set_xticks(list(x), [c["cell_id"] for c in mine], rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"{backend}: phases per cell", fontsize=10)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
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
