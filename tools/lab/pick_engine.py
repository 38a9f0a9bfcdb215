"""Choose hf_cached's decode-engine settings from decode probes (issue 43: candidates kept by measurement, not
all at once), for the runs that measure the targets and the candidates' conformance.

    python tools/lab/pick_engine.py outputs/perf/decode-expand-attention outputs/perf/decode-flex [DIR ...] \
        [--min-gain-ms 0.02]

Prints the chosen `engine` mapping as one JSON line on stdout (`--hf-cached-option "engine=$(...)"`) and each
candidate's verdict, with its gain per cell, on stderr. Rules:
- A candidate is a probe suffix that sets one of the engine's settings (`compact_qwen3.ENGINE_SETTINGS`; the
  suffixes of `tools/lab/fast_path_probe.py`). Its effect is read wherever a probe has a variant that adds exactly
  that suffix to another variant of the same probe (its parent), both measured: per cell, the parent's ms per
  decode step minus the variant's; for the prefill settings (PREFILL, PREFILL_STEP, or a bundle of them) the
  prefill's ms instead.
- Judged by the comparisons reachable when it is first judged (against the base first, then on top of candidates
  already kept), of those the ones on top of the most kept suffixes: where the engine will run it. Kept when
  each of them gains more than `--min-gain-ms` in every cell both measured and, for a prefill setting, its
  tokens/s is nowhere lower (the wall it moves; until lease 31 the rule asked its decode step to be nowhere
  worse by more than `--min-gain-ms`, which the decode step's draw alone could break). A variant that failed,
  or a candidate measured only on top of candidates not kept, is not kept.
- The probes' base (the suffixes of each folder's first variant, e.g. `+shrinkgemm`, measured against the
  default engine before) is kept; where two folders' bases run two values of one setting, the later folder's (the
  engine a later probe was built on; lease 42's base ran the Triton attention, earlier ones FA3).
- One value per setting: where two values of one setting are kept (e.g. ATTENTION_BACKEND flex and fa3), the
  larger mean gain wins, unless one was kept measured on top of the other (its parent ran the other value, e.g.
  `+tritonattn` on a base with `+fa3`): its gain is over the other, so it replaces it. A value whose requirement
  is not kept is dropped (the engine's SETTING_REQUIRES, e.g. DECODE_PREFIX shared needs ATTENTION_BACKEND fa3 or
  triton), and with it the partners of a bundle it was kept in (the bundle's gain was measured with it).
- A setting whose code runs only in some cells (RUNS_ONLY_IN: DECODE_PREFIX shared, in the cells with n > 1, the
  GRPO groups whose rows share a prompt, and shared_long where those prompts also take 256 columns or more;
  ATTENTION_LAUNCH by_columns, in the cells whose cache is under 256 columns, and by_columns_shared, on top of
  by_columns, in the cells with n > 1 whose cache is 256 columns or more) is judged by its gain where it
  runs, above `--min-gain-ms` in each of those cells; in the others the engine runs its parent's code, so a
  delta there is the draw between two compilations, and it may be no loss above `--min-gain-ms` (lease 42's
  `+again`: 0.014 / 0.001 / 0.003 ms).
  Without this rule such a setting could never be kept: its gain is 0 where it does not run.
- Inductor options (`+pdl`, `+maxat`, `+cdt`, ...) are not engine settings: reported, never chosen (`+combo` is
  one since lease 30: COMBO_KERNELS). `+again` / `+again2` (the same source compiled again) are not candidates:
  a source's compilations are read as one, by their mean per cell (lease 31: one pair of compilations of one
  source differed by up to 0.33 ms per step).
- Bundles: settings that only pay together (lease 31: FA3's graph waits ~0.6 ms for its launch unless the next
  step is enqueued while this one runs, READBACK pipelined) are judged as one candidate where a variant adds two
  or more engine-setting suffixes to a measured ancestor in the same probe, after the single settings, by the
  same rule, and only while none of its parts is kept (a kept part's partners are measured on top of it:
  `+combo+fa3+pipelined` against `+combo` is the bundle fa3+pipelined once combo is kept); a kept bundle sets
  all its settings, unless one of them is already chosen with another value.
- Judged again: a candidate dropped where it was first judged, and measured later on top of more of what is kept
  by then (lease 32: the chunked sampler and the per-part expand, dropped against the base in earlier probes,
  measured on top of combo + fa3 + pipelined), is judged again there, its new verdict naming the old one.
  A kept candidate is not judged again (its gain opened what came after it).
- A variant whose greedy tokens all part from the probe's first variant's within the first two tokens
  (`greedy_against_first_variant`, the worst of its compilations) computes something else: it counts as failed,
  however fast (a broken kernel must not be picked by its speed).
- A failure is decisive only when it is the candidate's latest record (the folders in the order given): a
  variant that failed in an earlier probe and was measured in a later one (a fix between leases) is judged by
  its measurements, the failure named in its verdict.
- One kept candidate at a time (lease 37): of the reachable candidates with the fewest settings, the one gaining
  most is kept first, and the rest are read again on top of it; a bundle sharing a part with what is kept is no
  bundle any more. (Two bundles, the three epilogues + fa3plan and the three epilogues + skinnyodown, each gained
  when judged in one pass; both were kept, and the engine ran fa3plan and skinnyodown together, which no variant
  had measured.)
- A comparison measured again in a later folder (the same suffix on the same parent suffixes) is read from the
  later folder alone: it measured the code the engine runs now (lease 37: the epilogue kernels at new launch
  configurations on the parent lease 36 had measured them on).
Bad input (no probe.json, a folder outside the tree given) is refused in one line before anything is printed.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rollout_lib.backends.compact_qwen3 import (  # noqa: E402
    ENGINE_SETTINGS,
    SETTING_REQUIRES,
    SHARED_PROMPT_MIN_COLUMNS,
    bucket_length,
    check_engine_settings,
    requirement_met,
    requirement_text,
)
from rollout_lib.backends.decode_attention import SHORT_CACHE_COLUMNS  # noqa: E402
from tools.lab.probe_table import read_probe, source_of  # noqa: E402

PREFILL_SETTINGS = ("PREFILL", "PREFILL_STEP")


def _samples_per_prompt(cell: str) -> int | None:
    """n of a cell id such as p128-r64-n4-stochastic (None when the id does not name it)."""
    found = re.search(r"(?:^|-)n(\d+)(?:-|$)", cell)
    return int(found.group(1)) if found else None


def _long_shared_prompt(cell: str) -> bool:
    """DECODE_PREFIX shared_long runs in a cell id such as p512-r256-n4-greedy: n > 1 and a prompt of
    SHARED_PROMPT_MIN_COLUMNS or more."""
    found = re.search(r"(?:^|-)p(\d+)(?:-|$)", cell)
    return ((_samples_per_prompt(cell) or 1) > 1 and found is not None
            and int(found.group(1)) >= SHARED_PROMPT_MIN_COLUMNS)


def _cache_columns(cell: str) -> int | None:
    """The static cache's columns of a cell id such as p128-r64-n4-stochastic (its prompt plus its response,
    rounded as the engine's buckets round them); None when the id does not name both."""
    found = re.search(r"(?:^|-)p(\d+)-r(\d+)(?:-|$)", cell)
    return bucket_length(int(found.group(1)), int(found.group(2))) if found else None


