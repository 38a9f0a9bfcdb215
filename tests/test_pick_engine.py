"""tools/lab/pick_engine.py: the decode engine's settings kept by measurement from hand-made probe folders whose
answer is known (each gain below is set by hand), and its refusals."""

from __future__ import annotations

import json

import pytest

from tools.lab.pick_engine import main, pick

CELLS = ("p128-r64-n1-greedy", "p128-r64-n4-stochastic")
BASE = "inductor+shrinkgemm"


def _probe(folder, variants: dict[str, object]):
    """`variants`: name -> (ms per step per cell, ms prefill per cell[, tokens/s per cell]), or an error string."""
    folder.mkdir()
    probe = {"cells": list(CELLS)}
    for name, figures in variants.items():
        if isinstance(figures, str):
            probe[name] = {"error": figures}
            continue
        steps, prefills, rates = (*figures, (1000.0,) * len(CELLS))[:3]
        probe[name] = {"cells": {c: {"ms_per_decode_step": s, "tokens_per_s": r, "ms_prefill": p}
                                 for c, s, p, r in zip(CELLS, steps, prefills, rates, strict=True)}}
    (folder / "probe.json").write_text(json.dumps(probe))
    return folder


@pytest.fixture
def folders(tmp_path):
    first = _probe(tmp_path / "decode-expand-attention", {
        BASE: ((2.10, 2.40), (40.0, 60.0)),
        f"{BASE}+expandgemm": ((2.05, 2.25), (40.0, 60.0)),   # gains 0.05 / 0.15: kept
        f"{BASE}+sdpaeff": ((2.00, 2.45), (40.0, 60.0)),      # gains at 4 rows, loses at 16: dropped
        f"{BASE}+pdl": ((1.90, 2.20), (40.0, 60.0)),          # an inductor option: never chosen
        f"{BASE}+sharedprefill": ((2.11, 2.40), (40.0, 30.0)),  # prefill 0 / 30 ms: not in every cell
        f"{BASE}+prefillgraph": ((2.10, 2.40), (8.0, 15.0)),    # prefill gains, step unchanged: kept
        f"{BASE}+sharedprefill+prefillgraph": ((2.10, 2.40), (8.0, 9.0))})
    second = _probe(tmp_path / "decode-fa3", {
        BASE: ((2.12, 2.41), (40.0, 60.0)),
        f"{BASE}+flex": ((2.00, 2.30), (40.0, 60.0)),         # gains 0.12 / 0.11
        f"{BASE}+fa3": ((1.90, 2.10), (40.0, 60.0)),          # gains 0.22 / 0.31: wins ATTENTION_BACKEND
        f"{BASE}+fa3+sharedprefix": ((1.95, 2.00), (40.0, 60.0)),  # -0.05 (n1) / +0.10 against +fa3: dropped
        f"{BASE}+chunkedsampler": "RuntimeError: out of resources",
        f"{BASE}+maxat": "TimeoutError"})
    return [first, second]


def test_each_candidate_is_kept_or_dropped_by_its_own_measured_gain(folders):
    engine, lines = pick(folders, 0.02)
    assert engine == {"ATTENTION_BACKEND": "fa3", "LORA_EXPAND": "gemm", "LORA_SHRINK": "in_base_gemm",
                      "PREFILL_STEP": "compiled_graph"}
    said = "\n".join(lines)
    assert "+sdpaeff (ATTENTION_BACKEND efficient): dropped, decode step gains not above 0.02 ms" in said
    assert "+pdl: not an engine setting" in said and "+maxat: not an engine setting" in said
    assert "+sharedprefill (PREFILL shared_prompts): dropped, prefill gains not above" in said
    assert "+prefillgraph (PREFILL_STEP compiled_graph): kept, prefill gains" in said
    assert "+flex (ATTENTION_BACKEND flex): dropped, ATTENTION_BACKEND fa3 gains more" in said
    assert ("+sharedprefix (DECODE_PREFIX shared): dropped, a loss of 0.02 ms or more in a cell where it does not "
            "run") in said
    assert "+chunkedsampler (SAMPLER chunked): dropped, inductor+shrinkgemm+chunkedsampler failed: RuntimeError" in said


@pytest.mark.parametrize(("n1_step", "n4_step", "kept", "said"), [
    (2.01, 1.80, True, "kept, decode step gains where it runs (cells with n > 1) (ms: "),   # n1: the draw, -0.01
    (1.95, 1.80, True, "kept, decode step gains where it runs"),                            # n1 +0.05: the draw too
    (2.03, 1.80, False, "dropped, a loss of 0.02 ms or more in a cell where it does not run"),
    (2.00, 2.09, False, "dropped, decode step gains not above 0.02 ms in every cell where it runs (cells with "
                        "n > 1)"),
])
def test_a_setting_that_runs_only_in_some_cells_is_judged_where_it_runs(tmp_path, n1_step, n4_step, kept, said):
    """DECODE_PREFIX shared runs only where a batch's rows share prompts (n > 1): its gain is read in those cells,
    and in the n1 cell, where the engine runs its parent's code, it may be no loss of 0.02 ms or more (the draw
    between two compilations). Under the every-cell rule it could never be kept (0 gain where it does not run)."""
    folder = _probe(tmp_path / "p", {
        BASE: ((2.1, 2.4), (40.0, 60.0)),
        f"{BASE}+tritonattn": ((2.0, 2.1), (40.0, 60.0)),
        f"{BASE}+tritonattn+sharedprefix": ((n1_step, n4_step), (40.0, 60.0))})
    engine, lines = pick([folder], 0.02)
    assert (engine.get("DECODE_PREFIX") == "shared") is kept
    assert engine["ATTENTION_BACKEND"] == "triton"
    assert any(line.startswith(f"+sharedprefix (DECODE_PREFIX shared): {said}") for line in lines), lines


