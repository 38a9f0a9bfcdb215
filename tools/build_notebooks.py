"""Write notebooks/measure.ipynb and notebooks/summary.ipynb from this source (code review happens here, not in JSON).

    python tools/build_notebooks.py
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent

MEASURE_INTRO = """# Measure one rollout backend

Regime: end-to-end rollout of each preregistered cell (all `logical_prompts x n` requests of a
cell as one batch), after a timed cold start and one policy sync; 1 warmup (recorded, excluded)
and the preregistered measured repetitions; CUDA synchronized at every timing boundary; torch peak
memory reset per cell and NVML process-tree memory sampled in the background.

Output: one append-only raw file `<output_dir>/raw/<campaign>/<backend>/<run_id>.jsonl` (reuse a
`run_id` to resume an interrupted run: completed cells are skipped). The frozen calculator and the
report read it.

The defaults are the **smoke profile** (tiny synthetic model, `outputs/smoke/`), so "Run All" is
safe on a laptop; the study is `params=params/rollout-runtime-v2.yaml` on a GPU
(`make measure BACKEND=hf_cached CAMPAIGN=h200-v2 PARAMS=params/rollout-runtime-v2.yaml`).

Set `profile_cell` to a cell id to profile that one cell with `torch.profiler` instead of
measuring (no raw file is written): the top operators table is shown and a Chrome trace is saved
under `<output_dir>/profiles/<campaign>/<backend>/`."""

PARAMETERS = """backend: str = "hf_cached"  # hf_reference, hf_cached or vllm
params: str = "params/profiles/smoke.yaml"  # the smoke profile; the study: params/rollout-runtime-v2.yaml
campaign: str = "smoke"  # raw files go to <output_dir>/raw/<campaign>/<backend>/
cells: list = []  # cell ids such as p128-r64-n1-greedy; empty means every cell of the workload
run_id: str = ""  # empty means a new UTC timestamp id; reuse an id to resume an interrupted run
output_dir: str = "outputs/smoke"  # the study's evidence goes to "outputs"
device: str = ""  # empty means cuda when present, else cpu
profile_cell: str = ""  # a cell id: profile that one cell instead of measuring"""

VALIDATE = """import os
import sys
from pathlib import Path

# the project root: the nearest folder, from here upwards, that holds params/ (as git finds .git)
ROOT = next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "params").is_dir()), None)
if ROOT is None:
    raise FileNotFoundError(f"project root: no params/ folder in {Path.cwd()} or any folder above it")
os.chdir(ROOT)
if (ROOT / "rollout_lib").is_dir():  # a checkout without an installed package
    sys.path.insert(0, str(ROOT))

from rollout_lib.core import quiet_known_warnings  # noqa: E402 - after locating the project root
from rollout_lib.measure.runner import validate_parameters  # noqa: E402

quiet_known_warnings()  # known-harmless library start-up messages (rollout_lib.core says which and why)
# types, names and the machine are checked before anything is written: no vLLM to import, or a GPU
# campaign on a CPU, is refused here
spec, study, workload = validate_parameters(backend=backend, params=params, campaign=campaign, cells=cells,
                                            run_id=run_id, output_dir=output_dir, device=device,
                                            profile_cell=profile_cell, check_machine=True)
print(f"{study.study_id}: {study.status_label}; preregistration sha256 {study.sha256}")
if profile_cell:
    print(f"backend {spec.backend}; profiling {profile_cell} (no raw file is written)")
else:
    print(f"backend {spec.backend}; {len(spec.cells)} cell(s); raw file {spec.path}")"""

MEASURE = """import pandas as pd
from IPython.display import display
from tqdm import tqdm

from rollout_lib.measure.rawfile import read_raw
from rollout_lib.measure.runner import run

measured_rows = []
if not profile_cell:
    reps = study.protocol.warmup_repetitions + study.protocol.measured_repetitions
    bar = tqdm(total=len(spec.cells) * reps, desc=f"{spec.backend}: cells x repetitions")
    table = display(pd.DataFrame(), display_id=True)

    def on_progress(cell_id, done, total):
        bar.update(1)
        bar.set_postfix_str(f"{cell_id} {done}/{total}")

    for summary in run(spec, study, workload, on_progress=on_progress):
        measured_rows.append(summary.row())
        table.update(pd.DataFrame(measured_rows).set_index("cell_id"))
    bar.close()
    records, torn = read_raw(spec.path)
    print(f"{spec.path}: {len(records)} records" + (f", torn tail {len(torn)} bytes" if torn else ""))
    print("live rates use a simple median of the measured repetitions; the frozen calculator decides.")"""