def _short_cache(cell: str) -> bool:
    columns = _cache_columns(cell)
    return columns is not None and columns < SHORT_CACHE_COLUMNS


def _long_shared_cache(cell: str) -> bool:
    """ATTENTION_LAUNCH by_columns_shared runs its own launch (over by_columns') in a cell id such as
    p512-r256-n4-greedy: n > 1 (the shared-prompt kernel) and a cache of SHORT_CACHE_COLUMNS or more."""
    columns = _cache_columns(cell)
    return (_samples_per_prompt(cell) or 1) > 1 and columns is not None and columns >= SHORT_CACHE_COLUMNS


LOGICAL_PROMPTS = 4  # params/rollout-runtime-v2.yaml's logical_prompts: a cell decodes 4 x n rows


def _rows_from_16(cell: str) -> bool:
    """DEPENDENT_LAUNCH epilogues_from_16_rows runs in a cell of 16 rows or more (p128-r64-n4-stochastic: 4 x 4)."""
    return LOGICAL_PROMPTS * (_samples_per_prompt(cell) or 1) >= 16


# a setting whose code runs only in some cells: (which, in words; whether it runs in a cell id); elsewhere the
# engine runs what it runs without the setting (DECODE_PREFIX shared: a batch of distinct prompts decodes per row;
# ATTENTION_LAUNCH by_columns: a cache of SHORT_CACHE_COLUMNS or more runs the fixed launch)
RUNS_ONLY_IN = {("DECODE_PREFIX", "shared"): ("cells with n > 1",
                                              lambda cell: (_samples_per_prompt(cell) or 1) > 1),
                ("DECODE_PREFIX", "shared_long"): (f"cells with n > 1 and prompts of {SHARED_PROMPT_MIN_COLUMNS} "
                                                   "columns or more", _long_shared_prompt),
                ("ATTENTION_LAUNCH", "by_columns"): (f"cells whose cache is under {SHORT_CACHE_COLUMNS} columns",
                                                     _short_cache),
                ("ATTENTION_LAUNCH", "by_columns_shared"): (f"cells with n > 1 whose cache is {SHORT_CACHE_COLUMNS} "
                                                            "columns or more", _long_shared_cache),
                **{("DEPENDENT_LAUNCH", value): ("cells of 16 rows or more (n > 1)", _rows_from_16)
                   for value in ("epilogues_from_16_rows", "epilogues_and_qkv_from_16_rows")}}