def test_the_cells_a_setting_runs_in_are_read_from_the_cell_ids():
    from rollout_lib.backends import decode_attention
    from rollout_lib.backends.compact_qwen3 import shared_prompt_group
    from tools.lab.pick_engine import RUNS_ONLY_IN, _cache_columns, _samples_per_prompt

    _, runs = RUNS_ONLY_IN[("DECODE_PREFIX", "shared")]
    assert [_samples_per_prompt(c) for c in ("p128-r64-n4-stochastic", "p512-r512-n1-greedy", "n16", "p16-r8")] \
        == [4, 1, 16, None]
    assert runs("p512-r256-n4-greedy") and not runs("p128-r64-n1-greedy") and not runs("p16-r8")
    # shared_long: n > 1 and prompts of 256 columns or more
    _, runs = RUNS_ONLY_IN[("DECODE_PREFIX", "shared_long")]
    assert [runs(c) for c in ("p512-r256-n4-greedy", "p256-r64-n2-greedy", "p128-r64-n4-stochastic",
                              "p512-r256-n1-stochastic", "r256-n4")] == [True, True, False, False, False]
    # ... which is where the engine's own decision reads a block's prompt once (4 prompts of p tokens, n rows each)
    for prompt, n in ((512, 4), (256, 2), (128, 4), (512, 1), (255, 4)):
        blocks = [(row // n,) * prompt for row in range(4 * n)]
        assert runs(f"p{prompt}-r64-n{n}-greedy") == (shared_prompt_group("shared_long", "triton", blocks, prompt) > 1)
    # by_columns runs its own launch only where the engine's cache is short (the bucket: p + r rounded up to 64)
    _, runs = RUNS_ONLY_IN[("ATTENTION_LAUNCH", "by_columns")]
    assert [_cache_columns(c) for c in ("p128-r64-n1-greedy", "p128-r100-n4-greedy", "p128-r256-n4-stochastic",
                                        "p512-r256-n4-greedy", "n4-greedy")] == [192, 256, 384, 768, None]
    assert runs("p128-r64-n4-stochastic") and not runs("p128-r100-n1-greedy") and not runs("p512-r256-n4-greedy")
    assert [decode_attention.launch_for(columns) != decode_attention.DEFAULT for columns in (192, 256, 384, 768)] \
        == [runs(cell) for cell in ("p128-r64-n1-greedy", "p128-r100-n4-greedy", "p128-r256-n4-stochastic",
                                    "p512-r256-n4-greedy")]
    # by_columns_shared differs from by_columns only in the shared kernel's launch (n > 1) over a long cache
    _, runs = RUNS_ONLY_IN[("ATTENTION_LAUNCH", "by_columns_shared")]
    cells = ("p128-r64-n4-stochastic", "p128-r100-n4-greedy", "p512-r256-n4-greedy", "p512-r256-n1-stochastic")
    assert [runs(c) for c in cells] == [False, True, True, False]
    assert [(_samples_per_prompt(c) or 1) > 1 and decode_attention.shared_launch_for(_cache_columns(c))
            != decode_attention.launch_for(_cache_columns(c)) for c in cells] == [runs(c) for c in cells]
    # epilogues_from_16_rows: the engine's rows threshold, against a cell's rows (the study's prompts x n)
    from rollout_lib.backends.compact_qwen3 import PDL_FROM_ROWS
    from rollout_lib.study.prereg import load
    from tools.lab.pick_engine import LOGICAL_PROMPTS

    assert load().workload.logical_prompts == LOGICAL_PROMPTS
    cells = ("p128-r64-n1-greedy", "p128-r64-n4-stochastic", "p512-r512-n4-greedy", "p512-r256-n1-stochastic")
    for value in ("epilogues_from_16_rows", "epilogues_and_qkv_from_16_rows"):
        _, runs = RUNS_ONLY_IN[("DEPENDENT_LAUNCH", value)]
        fewest = min(rows for rows in PDL_FROM_ROWS[value] if rows)
        assert [runs(c) for c in cells] == [LOGICAL_PROMPTS * _samples_per_prompt(c) >= fewest for c in cells] \
            == [False, True, True, False]


def _three_cell_probe(folder, steps: dict):
    """A probe.json in `folder` over the probes' three cells (p128-r64 at 4 and 16 rows, p512-r256 at 16): per
    variant its ms per decode step in each, the other figures alike."""
    cells = ("p128-r64-n1-greedy", "p128-r64-n4-stochastic", "p512-r256-n4-greedy")
    figures = {name: {c: {"ms_per_decode_step": s, "tokens_per_s": 1000.0, "ms_prefill": 40.0}
                      for c, s in zip(cells, row, strict=True)} for name, row in steps.items()}
    folder.mkdir()
    (folder / "probe.json").write_text(json.dumps({"cells": list(cells), **{name: {"cells": by_cell}
                                                                            for name, by_cell in figures.items()}}))
    return folder


def test_the_launch_chosen_by_the_cache_length_is_judged_in_the_short_caches_cells(tmp_path):
    """Lease 42's shape: +attnlaunch -0.046 / -0.048 in the p128-r64 cells (192 columns), -0.010 at p512 (768,
    where it runs the fixed launch now): kept by the p128 cells, the p512 cell's delta read as the draw."""
    folder = _three_cell_probe(tmp_path / "p", {BASE: (2.10, 2.40, 2.70), f"{BASE}+tritonattn": (1.57, 1.75, 2.03),
                                                f"{BASE}+tritonattn+attnlaunch": (1.524, 1.702, 2.020)})
    engine, lines = pick([folder], 0.02)
    assert engine["ATTENTION_LAUNCH"] == "by_columns" and engine["ATTENTION_BACKEND"] == "triton"
    assert any(line.startswith("+attnlaunch (ATTENTION_LAUNCH by_columns): kept, decode step gains where it runs "
                               "(cells whose cache is under 256 columns)") for line in lines), lines


def test_the_shared_prompt_read_once_from_long_prompts_is_judged_in_their_cells(tmp_path):
    """Lease 43's shape (H200): +sharedprefix +0.009 / -0.007 / -0.111 ms against Q: dropped (p128-r64-n4, where it
    runs, gains under 0.02); +sharedlong, the same kernel from 256 prompt columns, runs only at p512-r256-n4 and is
    kept by it, the p128 cells' deltas read as the draw. Both are DECODE_PREFIX values: the kept one is chosen."""
    folder = _three_cell_probe(tmp_path / "p", {BASE: (2.10, 2.40, 2.70),
                                                f"{BASE}+tritonattn": (1.484, 1.601, 1.853),
                                                f"{BASE}+tritonattn+sharedprefix": (1.492, 1.595, 1.742),
                                                f"{BASE}+tritonattn+sharedlong": (1.490, 1.608, 1.745)})
    engine, lines = pick([folder], 0.02)
    assert engine["DECODE_PREFIX"] == "shared_long" and engine["ATTENTION_BACKEND"] == "triton"
    assert any(line.startswith("+sharedlong (DECODE_PREFIX shared_long): kept, decode step gains where it runs "
                               "(cells with n > 1 and prompts of 256 columns or more)") for line in lines), lines
    assert any(line.startswith("+sharedprefix (DECODE_PREFIX shared): dropped, decode step gains not above 0.02 ms")
               for line in lines), lines


def test_the_shared_kernels_own_launch_replaces_by_columns_where_it_runs(tmp_path):
    """+sharedlaunch (ATTENTION_LAUNCH by_columns_shared) measured on top of +attnlaunch (by_columns) and
    +sharedlong: it gains only at p512-r256-n4, the one cell where the shared kernel runs over a long cache, and
    is kept there, replacing by_columns (its parent's value of the same setting); the p128 cells read as the draw."""
    chain = f"{BASE}+tritonattn+attnlaunch+sharedlong"
    folder = _three_cell_probe(tmp_path / "p", {BASE: (2.10, 2.40, 2.70),
                                                f"{BASE}+tritonattn": (1.57, 1.75, 2.03),
                                                f"{BASE}+tritonattn+attnlaunch": (1.524, 1.702, 2.020),
                                                chain: (1.530, 1.700, 1.885),
                                                f"{chain}+sharedlaunch": (1.534, 1.697, 1.845)})
    engine, lines = pick([folder], 0.02)
    assert engine["ATTENTION_LAUNCH"] == "by_columns_shared" and engine["DECODE_PREFIX"] == "shared_long"
    assert any(line.startswith("+sharedlaunch (ATTENTION_LAUNCH by_columns_shared): kept, decode step gains where "
                               "it runs (cells with n > 1 whose cache is 256 columns or more)")
               for line in lines), lines


def test_a_base_part_that_a_later_part_of_its_setting_overrides_is_replaced_by_it(tmp_path):
    """Lease 46's probes: +sharedlaunch, kept in lease 45's probe, is part of the next base after +attnlaunch (both
    ATTENTION_LAUNCH; the probe sets them in turn, so the engine measured ran by_columns_shared). Both are base parts
    of the latest probe, and the name's order, not the alphabet, decides between them: by_columns_shared stays."""
    chain = f"{BASE}+oepilogue+tritonattn+attnlaunch+sharedlong"
    kept_there = _three_cell_probe(tmp_path / "s", {chain: (1.530, 1.700, 1.885),
                                                    f"{chain}+sharedlaunch": (1.534, 1.697, 1.845)})
    later = _three_cell_probe(tmp_path / "t", {f"{chain}+sharedlaunch": (1.53, 1.70, 1.85),
                                               f"{chain}+sharedlaunch+pdl16": (1.53, 1.64, 1.78)})
    engine, lines = pick([kept_there, later], 0.02)
    assert engine["ATTENTION_LAUNCH"] == "by_columns_shared", lines
    assert engine["DEPENDENT_LAUNCH"] == "epilogues_from_16_rows", lines
    assert ("ATTENTION_LAUNCH by_columns: replaced by +sharedlaunch (ATTENTION_LAUNCH by_columns_shared), kept "
            "measured on top of it") in lines
    # without the probe that kept it, the later base alone says the same
    assert pick([later], 0.02)[0]["ATTENTION_LAUNCH"] == "by_columns_shared"


def test_a_candidate_measured_on_top_of_one_not_kept_is_not_kept(tmp_path):
    folder = _probe(tmp_path / "p", {
        BASE: ((2.1, 2.4), (40.0, 60.0)),
        f"{BASE}+fa3": ((2.2, 2.5), (40.0, 60.0)),            # slower: dropped
        f"{BASE}+fa3+sharedprefix": ((2.15, 2.3), (40.0, 60.0))})  # gains against +fa3, not as a pair: dropped
    engine, lines = pick([folder], 0.02)
    assert engine == {"LORA_SHRINK": "in_base_gemm"}
    assert "+sharedprefix (DECODE_PREFIX shared): dropped, measured only on top of candidates not kept" in lines


def test_settings_that_pay_only_together_are_kept_as_a_bundle_and_open_what_needs_them(tmp_path):
    """Lease 31's shape: +fa3 and +pipelined each lose alone, together (on top of a kept +combo) they gain; the
    bundle sets both, and +sharedprefix (on top of the bundle) is judged once the bundle is kept. A bundle with a
    kept part (combo+fa3+pipelined against the base, combo+pipelined) is not judged: its other parts are, on top
    of the kept one."""
    folder = _probe(tmp_path / "p", {
        BASE: ((2.10, 2.40), (40.0, 60.0)),
        f"{BASE}+combo": ((2.00, 2.30), (40.0, 60.0)),                       # kept
        f"{BASE}+fa3": ((2.20, 2.50), (40.0, 60.0)),                         # loses alone
        f"{BASE}+pipelined": ((2.12, 2.45), (40.0, 60.0)),                   # loses alone
        f"{BASE}+combo+pipelined": ((2.05, 2.35), (40.0, 60.0)),             # loses on top of combo
        f"{BASE}+combo+fa3+pipelined": ((1.80, 2.10), (40.0, 60.0)),         # the pair: +0.20 / +0.20 vs combo
        f"{BASE}+combo+fa3+sharedprefix+pipelined": ((1.70, 2.00), (40.0, 60.0))})  # +0.10 on top of the pair
    engine, lines = pick([folder], 0.02)
    assert engine == {"ATTENTION_BACKEND": "fa3", "COMBO_KERNELS": "on", "DECODE_PREFIX": "shared",
                      "LORA_SHRINK": "in_base_gemm", "READBACK": "pipelined"}
    said = "\n".join(lines)
    assert ("+fa3+pipelined (ATTENTION_BACKEND+READBACK fa3+pipelined): kept, decode step gains (ms: "
            f"{BASE}+combo+fa3+pipelined vs {BASE}+combo: p128-r64-n1-greedy +0.200") in said
    assert "+pipelined (READBACK pipelined): dropped" in said and "+fa3 (ATTENTION_BACKEND fa3): dropped" in said
    assert "+sharedprefix (DECODE_PREFIX shared): kept" in said
    assert "+combo+fa3+pipelined (" not in said and "+combo+pipelined (" not in said
    # the same pair losing together is dropped, and nothing it would have opened is kept
    slower = _probe(tmp_path / "q", {
        BASE: ((2.10, 2.40), (40.0, 60.0)),
        f"{BASE}+combo": ((2.00, 2.30), (40.0, 60.0)),
        f"{BASE}+combo+fa3+pipelined": ((1.95, 2.31), (40.0, 60.0)),        # +0.05 / -0.01: dropped
        f"{BASE}+combo+fa3+sharedprefix+pipelined": ((1.90, 2.32), (40.0, 60.0))})  # as a triple too
    engine, lines = pick([slower], 0.02)
    assert engine == {"COMBO_KERNELS": "on", "LORA_SHRINK": "in_base_gemm"}
    assert any(line.startswith("+fa3+pipelined (ATTENTION_BACKEND+READBACK fa3+pipelined): dropped, decode step "
                               "gains not above") for line in lines)
    assert any(line.startswith("+fa3+sharedprefix+pipelined (ATTENTION_BACKEND+DECODE_PREFIX+READBACK "
                               "fa3+shared+pipelined): dropped, decode step gains not above") for line in lines)
    assert "+sharedprefix (DECODE_PREFIX shared): dropped, measured only on top of candidates not kept" in lines


def test_prefill_settings_are_judged_by_their_prefill_and_the_tokens_per_s_they_move(tmp_path):
    """Lease 28's shape: shared prompts and the captured prefill each lose somewhere alone; together they cut
    the prefill in every cell and raise tokens/s in every cell while the decode step reads slower (its draw):
    kept as a bundle. A prefill setting whose tokens/s falls in a cell is dropped, whatever its prefill gain."""
    folder = _probe(tmp_path / "p", {
        BASE: ((2.00, 2.40), (64.5, 73.9), (1342.0, 4531.0)),
        f"{BASE}+sharedprefill": ((2.16, 2.72), (99.4, 73.4), (1084.0, 4207.0)),         # slower alone
        f"{BASE}+prefillgraph": ((2.09, 2.50), (9.1, 31.5), (1812.0, 4500.0)),           # prefill gains, rate falls
        f"{BASE}+sharedprefill+prefillgraph": ((2.18, 2.53), (9.2, 11.0), (1739.0, 5973.0))})
    engine, lines = pick([folder], 0.02)
    assert engine == {"LORA_SHRINK": "in_base_gemm", "PREFILL": "shared_prompts", "PREFILL_STEP": "compiled_graph"}
    assert ("+prefillgraph (PREFILL_STEP compiled_graph): dropped, its tokens/s fell (p128-r64-n4-stochastic "
            "x0.993)") in lines
    assert any(line.startswith("+sharedprefill+prefillgraph (PREFILL+PREFILL_STEP shared_prompts+compiled_graph): "
                               "kept, prefill gains (ms: ") for line in lines)


def test_a_source_compiled_more_than_once_is_judged_by_the_mean_of_its_compilations(tmp_path):
    """The draw probe: the base and a candidate each compiled twice or three times. Against the base's first
    compilation alone the candidate would lose in one cell (2.30 against 2.25); against the base's mean it gains
    in both; `+again` itself is no candidate and no line."""
    folder = _probe(tmp_path / "p", {
        BASE: ((2.10, 2.25), (40.0, 60.0)),
        f"{BASE}+again": ((2.20, 2.55), (40.0, 60.0)),
        f"{BASE}+again2": ((2.15, 2.50), (40.0, 60.0)),        # the base: 2.15 / 2.4333 by the mean
        f"{BASE}+combo": ((2.00, 2.30), (40.0, 60.0)),
        f"{BASE}+combo+again": ((2.06, 2.34), (40.0, 60.0))})  # combo: 2.03 / 2.32 -> +0.12 / +0.113
    engine, lines = pick([folder], 0.02)
    assert engine == {"COMBO_KERNELS": "on", "LORA_SHRINK": "in_base_gemm"}
    (line,) = [line for line in lines if line.startswith("+combo ")]
    assert "p128-r64-n1-greedy +0.120, p128-r64-n4-stochastic +0.113" in line
    assert not any("again" in line for line in lines)
    # one failed compilation fails the source
    failing = _probe(tmp_path / "q", {BASE: ((2.1, 2.4), (40.0, 60.0)), f"{BASE}+combo": ((2.0, 2.3), (40.0, 60.0)),
                                      f"{BASE}+combo+again": "RuntimeError: CUDA error"})
    engine, lines = pick([failing], 0.02)
    assert engine == {"LORA_SHRINK": "in_base_gemm"}
    assert "+combo (COMBO_KERNELS on): dropped, inductor+shrinkgemm+combo failed: RuntimeError: CUDA error" in lines


def test_a_failure_superseded_by_a_later_measurement_is_judged_by_the_measurement(tmp_path):
    earlier = _probe(tmp_path / "a", {BASE: ((2.1, 2.4), (40.0, 60.0)),
                                      f"{BASE}+chunkedsampler": "InductorError: CantSplit:\n s24 not divisible"})
    later = _probe(tmp_path / "b", {BASE: ((2.1, 2.4), (40.0, 60.0)),
                                    f"{BASE}+chunkedsampler": ((2.0, 2.3), (40.0, 60.0))})
    engine, lines = pick([earlier, later], 0.02)
    assert engine == {"LORA_SHRINK": "in_base_gemm", "SAMPLER": "chunked"}
    assert any(line.startswith("+chunkedsampler (SAMPLER chunked): kept") and line.endswith(
        f"it failed in {earlier} before (InductorError: CantSplit: s24 not divisible)") for line in lines)
    engine, lines = pick([later, earlier], 0.02)  # the failure is the latest record: decisive
    assert engine == {"LORA_SHRINK": "in_base_gemm"}
    assert ("+chunkedsampler (SAMPLER chunked): dropped, inductor+shrinkgemm+chunkedsampler failed: "
            "InductorError: CantSplit: s24 not divisible") in lines


def test_a_kept_setting_whose_requirement_loses_its_setting_is_dropped(tmp_path):
    folder = _probe(tmp_path / "p", {
        BASE: ((2.1, 2.4), (40.0, 60.0)),
        f"{BASE}+flex": ((1.8, 2.0), (40.0, 60.0)),           # gains more than fa3: ATTENTION_BACKEND flex
        f"{BASE}+fa3": ((2.0, 2.3), (40.0, 60.0)),
        f"{BASE}+fa3+sharedprefix": ((1.9, 2.1), (40.0, 60.0))})  # kept on top of fa3, which flex displaces
    engine, lines = pick([folder], 0.02)
    assert engine == {"ATTENTION_BACKEND": "flex", "LORA_SHRINK": "in_base_gemm"}
    assert "DECODE_PREFIX shared: dropped, it needs ATTENTION_BACKEND fa3 or triton, which is not chosen" in lines


def test_a_kept_setting_with_one_of_its_allowed_requirements_stays(tmp_path):
    """DECODE_PREFIX shared runs with FA3 or the Triton kernel: kept on top of +tritonattn, it stays with it."""
    folder = _probe(tmp_path / "p", {
        BASE: ((2.1, 2.4), (40.0, 60.0)),
        f"{BASE}+tritonattn": ((2.0, 2.3), (40.0, 60.0)),
        f"{BASE}+tritonattn+sharedprefix": ((1.95, 2.1), (40.0, 60.0))})
    engine, lines = pick([folder], 0.02)
    assert engine == {"ATTENTION_BACKEND": "triton", "DECODE_PREFIX": "shared", "LORA_SHRINK": "in_base_gemm"}
    assert not any("dropped, it needs" in line for line in lines), lines


def test_the_command_prints_the_mapping_alone_on_stdout(folders, capsys):
    assert main([str(f) for f in folders]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"ATTENTION_BACKEND": "fa3", "LORA_EXPAND": "gemm", "LORA_SHRINK": "in_base_gemm",
                               "PREFILL_STEP": "compiled_graph"}
    assert "+expandgemm (LORA_EXPAND gemm): kept" in err
    assert main([str(f) for f in folders] + ["--min-gain-ms", "0.2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ATTENTION_BACKEND": "fa3", "LORA_SHRINK": "in_base_gemm",
                                                   "PREFILL_STEP": "compiled_graph"}


@pytest.mark.parametrize(("argv", "message"), [
    (["{missing}"], "no probe.json (a regular file) in it"),
    (["{first}", "--min-gain-ms", "-1"], "--min-gain-ms: -1.0 is not allowed; allowed: a number >= 0"),
])
def test_bad_input_is_refused_in_one_line_with_nothing_on_stdout(folders, tmp_path, capsys, argv, message):
    argv = [a.format(missing=tmp_path / "missing", first=folders[0]) for a in argv]
    with pytest.raises(SystemExit):
        main(argv)
    out, err = capsys.readouterr()
    assert out == "" and message in err.strip().splitlines()[-1]


def test_a_probe_that_did_not_run_is_left_out_only_when_asked(folders, tmp_path, capsys):
    assert main([str(folders[0]), str(tmp_path / "decode-never"), "--skip-missing"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"LORA_EXPAND": "gemm", "LORA_SHRINK": "in_base_gemm", "PREFILL_STEP": "compiled_graph"}
    assert f"{tmp_path / 'decode-never'}: no probe.json, left out (--skip-missing)" in err


def test_a_candidate_dropped_early_is_judged_again_where_a_later_probe_measured_it_on_the_kept_engine(tmp_path):
    """Lease 32's shape: the chunked sampler lost against the base in an early probe, and gained in a later one on
    top of what was kept since (there combo, here a bundle of fa3 + pipelined, kept only after every single
    setting was judged); the later comparison decides, and its line names the first verdict. One measured on top
    of the kept engine and losing there stays dropped; one never measured there keeps its first verdict. (Single
    settings are judged one kept setting at a time, so one kept single's partners are read on top of it at once.)"""
    early = _probe(tmp_path / "early", {
        BASE: ((2.10, 2.40), (40.0, 60.0)),
        f"{BASE}+fa3": ((2.20, 2.50), (40.0, 60.0)),                 # loses alone
        f"{BASE}+pipelined": ((2.12, 2.45), (40.0, 60.0)),           # loses alone
        f"{BASE}+fa3+pipelined": ((1.90, 2.20), (40.0, 60.0)),       # the bundle: kept, +0.20 / +0.20
        f"{BASE}+chunkedsampler": ((2.15, 2.30), (40.0, 60.0)),      # -0.05 / +0.10: dropped here
        f"{BASE}+partsexpand": ((2.20, 2.50), (40.0, 60.0)),         # -0.10 / -0.10: dropped here
        f"{BASE}+edges": ((2.20, 2.50), (40.0, 60.0))})              # dropped, never measured again
    later = _probe(tmp_path / "later", {
        BASE: ((2.10, 2.40), (40.0, 60.0)),
        f"{BASE}+fa3+pipelined": ((1.90, 2.20), (40.0, 60.0)),
        f"{BASE}+fa3+pipelined+chunkedsampler": ((1.80, 2.05), (40.0, 60.0)),  # +0.10 / +0.15 on the kept engine
        f"{BASE}+fa3+pipelined+partsexpand": ((1.95, 2.10), (40.0, 60.0))})    # -0.05 / +0.10: still dropped
    engine, lines = pick([early, later], 0.02)
    assert engine == {"ATTENTION_BACKEND": "fa3", "LORA_SHRINK": "in_base_gemm", "READBACK": "pipelined",
                      "SAMPLER": "chunked"}
    (sampler,) = [line for line in lines if line.startswith("+chunkedsampler ")]
    assert sampler.startswith("+chunkedsampler (SAMPLER chunked): kept, decode step gains (ms: "
                              "inductor+shrinkgemm+fa3+pipelined+chunkedsampler vs inductor+shrinkgemm+fa3+pipelined: "
                              "p128-r64-n1-greedy +0.100, p128-r64-n4-stochastic +0.150)")
    assert sampler.endswith("(judged again on top of more kept settings; before: dropped, decode step gains not "
                            "above 0.02 ms in every cell)")
    (expand,) = [line for line in lines if line.startswith("+partsexpand ")]
    assert "dropped" in expand and "inductor+shrinkgemm+fa3+pipelined+partsexpand vs inductor+shrinkgemm+fa3" in expand
    assert "judged again" in expand
    (edges,) = [line for line in lines if line.startswith("+edges ")]
    assert "dropped" in edges and "judged again" not in edges


def test_a_variant_whose_greedy_tokens_part_at_once_is_not_picked_for_its_speed(tmp_path):
    """A broken kernel is fast and wrong: its greedy rows all part from the probe's first variant's within the first
    tokens (`greedy_against_first_variant`), where bf16 candidates part at near-ties, tens of tokens in. It is
    dropped as failed; one compilation parting at once fails its source; a candidate parting late is judged by its
    speed."""
    def agreement(identical, first):
        return {"rows": 4, "identical_rows": identical, "mean_first_difference": first}

    folder = _probe(tmp_path / "p", {
        BASE: ((2.10, 2.40), (40.0, 60.0)),
        f"{BASE}+skinnygemm": ((1.50, 1.80), (40.0, 60.0)),
        f"{BASE}+skinnygemm+again": ((1.55, 1.85), (40.0, 60.0)),
        f"{BASE}+fa3plan": ((2.00, 2.30), (40.0, 60.0)),
        f"{BASE}+combo": ((2.00, 2.30), (40.0, 60.0))})
    probe = json.loads((folder / "probe.json").read_text())
    probe[f"{BASE}+skinnygemm"]["cells"][CELLS[0]]["greedy_against_first_variant"] = agreement(1, 40.0)
    probe[f"{BASE}+skinnygemm+again"]["cells"][CELLS[0]]["greedy_against_first_variant"] = agreement(0, 0.25)
    probe[f"{BASE}+combo"]["cells"][CELLS[0]]["greedy_against_first_variant"] = agreement(0, 23.5)
    (folder / "probe.json").write_text(json.dumps(probe))
    engine, lines = pick([folder], 0.02)
    assert engine == {"COMBO_KERNELS": "on", "LORA_SHRINK": "in_base_gemm"}  # fa3plan: needs fa3, not chosen
    (skinny,) = [line for line in lines if line.startswith("+skinnygemm ")]
    assert skinny == ("+skinnygemm (GEMM_KERNEL triton_skinny): dropped, inductor+shrinkgemm+skinnygemm failed: its "
                      "greedy tokens part at once (p128-r64-n1-greedy: 0 of 4 rows identical to the first variant's, "
                      "the first difference at token 0.2 on average)")
    assert any(line.startswith("+combo (COMBO_KERNELS on): kept") for line in lines)


def test_two_bundles_sharing_parts_are_not_both_kept_and_the_extra_part_is_judged_on_top_of_the_kept_one(tmp_path):
    """Lease 37's shape: the three epilogues plus one more setting (there fa3plan; here the chunked sampler, which
    needs nothing else), and the three epilogues plus skinnyodown, each gain against the engine before them; kept
    together the engine would run the two extra settings side by side, which no variant measured. The larger gain
    is kept; skinnyodown is then judged alone on top of it, where a variant measured it (+0.01: dropped)."""
    kept_before = f"{BASE}+qkvepilogue"
    epilogues = f"{kept_before}+mlpepilogue+oepilogue+downepilogue"
    folder = _probe(tmp_path / "p", {
        BASE: ((2.10, 2.40), (40.0, 60.0)),
        kept_before: ((1.90, 2.20), (40.0, 60.0)),                      # kept: +0.20 / +0.20
        f"{epilogues}+chunkedsampler": ((1.80, 2.00), (40.0, 60.0)),    # +0.10 / +0.20 against qkvepilogue
        f"{epilogues}+skinnyodown": ((1.82, 2.05), (40.0, 60.0)),       # +0.08 / +0.15 against it
        f"{epilogues}+chunkedsampler+skinnyodown": ((1.79, 1.99), (40.0, 60.0))})  # +0.01 / +0.01 on top
    engine, lines = pick([folder], 0.02)
    assert engine == {"DOWN_EPILOGUE": "triton", "GATE_UP_EPILOGUE": "triton", "LORA_SHRINK": "in_base_gemm",
                      "O_EPILOGUE": "triton", "QKV_EPILOGUE": "triton", "SAMPLER": "chunked"}
    assert any(line.startswith("+mlpepilogue+oepilogue+downepilogue+chunkedsampler (") and ": kept," in line
               for line in lines)
    (skinny,) = [line for line in lines if line.startswith("+skinnyodown ")]
    assert skinny.startswith("+skinnyodown (GEMM_KERNEL triton_skinny_o_down): dropped, decode step gains not above")
    assert f"{epilogues}+chunkedsampler+skinnyodown vs {epilogues}+chunkedsampler" in skinny
    assert not any(line.startswith("+mlpepilogue+oepilogue+downepilogue+skinnyodown (") for line in lines)
    assert "+chunkedsampler (SAMPLER chunked): kept in a bundle kept before it, not judged alone" in lines


def test_a_comparison_measured_again_in_a_later_probe_is_judged_by_the_later_measurement(tmp_path):
    """Lease 36 measured the three epilogues at their old launch configurations (one cell slower than the engine
    under them), lease 37 at the new ones (faster in every cell): the later probe measured the code the engine
    runs now. The later folder decides, whichever way it goes."""
    under = f"{BASE}+qkvepilogue"
    earlier = _probe(tmp_path / "lease36", {BASE: ((2.10, 2.40), (40.0, 60.0)), under: ((1.90, 2.20), (40.0, 60.0)),
                                            f"{under}+mlpepilogue+oepilogue+downepilogue": ((1.93, 2.10), (40, 60))})
    later = _probe(tmp_path / "lease37", {BASE: ((2.10, 2.40), (40.0, 60.0)), under: ((1.90, 2.20), (40.0, 60.0)),
                                          f"{under}+mlpepilogue+oepilogue+downepilogue": ((1.87, 2.07), (40, 60))})
    engine, lines = pick([earlier, later], 0.02)
    assert engine["O_EPILOGUE"] == "triton" and engine["GATE_UP_EPILOGUE"] == "triton"
    (line,) = [line for line in lines if line.startswith("+mlpepilogue+oepilogue+downepilogue (")]
    assert "kept" in line and "+0.030" in line and "-0.030" not in line
    engine, lines = pick([later, earlier], 0.02)  # the slower measurement is now the later one
    assert "O_EPILOGUE" not in engine
    (line,) = [line for line in lines if line.startswith("+mlpepilogue+oepilogue+downepilogue (")]
    assert "dropped" in line and "-0.030" in line and "+0.030" not in line


def test_a_value_kept_on_top_of_another_value_of_its_setting_replaces_it(tmp_path):
    """Lease 40: `+tritonattn` (ATTENTION_BACKEND triton) measured on a base that runs `+fa3`: its gain is over FA3,
    so when kept it replaces FA3 (the base's infinite precedence must not keep FA3), and what needs FA3 (the plan)
    goes with it. Not kept, FA3 stays."""
    base = f"{BASE}+fa3+pipelined"
    folder = _probe(tmp_path / "decode-h200", {
        base: ((1.60, 1.80), (40.0, 60.0)),
        f"{base}+tritonattn": ((1.50, 1.70), (40.0, 60.0)),       # gains 0.10 / 0.10: kept
        f"{base}+fa3plan": ((1.55, 1.75), (40.0, 60.0))})         # gains 0.05 / 0.05 on FA3
    engine, lines = pick([folder], 0.02)
    assert engine == {"ATTENTION_BACKEND": "triton", "LORA_SHRINK": "in_base_gemm", "READBACK": "pipelined"}
    said = "\n".join(lines)
    assert "ATTENTION_BACKEND fa3: replaced by +tritonattn (ATTENTION_BACKEND triton), kept measured on top" in said
    assert "ATTENTION_PLAN per_step: dropped, it needs ATTENTION_BACKEND fa3, which is not chosen" in said
    slower = _probe(tmp_path / "decode-h200-slower", {
        base: ((1.60, 1.80), (40.0, 60.0)),
        f"{base}+tritonattn": ((1.59, 1.85), (40.0, 60.0))})      # gains 0.01 / -0.05: dropped
    engine, _ = pick([slower], 0.02)
    assert engine["ATTENTION_BACKEND"] == "fa3"


def test_a_bundle_partner_goes_with_a_part_whose_requirement_is_dropped(tmp_path):
    """Lease 41: +fa3plan+skinnyodown was kept on a base with FA3, +tritonattn replaced FA3, so the plan went; the
    skinny o/down GEMM, kept only for the bundle's gain (measured with the plan) and dropped alone, must go too."""
    base = f"{BASE}+fa3+pipelined"
    folder = _probe(tmp_path / "decode-h200", {
        base: ((1.60, 1.80), (40.0, 60.0)),
        f"{base}+tritonattn": ((1.50, 1.70), (40.0, 60.0)),               # gains 0.10 / 0.10: kept
        f"{base}+skinnyodown": ((1.59, 1.79), (40.0, 60.0)),              # gains 0.01 / 0.01: dropped
        f"{base}+fa3plan": ((1.59, 1.79), (40.0, 60.0)),                  # gains 0.01 / 0.01: dropped
        f"{base}+fa3plan+skinnyodown": ((1.55, 1.75), (40.0, 60.0))})     # gains 0.05 / 0.05: kept as a bundle
    engine, lines = pick([folder], 0.02)
    assert engine == {"ATTENTION_BACKEND": "triton", "LORA_SHRINK": "in_base_gemm", "READBACK": "pipelined"}
    said = "\n".join(lines)
    assert "+fa3plan+skinnyodown (ATTENTION_PLAN+GEMM_KERNEL per_step+triton_skinny_o_down): kept" in said
    assert "ATTENTION_PLAN per_step: dropped, it needs ATTENTION_BACKEND fa3, which is not chosen" in said
    assert ("GEMM_KERNEL triton_skinny_o_down: dropped, kept only in the bundle +fa3plan+skinnyodown, measured "
            "with ATTENTION_PLAN per_step") in said
    kept_alone = _probe(tmp_path / "decode-h200-alone", {                 # the partner's own gain keeps it
        base: ((1.60, 1.80), (40.0, 60.0)),
        f"{base}+tritonattn": ((1.50, 1.70), (40.0, 60.0)),
        f"{base}+skinnyodown": ((1.55, 1.75), (40.0, 60.0)),
        f"{base}+tritonattn+skinnyodown": ((1.45, 1.65), (40.0, 60.0))})
    engine, _ = pick([kept_alone], 0.02)
    assert engine["GEMM_KERNEL"] == "triton_skinny_o_down" and engine["ATTENTION_BACKEND"] == "triton"


def test_a_later_probes_base_value_wins_whatever_the_hash_seed(tmp_path):
    """Lease 42: its probe's base ran the Triton attention, the earlier probes' bases FA3; both are bases, and the
    picker chose between them by a set's order, which PYTHONHASHSEED draws (FA3 on the device, the Triton kernel
    here). The later probe's base wins, in every process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    earlier = _probe(tmp_path / "decode-h200", {
        f"{BASE}+fa3+pipelined": ((1.60, 1.80), (40.0, 60.0)),
        f"{BASE}+fa3+pipelined+fa3plan": ((1.55, 1.75), (40.0, 60.0))})    # kept on FA3: goes with it
    later = _probe(tmp_path / "decode-launch", {
        f"{BASE}+tritonattn+pipelined": ((1.50, 1.70), (40.0, 60.0)),
        f"{BASE}+tritonattn+pipelined+skinnyodown": ((1.49, 1.69), (40.0, 60.0))})
    engine, lines = pick([earlier, later], 0.02)
    assert engine == {"ATTENTION_BACKEND": "triton", "LORA_SHRINK": "in_base_gemm", "READBACK": "pipelined"}
    assert "+fa3 (ATTENTION_BACKEND fa3): dropped, ATTENTION_BACKEND triton: a later probe's base runs it" in lines
    assert pick([later, earlier], 0.02)[0]["ATTENTION_BACKEND"] == "fa3"  # the order given decides, nothing else
    root = Path(__file__).resolve().parents[1]
    picked = set()
    for seed in range(8):
        done = subprocess.run([sys.executable, "tools/lab/pick_engine.py", str(earlier), str(later)], cwd=root,
                              capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": str(seed)})
        assert done.returncode == 0, done.stderr[-2000:]
        picked.add(done.stdout.strip())
    assert picked == {json.dumps(engine, sort_keys=True)}


@pytest.mark.parametrize(("next_steps", "kept"), [((1.49, 1.70), "through_next_qkv"),   # more in both cells
                                                  ((1.49, 1.745), "rest_of_layer")])   # 0.005 at 16 rows
def test_weight_prefetch_is_judged_on_the_later_probes_base(tmp_path, next_steps, kept):
    """Lease 43's shape: the prefetch probe has its own Q (the later base); `+prefetch` gains 0.05 / 0.04 ms on
    it, and `+prefetchnext` is kept in its place only where it gains above 0.02 in every cell too."""
    q = f"{BASE}+tritonattn"
    first = _probe(tmp_path / "decode-q", {BASE: ((2.10, 2.40), (40.0, 60.0)), q: ((1.57, 1.75), (40.0, 60.0))})
    later = _probe(tmp_path / "decode-prefetch", {q: ((1.56, 1.75), (40.0, 60.0)),
                                                   f"{q}+prefetch": ((1.51, 1.71), (40.0, 60.0)),
                                                   f"{q}+prefetchnext": (next_steps, (40.0, 60.0))})
    engine, lines = pick([first, later], 0.02)
    assert engine["ATTENTION_BACKEND"] == "triton" and engine["WEIGHT_PREFETCH"] == kept, lines