PROFILE = """if profile_cell:
    from rollout_lib.backends import create_backend
    from rollout_lib.measure.runner import MEASUREMENT_POLICY_VERSION
    from rollout_lib.measure.runner import profile_cell as profile_one_cell
    from rollout_lib.models.policy import policy_versions

    profiled = create_backend(spec.backend, study, device=spec.device)
    try:
        profiled.cold_start()
        profiled.sync_policy(policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest,
                                             MEASUREMENT_POLICY_VERSION)[-1])
        trace = Path(output_dir) / "profiles" / campaign / spec.backend / f"{spec.run_id}-{profile_cell}.trace.json.gz"
        operator_table, trace_path = profile_one_cell(profiled, workload.requests(workload.cell(profile_cell)), trace)
    finally:  # a failed profile still releases the GPU memory and any engine process
        profiled.teardown()
    print(operator_table)
    print(f"Chrome trace: {trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")"""


SUMMARY_PARAMETERS = """campaign: str = "h200-v1"
params: str = "params/rollout-runtime-v2.yaml"
output_dir: str = "outputs"
"""

SUMMARY_LOAD = """import os
import sys
from pathlib import Path

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "rollout_lib").is_dir())
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from IPython.display import HTML, Markdown, display  # noqa: E402

from rollout_lib.evidence.publish import aggregate_path, collect_inputs, derive  # noqa: E402
from rollout_lib.report import figures, verdict  # noqa: E402
from rollout_lib.report import summary as report  # noqa: E402
from rollout_lib.study.prereg import load  # noqa: E402

pd.set_option("display.max_colwidth", None)
pd.set_option("display.max_rows", 500)
study = load(params)
out = Path(output_dir)
derived_bytes, aggregate = derive(study, campaign, out)  # refuses a calculator whose hash differs
inputs = collect_inputs(study, campaign, out)
stored = aggregate_path(out, campaign)
notes = report.campaign_notes(out, campaign)
matches = stored.exists() and stored.read_bytes() == derived_bytes
banner = [f"**Campaign `{campaign}`** — {study.study_id}, {study.status_label}.",
          f"Frozen calculator verified (sha256 `{aggregate['calculator_sha256'][:16]}…`).",
          "Published aggregate " + (f"`{stored.relative_to(ROOT) if stored.is_relative_to(ROOT) else stored}` "
                                    "re-derives byte for byte." if matches else
                                    "**not published or stale** (run `make publish` or `rollout publish`).")]
if not study.preregistered:
    banner.insert(0, "> **NOT PREREGISTERED — smoke profile on a tiny synthetic model. These numbers say nothing "
                     "about the study.**")
display(Markdown("\\n\\n".join(banner)))"""


FIGURE = """fig = {call}
if fig is None:
    display(Markdown(figures.missing_line({missing})))
else:
    plt.show()"""

CAVEATS = """for caveat in figures.caveats(aggregate, study, notes):
    display(Markdown(f"> **Caveat:** {caveat}"))"""

FULL_CYCLE = """from rollout_lib.report import cycle as cycle_report

cycles = cycle_report.load_cycle_aggregate(Path(output_dir), campaign)
if cycles is None:
    display(Markdown(f'No cycle campaign `{campaign}` published yet (`rollout cycle` then `rollout cycle-publish`).'))
else:
    display(report.styled(cycle_report.cycle_table(cycles, Path(output_dir))))
    for make, what in ((cycle_report.cycle_phase_figure, 'phases per cycle'),
                       (cycle_report.cycle_memory_figure, 'memory per phase')):
        fig = make(cycles)
        if fig is None:
            display(Markdown(figures.missing_line(what, 'no GPU memory measured (CPU run: not_applicable)')))
        else:
            plt.show()
    if cycles['missing']:
        display(Markdown(f"Cycle runs still missing: {len(cycles['missing'])} of "
                         f"{len(cycles['missing']) + sum(r['complete'] for r in cycles['rows'])}."))
    not_counted = cycle_report.runs_not_counted(cycles)
    if not_counted is not None:
        display(Markdown('**Cycle raw files the calculator did not take** (kept, never dropped):'))
        display(report.styled(not_counted))"""

