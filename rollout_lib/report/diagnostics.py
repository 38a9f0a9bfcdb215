"""The report's "vLLM diagnostics" section: the side-by-side runs of issue 13 (LoRA tax, adapter vs
merged refresh, the PG-k1 precision ladder), read from `outputs/perf/*.json` by their `kind`.

Diagnostics beside the gates, never part of them: each table names its file and SHA-256, so a
reader can re-derive every number from it, but no gate or selection reads these files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rollout_lib.backends.server import root_cause_in
from rollout_lib.core import sha256_file
from rollout_lib.safe_read import read_json

KINDS = ("vllm_inprocess_diagnostic", "vllm_refresh_paths", "vllm_ladder")


def evidence_of_kind(output_dir: Path, patterns: tuple[str, ...], kinds: tuple[str, ...]) -> list[tuple[Path, dict]]:
    """(path, JSON object) of the files under the output tree matching `patterns` (in order, each sorted) whose
    `kind` is one of `kinds`; a file that cannot be read as such (not JSON, a dangling link, too large, a FIFO) is
    left out, never a failed report."""
    out = []
    for pattern in patterns:
        for path in sorted(Path(output_dir).glob(pattern)):
            try:
                report = read_json(path, kind="evidence", root=output_dir)
            except (ValueError, UnicodeDecodeError, OSError):
                continue
            if isinstance(report, dict) and report.get("kind") in kinds:
                out.append((path, report))
    return out


def diagnostic_files(output_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    return evidence_of_kind(output_dir, ("perf/*.json",), KINDS)


def with_hf_cached(report: dict[str, Any]) -> bool:
    """An in-process diagnostic whose sides include hf_cached (issue 43's side by side: speed, not exactness)."""
    return report.get("kind") == "vllm_inprocess_diagnostic" and "hf_cached" in report.get("variants", [])


_STAMP = re.compile(r"(\d{8}T\d{6}Z)")
_GOAL = re.compile(r"^hf_cached_at_least_([0-9.]+)x_inprocess_no_adapter$")


def _stamp(path: Path) -> str:
    """The UTC stamp a run's file name carries (`rollout vllm-diagnostic --out ...-20261206T072815Z.json`), else
    its name: the order in which the side by sides ran."""
    found = _STAMP.search(path.name)
    return found.group(1) if found else path.name


def _lowest(values: list[Any]) -> float | str:
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return min(numbers) if numbers and len(numbers) == len(values) else "not_measured"


def _over_fastest_round(report: dict[str, Any]) -> float | str:
    """The lowest, over the cells, of hf_cached's tok/s over vLLM's fastest round of either engine without LoRA
    (each round a fresh process; vLLM's rates have moved by up to 57 % between the rounds of one run, hf_cached's
    by under 1 %): the ratio that does not rest on one of vLLM's slow processes."""
    engines = [report.get("inprocess", {}).get(engine, {}).get("cells", {})
               for engine in ("no_adapter", "no_adapter_reset_cache")]
    ratios: list[Any] = []
    for row in report.get("rows", []):
        vllm_rates = []
        for cells in engines:
            cell = cells.get(row["cell_id"], {})
            vllm_rates += cell.get("tokens_per_s_by_round", [cell.get("tokens_per_s")])
        vllm_rates = [rate for rate in vllm_rates if isinstance(rate, (int, float)) and rate > 0]
        hf_cached = row.get("hf_cached_tokens_per_s")
        ratios.append(hf_cached / max(vllm_rates) if vllm_rates and isinstance(hf_cached, (int, float))
                      else "not_measured")
    return _lowest(ratios) if ratios else "not_measured"


def side_by_side_summary(found: list[tuple[Path, dict[str, Any]]]) -> tuple[str, Any]:
    """Issue 43's side by sides (hf_cached beside vLLM's in-process engine without LoRA) in one table, oldest
    first, and a sentence on the newest: per run its GPU, its hf_cached engine, its rounds, the lowest ratio over
    its cells against vLLM without LoRA (plain, with the prefix cache reset per call, against vLLM's fastest
    round), and whether the goal its file records (`hf_cached_at_least_<goal>x_...`) held in every reading."""
    import pandas as pd

    runs = sorted(((path, report) for path, report in found if with_hf_cached(report)), key=lambda f: _stamp(f[0]))
    if not runs:
        return "", None
    rows, met = [], []  # met: whether each run's file records its goal held in every reading
    for path, report in runs:
        verdict = report.get("verdict", {})
        goals = [m.group(1) for m in map(_GOAL.match, verdict) if m]
        readings = [v for k, v in verdict.items() if k.startswith("hf_cached_at_least_")]
        options = (report.get("hf_cached_options") or {}).get("engine") or {}
        complete = report.get("complete", True)  # files before session 51 were written once, at the end
        met.append(bool(complete and goals and readings and all(readings)))
        rows.append({"run": path.name, "GPU": (report.get("hf_cached") or {}).get("gpu") or "not_measured",
                     "hf_cached engine": f"candidate ({len(options)} settings)" if options else "the campaign's",
                     "rounds": _rounds(report) + ("" if complete else " (stopped)"),
                     "lowest hf_cached / vLLM without LoRA": _lowest(
                         [r.get("hf_cached_over_inprocess_no_adapter") for r in report.get("rows", [])]),
                     "lowest, vLLM's prefix cache reset per call": _lowest(
                         [r.get("hf_cached_over_inprocess_no_adapter_reset_cache") for r in report.get("rows", [])]),
                     "lowest, against vLLM's fastest round": _over_fastest_round(report),
                     "goal": (f">= {goals[0]}x in every cell: "
                              + ("met in every reading" if met[-1] else "not met" if complete
                                 else "not decided (the run stopped before its last round)")
                              if goals and readings else "not_measured")})
    newest = rows[-1]
    lowest = newest["lowest hf_cached / vLLM without LoRA"]
    fastest = newest["lowest, against vLLM's fastest round"]
    sentence = (f"Newest run, `{newest['run']}` on {newest['GPU']}: hf_cached is at least "
                f"{_num(lowest, 2)}x vLLM's in-process engine without LoRA in every cell"
                f" ({_num(fastest, 2)}x against vLLM's fastest round); {newest['goal']}. "
                f"Runs meeting the goal in every reading: {sum(met)} of {len(rows)}.")
    table = pd.DataFrame([{k: (_num(v, 2) if isinstance(v, float) else v) for k, v in row.items()} for row in rows])
    return sentence, table


def _rounds(report: dict[str, Any]) -> str:
    """The rounds a side by side measured; `k of n` when it stopped before the n it was asked for."""
    done = report.get("rounds", 1)
    requested = report.get("rounds_requested", done)
    return str(done) if done == requested else f"{done} of {requested}"


def _num(value: Any, digits: int = 4) -> str:
    from rollout_lib.report.summary import text

    return f"{value:,.{digits}f}" if isinstance(value, float) else text(value)


def diagnostic_table(path: Path, report: dict[str, Any]):
    """One table per file: a row per cell (LoRA tax) or per setting (ladder, refresh paths)."""
    import pandas as pd

    if report["kind"] == "vllm_inprocess_diagnostic":
        rows = [_inprocess_row(r) for r in report["rows"]]
    else:
        rows = [_rung_row(rung) for rung in report["rungs"]]
    return pd.DataFrame(rows).fillna("—")  # a failed setting has no figures: a dash, never "nan"


def _inprocess_row(r: dict[str, Any]) -> dict[str, str]:
    """One cell of an in-process diagnostic; a side that did not run (`--variants`) has no column."""
    def rate(key: str) -> str:
        return _num(r.get(key), 1)

    row = {"cell": r["cell_id"]}
    if "managed_tokens_per_s" in r:
        row |= {"managed tok/s": rate("managed_tokens_per_s"),
                "managed / in-process": _num(r.get("managed_over_inprocess_adapter"), 3)}
    if "inprocess_adapter_tokens_per_s" in r:
        row["in-process + adapter tok/s"] = rate("inprocess_adapter_tokens_per_s")
    if "inprocess_no_adapter_tokens_per_s" in r:
        row["in-process, no adapter tok/s"] = rate("inprocess_no_adapter_tokens_per_s")
    if "inprocess_no_adapter_reset_cache_tokens_per_s" in r:
        row["in-process, no adapter, prefix cache reset per call tok/s"] = \
            rate("inprocess_no_adapter_reset_cache_tokens_per_s")
    if "lora_tax_fraction" in r:
        row["LoRA tax"] = f"{100 * r['lora_tax_fraction']:.1f}%"
    row |= {f"managed, stream interval {n} tok/s": _num(value, 1)  # older files have no such column
            for n, value in r.get("managed_tokens_per_s_by_stream_interval", {}).items() if n != "1"}
    if "managed_non_streamed_tokens_per_s" in r:
        row |= {"managed, non-streamed tok/s": rate("managed_non_streamed_tokens_per_s"),
                "non-streamed / in-process": _num(r.get("managed_non_streamed_over_inprocess_adapter"), 3)}
    if "hf_cached_tokens_per_s" in r:
        step, floor = r["hf_cached_median_decode_step_s"], r["decode_step_floor"]
        row |= {"hf_cached tok/s": rate("hf_cached_tokens_per_s"),
                "hf_cached / in-process, no LoRA": _num(r.get("hf_cached_over_inprocess_no_adapter"), 2),
                **({"hf_cached / same, prefix cache reset": _num(r["hf_cached_over_inprocess_no_adapter_reset_cache"],
                                                                 2)}
                   if "hf_cached_over_inprocess_no_adapter_reset_cache" in r else {}),
                "hf_cached ms/step": f"{1000 * step:.2f}" if isinstance(step, float) else str(step),
                "floor ms/step (weights + LoRA + KV)": (f"{1000 * floor['step_floor_s']:.3f}"
                                                        if floor.get("status") == "measured" else floor.get("status")),
                "step / floor": _num(r.get("hf_cached_decode_step_over_floor"), 1)}
        for engine, column in (("no_adapter", "hf_cached / no LoRA, each round"),
                               ("no_adapter_reset_cache", "hf_cached / prefix cache reset, each round")):
            if f"hf_cached_over_inprocess_{engine}_by_round" in r:  # `--rounds`: the spread across processes
                row[column] = ", ".join(_num(x, 2) for x in r[f"hf_cached_over_inprocess_{engine}_by_round"])
    return row


def _rung_row(rung: dict[str, Any]) -> dict[str, str]:
    """One setting of a ladder or refresh-paths file as a table row (a failed one: its one-line summary)."""
    if rung.get("status") == "failed":  # older files carry no status: every rung of theirs was measured
        return {"setting": rung["rung"], "about": rung["about"], "max |d logprob|": failure_summary(rung)}
    syncs = rung["sync_s"]
    tf = rung["teacher_forced"]
    return {"setting": rung["rung"], "about": rung["about"],
            "max |d logprob|": _num(rung["max_abs_logprob_diff"]),
            "mean |d logprob|": _num(rung["mean_abs_logprob_diff"], 5),
            "greedy vs actor argmax": f"{tf['argmax_disagreements']}/{tf['positions']} "
                                      f"({tf['beyond_tie_margin']} beyond the tie margin)",
            "sync s (first / max / last)": (f"{syncs[0]:.3f} / {max(syncs):.3f} / {syncs[-1]:.3f}"
                                            if syncs else "—"),
            **_bf16_hash_column(rung),
            "tok/s per cell": ", ".join(f"{c['cell_id']}: {c['tokens_per_s']:.0f}"
                                        for c in rung["cells"] if c.get("tokens_per_s")),
            "attention": rung["attention_backend"],
            "served identity": "policy's own" if all(s["exact"] for s in rung["syncs"])
            else "merged weights' own (not the policy's)"}


def ladder_summary(found: list[tuple[Path, dict[str, Any]]]):
    """The precision ladder in one table when its settings ran in several files (a setting that failed in
    one hold and was rerun, or replaced, in a later one): per setting, its newest measured row, else its
    newest failure, with the file it comes from. Settings in the ladder's order; None without ladder files
    or when there is only one (its own table says it all)."""
    import pandas as pd

    from rollout_lib.checks.vllm_compare import COMPARISONS

    ladders = [(path, report) for path, report in found if report["kind"] == "vllm_ladder"]
    if len(ladders) < 2:
        return None
    newest: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path, report in sorted(ladders, key=lambda item: _file_stamp(item[0])):
        for rung in report["rungs"]:
            measured = rung.get("status", "measured") == "measured"
            earlier = newest.get(rung["rung"])
            if measured or earlier is None or earlier[1].get("status") == "failed":
                newest[rung["rung"]] = (path, rung)
    order = [*COMPARISONS["ladder"], *sorted(set(newest) - set(COMPARISONS["ladder"]))]
    rows = []
    for name in order:
        if name in newest:
            rows.append({**_rung_row(newest[name][1]), "file": newest[name][0].name})
        elif not COMPARISONS["ladder"][name].get("optional"):  # a default setting no file has run yet
            rows.append({"setting": name, "about": COMPARISONS["ladder"][name]["about"],
                         "max |d logprob|": "not_measured: no ladder file has run this setting yet", "file": "—"})
    return pd.DataFrame(rows).fillna("—")


def _file_stamp(path: Path) -> str:
    """A comparison file's UTC stamp (`...-20261201T202456Z[-suffix].json`), for newest-first; the name
    when it has none."""
    found = re.search(r"\d{8}T\d{6}Z", path.name)
    return found.group(0) if found else path.name


def failure_summary(rung: dict[str, Any]) -> str:
    """A failed setting in one line: what failed and, when the server's log named it, the root cause
    (the row's `root_cause`; older files have none, and the file keeps the whole error with the log tail)."""
    error = rung.get("error") or "no error recorded"
    head = re.split(r";\s*(?:root cause:|log tail|no exception line)", error.splitlines()[0], maxsplit=1)[0]
    head = head.rstrip("; ")
    cause = rung.get("root_cause")
    if cause and ":" not in cause and "root cause:\n" in error:
        # a bare exception (lease 10's `AssertionError`, recorded before the raising frame was appended):
        # the same definition read from the context lines that the error keeps above its log tail
        context = error.split("root cause:\n", 1)[1].split("\nlog tail", 1)[0].splitlines()
        found = root_cause_in(context)
        cause = found[1] if found else cause
    if cause:
        return f"failed: {head} — root cause: {cause}"
    if "log tail" in error:
        return f"failed: {head} (its root cause is not in the recorded log tail)"
    return f"failed: {head}"


def _bf16_hash_column(rung: dict[str, Any]) -> dict[str, str]:
    """Adapter syncs from 5f03bf1 on hash the bf16 identity after the timed sync and record its seconds:
    the median sync with and without it, from the same run (older files have no such column)."""
    import statistics

    hashes = [s.get("bf16_identity_hash_s") for s in rung.get("served_policies") or []]
    syncs = rung.get("sync_s") or []
    if not syncs or len(hashes) != len(syncs) or any(h is None for h in hashes):
        return {}
    before = statistics.median([a + b for a, b in zip(syncs, hashes, strict=True)])
    return {"sync s median (with the bf16 hash inside, as before)": f"{statistics.median(syncs):.3f} ({before:.3f})"}


def caption(path: Path, report: dict[str, Any]) -> str:
    titles = {"vllm_inprocess_diagnostic": "LoRA tax and client overhead (managed vs in-process engine)",
              "vllm_refresh_paths": "refresh paths: adapter vs merged weights",
              "vllm_ladder": "precision ladder for PG-k1 (preregistered tolerance "
                             f"{report.get('preregistered_tolerance_logprob_abs')})"}
    title = titles[report["kind"]]
    if "hf_cached" in report.get("variants", []):
        title = ("hf_cached (live LoRA) against vLLM's in-process engine without LoRA, and its decode step "
                 "against the bandwidth floor" if "managed" not in report["variants"] else f"{title}, with hf_cached")
    options = report.get("hf_cached_options") or {}
    if options:  # candidate settings, not the engine a campaign measured: the caption says so
        title += ("; hf_cached with options " + ", ".join(f"`{key}={json.dumps(value, sort_keys=True)}`"
                                                          for key, value in sorted(options.items()))
                  + " (candidates, not the campaign's engine)")
    gpu = (report.get("hf_cached") or {}).get("gpu")
    if isinstance(gpu, str) and gpu:  # these runs came on H100s and H200s: a reader compares within one GPU only
        title += f"; on {gpu}"
    ran = len(report.get("rungs", report.get("rows", [])))
    partial = ("" if report.get("complete", True) else
               f" — **incomplete**: {_rounds(report)} rounds ran before it stopped"
               if report["kind"] == "vllm_inprocess_diagnostic" else
               f" — **incomplete**: {ran} of {len(report.get('rungs_planned', []))} settings ran before it stopped")
    return f"**{title}** — `{path.name}`, sha256 `{sha256_file(path)[:16]}…`{partial}"