def _suffixes() -> dict[str, tuple[str, Any]]:
    from tools.lab.fast_path_probe import SUFFIXES

    return SUFFIXES


def over_compilations(probe: dict[str, Any]) -> dict[str, Any]:
    """The probe with each source's compilations (`X`, `X+again`, `X+again2`) as one variant `X` whose figures are
    their means per cell (a cell only where every compilation measured it); a source any of whose compilations
    failed keeps that failure."""
    merged: dict[str, Any] = {"cells": probe.get("cells", [])}
    members: dict[str, list[dict[str, Any]]] = {}
    for name, entry in probe.items():
        if name != "cells":
            members.setdefault(source_of(name), []).append(entry)
    for source, entries in members.items():
        failed = [e for e in entries if "error" in e or not e.get("cells")]
        if failed:
            merged[source] = failed[0]
            continue
        cells = set.intersection(*(set(e["cells"]) for e in entries))
        merged[source] = {"compilations": len(entries), "cells": {
            c: {key: _over(key, [e["cells"][c][key] for e in entries]) for key in entries[0]["cells"][c]
                if all(key in e["cells"][c] for e in entries)} for c in sorted(cells)}}
    return merged


def _over(key: str, values: list[Any]) -> Any:
    """One figure over a source's compilations: the mean of a number; of the greedy tokens' agreement with the
    probe's first variant, the compilation that parted soonest (a broken compilation is not averaged away)."""
    if key == AGREEMENT:
        return min(values, key=lambda v: (v["identical_rows"], v["mean_first_difference"]))
    return statistics.mean(values)


AGREEMENT = "greedy_against_first_variant"  # tools/lab/fast_path_probe.py: a greedy cell's tokens vs its 1st variant
# a variant whose greedy rows all part from the probe's first variant's this soon computes something else (bf16
# candidates part at near-ties, tens of tokens in): dropped whatever its speed
PARTS_AT_ONCE_TOKENS = 2.0


def parts_at_once(cells: dict[str, Any]) -> str | None:
    """The first greedy cell where every row's tokens parted from the first variant's within PARTS_AT_ONCE_TOKENS
    (the cell and its figures), or None."""
    for cell, figures in sorted(cells.items()):
        agreement = figures.get(AGREEMENT)
        if agreement and agreement["rows"] and agreement["identical_rows"] == 0 \
                and agreement["mean_first_difference"] < PARTS_AT_ONCE_TOKENS:
            return (f"{cell}: 0 of {agreement['rows']} rows identical to the first variant's, the first "
                    f"difference at token {agreement['mean_first_difference']:.1f} on average")
    return None


