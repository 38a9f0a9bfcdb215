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
under `<output_dir>/profiles/<campaign>/<backend>/`; on a GPU, the decode step kernel by kernel too
(kernels, GEMMs, attention, norms, LoRA, sampling and the gaps a step), saved beside the trace."""

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
    print(f"Chrome trace: {trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")

    # the decode step kernel by kernel (GPU traces only): GEMMs, attention, norms, LoRA, sampling, gaps
    from rollout_lib.core import write_json_atomic
    from rollout_lib.measure.step_profile import NoGPUKernels, breakdown_record, render

    try:
        step = breakdown_record(trace_path, workload.arch.num_hidden_layers, label=f"{spec.backend} ({campaign})",
                                cell=profile_cell, root=output_dir)
    except ValueError as exc:  # the trace is kept either way; a CPU run's has no GPU kernel to break down
        print(f"decode step breakdown: {'not_applicable' if isinstance(exc, NoGPUKernels) else 'not_measured'} "
              f"({exc})")
    else:
        print(render(step))
        record = trace_path.with_name(trace_path.name.replace(".trace.json.gz", ".breakdown.json"))
        write_json_atomic(record, step, overwrite=True)  # it describes the trace just written beside it
        print(f"breakdown record: {record} (`rollout profile-breakdown` writes the same from any trace)")"""


SUMMARY_PARAMETERS = """campaign: str = "h200-v2"
params: str = "params/rollout-runtime-v2.yaml"
output_dir: str = "outputs"
cycle_campaigns: str = ""  # comma-separated cycle campaigns to show side by side; empty: <campaign> and <campaign>-*
"""

SUMMARY_LOAD = """import os
import sys
from pathlib import Path

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "rollout_lib").is_dir())
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

from IPython.display import HTML, display  # noqa: E402

from rollout_lib.campaign.driver import waiting_repetitions  # noqa: E402
from rollout_lib.evidence.publish import aggregate_path, collect_inputs, derive  # noqa: E402
from rollout_lib.evidence.reproducibility import reproducibility  # noqa: E402
from rollout_lib.report import answer, sections  # noqa: E402
from rollout_lib.study.prereg import load  # noqa: E402

study = load(params)
out = Path(output_dir)
derived_bytes, aggregate = derive(study, campaign, out)  # refuses a calculator whose hash differs
inputs = collect_inputs(study, campaign, out)
stored = aggregate_path(out, campaign)
matches = stored.exists() and stored.read_bytes() == derived_bytes
notes_file = out / "notes" / f"{campaign}.md"
waiting = {backend: waiting_repetitions(out, campaign, backend, cells)
           for backend, cells in aggregate["missing_cells"].items() if cells}"""


def summary_notebook() -> nbformat.NotebookNode:
    """The report in a reader's order: the answer first, then speed, exactness, memory, refresh, full cycle,
    setup and evidence; every cell's code hidden, each shows one HTML block built in rollout_lib/report."""
    hide = {"tags": ["hide-input"]}

    def code(source: str) -> nbformat.NotebookNode:
        return new_code_cell(source, metadata=hide)

    nb = new_notebook()
    nb.cells = [
        new_code_cell(SUMMARY_PARAMETERS, metadata={"tags": ["parameters", "remove-cell"]}),
        code(SUMMARY_LOAD),
        code("display(HTML(answer.answer_html(aggregate, study, campaign, out)))"),
        code("display(HTML(sections.speed_html(aggregate, study, inputs, out)))"),
        code("display(HTML(sections.exactness_html(aggregate, study, reproducibility(aggregate, inputs), campaign, "
             "out)))"),
        code("display(HTML(sections.memory_html(aggregate, study)))"),
        code("display(HTML(sections.refresh_html(aggregate)))"),
        code("display(HTML(sections.cycle_html(out, campaign, cycle_campaigns)))"),
        code("display(HTML(sections.setup_html(study, aggregate, inputs)))"),
        code("display(HTML(sections.evidence_html(study, aggregate, campaign, matches, stored, waiting,\n"
             "                                    notes_file if notes_file.is_file() else None)))"),
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