DIAGNOSTICS = """from rollout_lib.report import diagnostics

found = diagnostics.diagnostic_files(Path(output_dir))
if not found:
    display(Markdown('No vLLM diagnostic runs in this output folder yet.'))
ladder = diagnostics.ladder_summary(found)
if ladder is not None:
    display(Markdown('**precision ladder for PG-k1, newest measurement of each setting** (from the files '
                     'below; a setting never measured shows its newest failure)'))
    display(report.styled(ladder))
for path, diagnostic in found:
    display(Markdown(diagnostics.caption(path, diagnostic)))
    display(report.styled(diagnostics.diagnostic_table(path, diagnostic)))"""

CONFORMANCE = """table = report.conformance_table(aggregate)
display(report.styled(table) if len(table) else Markdown("No conformance evidence for this campaign yet."))
refresh_rows = report.refresh_table(aggregate)
display(report.styled(refresh_rows) if len(refresh_rows) else Markdown("No policy-refresh evidence yet."))
for gate in (g for g in aggregate["gates"] if g["kind"] == "policy_refresh"):
    reasons = ", ".join(f["reason"] for f in gate["failing_cells"]) or "ok"
    display(Markdown(f"Policy refresh gate `{gate['id']}`: **{'PASS' if gate['passed'] else 'FAIL'}** ({reasons})"))"""