def comparisons(folder: Path, probe: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The folder's base suffixes (in the base variant's order: the probe sets them in turn, so of two that set
    one engine setting the later wins), and one record per (variant, its parent, the suffix between them); a
    source compiled more than once is read by the mean of its compilations (`over_compilations`)."""
    probe = over_compilations(probe)
    variants = [name for name in probe if name != "cells"]
    parts = {name: name.split("+") for name in variants}
    base = parts[variants[0]][1:]
    by_parts = {(p[0], frozenset(p[1:])): name for name, p in parts.items()}
    found = []
    for name in variants:
        head, suffixes = parts[name][0], parts[name][1:]
        pairs = []
        for suffix in suffixes:
            parent = by_parts.get((head, frozenset(s for s in suffixes if s != suffix)))
            if parent is not None and suffixes.count(suffix) == 1:
                pairs.append((parent, suffix))
        pairs += _bundles(name, parts, by_parts)
        for parent, suffix in pairs:
            child, before = probe[name], probe[parent]
            record = {"folder": str(folder), "variant": name, "parent": parent, "suffix": suffix,
                      "parent_suffixes": set(parts[parent][1:])}
            if "error" in child or "error" in before or not child.get("cells") or not before.get("cells"):
                record["failed"] = child.get("error") or before.get("error") or "not measured"
            elif parted := parts_at_once(child["cells"]):
                record["failed"] = f"its greedy tokens part at once ({parted})"
            else:
                cells = [c for c in child["cells"] if c in before["cells"]]
                record["step_gain_ms"] = {c: before["cells"][c]["ms_per_decode_step"]
                                          - child["cells"][c]["ms_per_decode_step"] for c in cells}
                record["prefill_gain_ms"] = {c: before["cells"][c]["ms_prefill"] - child["cells"][c]["ms_prefill"]
                                             for c in cells if "ms_prefill" in before["cells"][c]
                                             and "ms_prefill" in child["cells"][c]}
                record["rate_ratio"] = {c: child["cells"][c]["tokens_per_s"] / before["cells"][c]["tokens_per_s"]
                                        for c in cells if before["cells"][c].get("tokens_per_s")
                                        and "tokens_per_s" in child["cells"][c]}
            found.append(record)
    return base, found


def _bundles(name: str, parts: dict[str, list[str]], by_parts: dict[tuple[str, frozenset[str]], str]
             ) -> list[tuple[str, str]]:
    """(ancestor, "a+b") for each measured ancestor of `name` (same head, a subset of its suffixes) two or more
    suffixes away."""
    head, mine = parts[name][0], frozenset(parts[name][1:])
    found = []
    for (other_head, shared), parent in by_parts.items():
        if other_head == head and shared < mine and len(mine - shared) >= 2:
            found.append((parent, "+".join(s for s in parts[name][1:] if s not in shared)))
    return found


def _where_it_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The comparisons on top of the most kept suffixes among `records` (all of them where they tie): the engine
    will run a candidate beside everything kept before it, so that is where its gain is read."""
    most = max((len(r["parent_suffixes"]) for r in records), default=0)
    return [r for r in records if len(r["parent_suffixes"]) == most]


def _verdict(suffix: str, name: str, value: str, mine: list[dict[str, Any]], min_gain_ms: float
             ) -> tuple[float | None, str]:
    """(mean gain or None, the verdict line) of one candidate over its comparisons `mine` (in the folders'
    order: a failure followed by a measurement of the same variant is superseded)."""
    failed = [r for r in mine if "failed" in r]
    if failed and "failed" in mine[-1]:
        return None, (f"+{suffix} ({name} {value}): dropped, {failed[-1]['variant']} failed: "
                      f"{' '.join(str(failed[-1]['failed']).split())[:160]}")
    if failed:
        mine = [r for r in mine if "failed" not in r]
        earlier = f"; it failed in {failed[0]['folder']} before ({' '.join(str(failed[0]['failed']).split())[:60]})"
    else:
        earlier = ""
    prefill = all(part in PREFILL_SETTINGS for part in name.split("+"))  # a setting, or a bundle of them
    key = "prefill_gain_ms" if prefill else "step_gain_ms"
    what = "prefill" if key == "prefill_gain_ms" else "decode step"
    per_cell = [(r, cell, gain) for r in mine for cell, gain in r[key].items()]
    shown = "; ".join(f"{r['variant']} vs {r['parent']}: " + ", ".join(f"{c} {g:+.3f}" for c, g in r[key].items())
                      for r in mine)
    runs_only_in = None if prefill else RUNS_ONLY_IN.get((name, value))
    elsewhere: list[tuple[dict[str, Any], str, float]] = []
    where_said = ""
    if runs_only_in is not None:  # judged where it runs; elsewhere its parent's code runs: the draw, no loss
        where, runs = runs_only_in
        per_cell, elsewhere = ([x for x in per_cell if runs(x[1])], [x for x in per_cell if not runs(x[1])])
        where_said = f" where it runs ({where})"
    if not per_cell or any(g <= min_gain_ms for _, _, g in per_cell):
        return None, (f"+{suffix} ({name} {value}): dropped, {what} gains not above {min_gain_ms} ms in every cell"
                      f"{where_said} (ms: {shown or 'no cell measured'}){earlier}")
    if any(g <= -min_gain_ms for _, _, g in elsewhere):
        return None, (f"+{suffix} ({name} {value}): dropped, a loss of {min_gain_ms} ms or more in a cell where it "
                      f"does not run (ms: {shown}){earlier}")
    slower = [(c, x) for r in mine for c, x in r.get("rate_ratio", {}).items() if x < 1.0]
    if prefill and slower:  # the wall it moves: tokens/s, the decode steps included (their draw too)
        return None, (f"+{suffix} ({name} {value}): dropped, its tokens/s fell "
                      f"({slower[0][0]} x{slower[0][1]:.3f}){earlier}")
    return statistics.mean(g for _, _, g in per_cell), (f"+{suffix} ({name} {value}): kept, {what} gains"
                                                        f"{where_said} (ms: {shown}){earlier}")


def _latest_measurements(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`records` (in the folders' order) less each measurement that a later folder measured again: the same suffix
    on the same parent suffixes. The later probe measured the code the engine runs now (lease 37: the three
    epilogue kernels at new launch configurations, -0.03 to -0.14 ms against lease 36's +0.03 to -0.07 on the
    same parent). Failures stay: `_verdict` decides whether a later measurement supersedes them."""
    last = {}
    for record in records:
        if "failed" not in record:
            last[(record["suffix"], frozenset(record["parent_suffixes"]))] = record["folder"]
    return [r for r in records if "failed" in r
            or last[(r["suffix"], frozenset(r["parent_suffixes"]))] == r["folder"]]


def pick(folders: list[Path], min_gain_ms: float, skip_missing: bool = False) -> tuple[dict[str, str], list[str]]:
    """The chosen engine mapping and one line of verdict per candidate. A candidate is judged by the comparisons
    reachable when it is first judged: against the base first, then on top of candidates already kept."""
    suffixes = _suffixes()
    setting_of = {s: (name, value) for s, (name, value) in suffixes.items() if name in ENGINE_SETTINGS}
    bases: set[str] = set()
    base_at: dict[str, int] = {}  # a base suffix -> the latest folder (its index) whose base runs it
    overridden: dict[str, str] = {}  # a base suffix -> the later suffix of the latest base with it that overrides it
    records: list[dict[str, Any]] = []
    lines: list[str] = []
    for index, folder in enumerate(folders):
        if skip_missing and not (folder / "probe.json").exists():
            lines.append(f"{folder}: no probe.json, left out (--skip-missing)")
            continue
        base, found = comparisons(folder, read_probe(folder))
        bases.update(base)
        base_at.update(dict.fromkeys(base, index))
        records += found
        # a base part a later part of the same base overrides (lease 45's kept +sharedlaunch became the base of
        # lease 46's probes after +attnlaunch: both ATTENTION_LAUNCH, the later one the value the engine ran)
        for at, part in enumerate(base):
            later = [m for m in base[at + 1:] if m in setting_of and part in setting_of
                     and setting_of[m][0] == setting_of[part][0]]
            if later:
                overridden[part] = later[-1]
            else:
                overridden.pop(part, None)
    records = _latest_measurements(records)
    singles = sorted({r["suffix"] for r in records if "+" not in r["suffix"]} - bases)
    for suffix in [s for s in singles if s not in setting_of]:
        lines.append(f"+{suffix}: not an engine setting (an inductor or probe option): reported, not chosen")
    undecided = [s for s in singles if s in setting_of]
    gains: dict[str, float] = {}
    kept_parts = set(bases)  # every suffix of the base and of the candidates kept so far (a bundle's too)
    dropped_at: dict[str, tuple[int, int, tuple[str, str]]] = {}  # suffix -> (kept suffixes under it, line, setting)

    def reachable(suffix: str) -> list[dict[str, Any]]:
        return _where_it_runs([r for r in records if r["suffix"] == suffix and r["parent_suffixes"] <= kept_parts])

    replaced: dict[str, str] = dict(overridden)  # a kept part -> what was kept on top of it with another value of
    # its setting (a candidate, or a later part of a base)

    def keep(suffix: str, gain: float, where: list[dict[str, Any]]) -> None:
        gains[suffix] = gain
        names = {setting_of[m][0] for m in suffix.split("+") if m in setting_of}
        for part in set().union(*(r["parent_suffixes"] for r in where)):  # what it was measured on top of
            if part in setting_of and setting_of[part][0] in names and part not in suffix.split("+"):
                replaced[part] = suffix
        kept_parts.update(suffix.split("+"))

    def judge(pending: list[str], settings_of: dict[str, tuple[str, str]]) -> bool:
        """Judge what has become reachable, the fewest settings first, one kept candidate at a time (the one
        gaining most): what is judged after it is read on top of it where a probe measured that, and a bundle
        sharing a part with it is no bundle any more (lease 37: two bundles judged in one pass, each with the
        three epilogues plus one more setting, were both kept, and the engine ran the two extra settings
        together, a combination no probe had measured). True when something was judged."""
        judged = False
        while True:
            for suffix in [s for s in pending if "+" not in s and s in kept_parts]:
                lines.append(f"+{suffix} ({' '.join(settings_of[suffix])}): kept in a bundle kept before it, not "
                             "judged alone")
            pending[:] = [s for s in pending if not set(s.split("+")) & kept_parts]
            ready = {s: found for s in pending if (found := reachable(s))}
            if not ready:
                return judged
            fewest = min(s.count("+") for s in ready)
            verdicts = {s: _verdict(s, *settings_of[s], mine, min_gain_ms)
                        for s, mine in ready.items() if s.count("+") == fewest}
            gaining = [s for s, (gain, _) in verdicts.items() if gain is not None]
            if gaining:  # the largest gain is kept; the others are judged again on top of it
                best = max(gaining, key=lambda s: verdicts[s][0])
                verdicts = {best: verdicts[best]}
            for suffix, (gain, line) in verdicts.items():
                lines.append(line)
                if gain is not None:
                    keep(suffix, gain, ready[suffix])
                else:
                    dropped_at[suffix] = (len(ready[suffix][0]["parent_suffixes"]), len(lines) - 1,
                                          settings_of[suffix])
                pending.remove(suffix)
                judged = True

    def judge_again() -> bool:
        """A dropped candidate measured later on top of more of what is now kept (a later probe's variant on the
        engine kept since) is judged again there, where the engine will run it: its new verdict replaces the
        old line, which it names. True when one was kept."""
        for suffix, (depth, at, setting) in sorted(dropped_at.items()):
            if set(suffix.split("+")) <= kept_parts or ("+" in suffix and set(suffix.split("+")) & kept_parts):
                continue  # kept since as part of a bundle; a bundle with a part kept since is no bundle any more
            mine = reachable(suffix)
            if not mine or len(mine[0]["parent_suffixes"]) <= depth:
                continue
            gain, line = _verdict(suffix, *setting, mine, min_gain_ms)
            was = lines[at].split(": ", 1)[1].split(" (ms:")[0]
            lines[at] = f"{line} (judged again on top of more kept settings; before: {was})"
            dropped_at[suffix] = (len(mine[0]["parent_suffixes"]), at, setting)
            if gain is not None:
                del dropped_at[suffix]
                keep(suffix, gain, mine)
                return True
        return False

    bundle_of = {}
    for suffix in sorted({r["suffix"] for r in records if "+" in r["suffix"]}):
        members = suffix.split("+")
        named = [setting_of[m] for m in members if m in setting_of]
        if len(named) == len(members) and len({n for n, _ in named}) == len(named):
            bundle_of[suffix] = ("+".join(n for n, _ in named), "+".join(v for _, v in named))
    bundles = sorted(bundle_of)
    while True:  # single settings first, then bundles; what a kept bundle makes reachable is judged after it
        judge(undecided, setting_of)
        # a bundle with a part already kept is not one: its other parts are measured on top of that part
        bundles = [b for b in bundles if not set(b.split("+")) & kept_parts]
        if not judge(bundles, bundle_of) and not judge_again():
            break
    for suffix in undecided:
        lines.append(f"+{suffix} ({' '.join(setting_of[suffix])}): dropped, measured only on top of "
                     "candidates not kept")
    for suffix in bundles:
        lines.append(f"+{suffix} ({' '.join(bundle_of[suffix])}): dropped, measured only on top of "
                     "candidates not kept")
    chosen: dict[str, tuple[str, float, str]] = {}  # setting -> (value, the gain it was kept for, its suffix)
    for part, by in sorted(replaced.items()):
        named = " ".join(bundle_of.get(by) or setting_of[by])
        lines.append(f"{' '.join(setting_of[part])}: replaced by +{by} ({named}), kept measured on top of it")
    # the bases first, a later probe's before an earlier one's (two bases may run two values of one setting: lease
    # 42's ran the Triton attention where earlier ones ran FA3, and the set's order, which the hash seed draws,
    # chose between them), then the kept candidates by gain; ties by name, so the order is the same in every run
    for suffix in sorted(bases | set(gains), key=lambda s: (-gains.get(s, float("inf")), -base_at.get(s, -1), s)):
        members = [m for m in suffix.split("+") if m in setting_of and m not in replaced]
        if "+" not in suffix and suffix not in setting_of:
            continue
        clash = [(setting_of[m][0], *chosen[setting_of[m][0]]) for m in members
                 if setting_of[m][0] in chosen and chosen[setting_of[m][0]][0] != setting_of[m][1]]
        if clash:
            name, value, _, by = clash[0]
            why = ": a later probe's base runs it" if suffix in bases and by in bases else " gains more"
            lines.append(f"+{suffix} ({' '.join(bundle_of.get(suffix) or setting_of[suffix])}): dropped, "
                         f"{name} {value}{why}")
            continue
        for m in members:
            name, value = setting_of[m]
            chosen.setdefault(name, (value, gains.get(suffix, float("inf")), suffix))
    _drop_unmet_requirements(chosen, lines)
    engine = {name: value for name, (value, _, _) in sorted(chosen.items())}
    check_engine_settings(engine)
    return engine, lines


def _drop_unmet_requirements(chosen: dict[str, tuple[str, float, str]], lines: list[str]) -> None:
    """Drop each chosen value whose requirement is not chosen (SETTING_REQUIRES), and with it the partners of the
    bundle it was kept in: the bundle's gain was measured with it, so a partner kept only for that gain is
    unmeasured without it (lease 41: +fa3plan+skinnyodown kept on FA3, FA3 replaced by +tritonattn, the plan
    dropped, and the skinny o/down GEMM, dropped when judged alone, stayed in the engine). Repeated until nothing
    more is dropped (a partner's going may leave another value's requirement unmet)."""
    while True:
        unmet = [(name, value, needs, needed) for (name, value), (needs, needed, _) in SETTING_REQUIRES.items()
                 if chosen.get(name, (None,))[0] == value
                 and not requirement_met(chosen.get(needs, (None,))[0], needed)]
        if not unmet:
            return
        for name, value, needs, needed in unmet:
            if chosen.get(name, (None,))[0] != value:
                continue  # dropped above as a partner
            source = chosen.pop(name)[2]
            lines.append(f"{name} {value}: dropped, it needs {needs} {requirement_text(needed)}, which is not "
                         "chosen")
            for other, (other_value, _, other_source) in sorted(chosen.items()):
                if "+" in source and other_source == source:
                    del chosen[other]
                    lines.append(f"{other} {other_value}: dropped, kept only in the bundle +{source}, measured "
                                 f"with {name} {value}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="decode probe folders (each with a probe.json)")
    parser.add_argument("--skip-missing", action="store_true",
                        help="leave out a folder without probe.json (a probe that did not run), saying so")
    parser.add_argument("--min-gain-ms", type=float, default=0.02,
                        help="a candidate must gain more than this in every compared cell (default 0.02 ms)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.min_gain_ms < 0:
        parser.error(f"--min-gain-ms: {args.min_gain_ms} is not allowed; allowed: a number >= 0")
    try:
        engine, lines = pick(args.folders, args.min_gain_ms, args.skip_missing)
    except ValueError as exc:
        parser.error(str(exc))
    for line in lines:
        print(line, file=sys.stderr)
    print(json.dumps(engine, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