def summary_notebook() -> nbformat.NotebookNode:
    hide = {"tags": ["hide-input"]}

    def code(source: str) -> nbformat.NotebookNode:
        return new_code_cell(source, metadata=hide)

    nb = new_notebook()
    nb.cells = [
        new_markdown_cell("# Rollout Runtime v2 — campaign report\n\nHow fast, how exactly and in how much GPU "
                          "memory the rollout backends generate on the preregistered workload; every number below "
                          "is computed from the raw files by the frozen calculator."),
        new_code_cell(SUMMARY_PARAMETERS, metadata={"tags": ["parameters", "remove-cell"]}),
        code(SUMMARY_LOAD),
        code("display(HTML(verdict.verdict_html(aggregate, study)))"),
        new_markdown_cell("## Frozen setup\n\nWhat every number below is bound to: the preregistration and the "
                          "calculator (SHA-256), the models and their source, the memory budget, the protocol, and "
                          "per raw file the GPU, driver, packages and source commit."),
        code("display(report.styled(report.setup_table(study, aggregate, inputs)))"),
        new_markdown_cell("## Throughput per cell\n\nTokens/s = actual generated tokens / median wall time of "
                          "the measured repetitions (colour on a log scale)."),
        code(FIGURE.format(call="figures.throughput_heatmap(aggregate, study)",
                           missing="'tokens/s per cell', 'no cell measured yet'")),
        code("display(report.styled(report.throughput_table(aggregate)))"),
        new_markdown_cell("### Cells measured by more than one process\n\nA cell cut at a lease's deadline keeps "
                          "its measured repetitions and a later process continues it (a fresh cold start and "
                          "warmup), often in another machine hold on another host: its spread then includes the "
                          "difference between holds. Walls per process (run id), in the calculator's order."),
        code("display(Markdown(report.segment_summary(aggregate)))\n"
             "table = report.segment_table(aggregate)\n"
             "if len(table):\n"
             "    display(report.styled(table))"),
        new_markdown_cell("## Speedups per paired cell, against the gate lines"),
        code(CAVEATS + "\n" + FIGURE.format(call="report.speedup_figure(aggregate, study)",
                                            missing="'speedups', 'no paired cell measured yet'")
             + "\nfor pair in report.missing_speedup_pairs(aggregate) if fig is not None else []:\n"
               "    display(Markdown(figures.missing_line(pair, 'no paired cell measured yet')))"),
        new_markdown_cell("## Memory against budget and gate"),
        code(FIGURE.format(call="report.memory_figure(aggregate, study)",
                           missing="'peak GPU memory', 'no NVML peak measured (CPU run: not_applicable)'")),
        new_markdown_cell("## Phase breakdown\n\nMedians over measured repetitions; a phase the backend "
                          "cannot expose shows its status (`not_measured`), never 0."),
        code(FIGURE.format(call="figures.phase_figure(aggregate)",
                           missing="'phase breakdown', 'no backend exposed prefill and decode in these cells'")),
        code("display(report.styled(report.phase_table(aggregate)))"),
        new_markdown_cell("### Cold start\n\nPer raw file the calculator uses: the backend's cold start (this "
                          "process's timer) and the start-up phases it exposes (vLLM: the mirror snapshot, the "
                          "server until healthy, and its own log's model load, compile, graph capture and engine "
                          "init; the compile cache's state at start). Read from the raw files' `cold_start` "
                          "records."),
        code("table = report.cold_start_table(aggregate, inputs)\n"
             "display(report.styled(table) if len(table) else\n"
             "        Markdown('No cold start recorded in the raw files this campaign uses.'))"),
        new_markdown_cell("## Conformance and policy refresh"),
        code(CONFORMANCE),
        code(FIGURE.format(call="figures.refresh_figure(aggregate)",
                           missing="'refresh sync-time series', 'no policy-refresh evidence for this campaign'")),
        new_markdown_cell("## Full cycle\n\nOne RL cycle per backend, algorithm and cell (cycle study, frozen cycle "
                          "calculator): rollout, teacher scoring, actor scoring, one optimizer step, policy sync. "
                          "Complete-cycle time and full-cycle tokens/s stand beside rollout tokens/s, never combined."),
        code(FULL_CYCLE),
        new_markdown_cell("## vLLM diagnostics\n\nSide-by-side runs beside the gates, never part of them "
                          "(`rollout vllm-diagnostic`, `rollout vllm-compare`, files under `<output_dir>/perf/`)."),
        code(DIAGNOSTICS),
        new_markdown_cell("## Gate outcome\n\nConservative: every covered cell must be present, valid and pass. "
                          "INCOMPLETE: the gate fails only for lack of evidence."),
        code("display(report.styled(report.gate_table(aggregate)))"),
        new_markdown_cell("## Backend selection (fail closed)"),
        code("display(report.styled(report.selection_table(aggregate)))"),
        new_markdown_cell("## Cells still missing\n\nA cell cut at a lease's deadline keeps its measured "
                          "repetitions: how many, and the measurement identity a later process must have to "
                          "continue it (`rollout missing` prints the same)."),
        code("from rollout_lib.campaign.driver import waiting_repetitions\n\n"
             "waiting = {backend: waiting_repetitions(out, campaign, backend, cells)\n"
             "           for backend, cells in aggregate['missing_cells'].items() if cells}\n"
             "display(report.styled(report.missing_table(aggregate, waiting, "
             "study.protocol.measured_repetitions)))"),
        new_markdown_cell("## Campaign notes"),
        code("display(Markdown(notes or 'No notes for this campaign.'))"),
        new_markdown_cell("## Earlier and failed candidates\n\nEvery raw file stays listed: excluded files with "
                          "their reason, superseded and failed cells counted."),
        code("display(report.styled(report.candidates_table(aggregate)))"),
        new_markdown_cell("## Failing and missing entries, per gate"),
        code("display(HTML(report.all_failures_html(aggregate)))"),
        new_markdown_cell("## Integrity"),
        code("display(report.styled(report.integrity_table(study, aggregate, stored if matches else None)))"),
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def measure_notebook() -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.cells = [new_markdown_cell(MEASURE_INTRO),
                new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]}),
                new_code_cell(VALIDATE), new_code_cell(MEASURE), new_code_cell(PROFILE)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main() -> None:
    out = ROOT / "notebooks" / "measure.ipynb"
    out.parent.mkdir(exist_ok=True)
    nbformat.write(measure_notebook(), str(out))
    nbformat.write(summary_notebook(), str(ROOT / "notebooks" / "summary.ipynb"))
    print(out)


if __name__ == "__main__":
    main()
