"""Write notebooks/measure.ipynb from this source (code review happens here, not in JSON).

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

Output: one append-only raw file `outputs/raw/<campaign>/<backend>/<run_id>.jsonl` (reuse a
`run_id` to resume: completed cells are skipped). The frozen calculator and the report read it.

Set `profile_cell` to a cell id to profile that one cell with `torch.profiler` instead of
measuring: the top operators table is shown and a Chrome trace is saved under `outputs/profiles/`.

Run: `papermill notebooks/measure.ipynb outputs/runs/measure-hf_cached.ipynb -p backend hf_cached`."""

PARAMETERS = """backend: str = "hf_cached"  # hf_reference, hf_cached (vllm once it lands)
params: str = "params/rollout-runtime-v2.yaml"  # the preregistration, or a profile: params/profiles/smoke.yaml
campaign: str = "default"  # raw files go to <output_dir>/raw/<campaign>/<backend>/
cells: list = []  # cell ids such as p128-r64-n1-greedy; empty means every cell of the workload
run_id: str = ""  # empty means a new UTC timestamp id; reuse an id to resume an interrupted run
output_dir: str = "outputs"
device: str = ""  # empty means cuda when present, else cpu
profile_cell: str = ""  # a cell id: profile that one cell instead of measuring"""

VALIDATE = """import os
import sys
from pathlib import Path

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "rollout_lib").is_dir())
os.chdir(ROOT)
sys.path.insert(0, str(ROOT))

from rollout_lib.runner import validate_parameters  # noqa: E402 - after locating the repository root

spec, study, workload = validate_parameters(backend=backend, params=params, campaign=campaign, cells=cells,
                                            run_id=run_id, output_dir=output_dir, device=device,
                                            profile_cell=profile_cell)
print(f"{study.study_id}: {study.status_label}; preregistration sha256 {study.sha256}")
print(f"backend {spec.backend}; {len(spec.cells)} cell(s); raw file {spec.path}")"""

MEASURE = """import pandas as pd
from IPython.display import display
from tqdm import tqdm

from rollout_lib.runner import read_raw, run

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
    from rollout_lib.policy import policy_versions
    from rollout_lib.runner import MEASUREMENT_POLICY_VERSION
    from rollout_lib.runner import profile_cell as profile_one_cell

    profiled = create_backend(spec.backend, study, device=spec.device)
    profiled.cold_start()
    profiled.sync_policy(policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest,
                                         MEASUREMENT_POLICY_VERSION)[-1])
    trace = Path(output_dir) / "profiles" / campaign / spec.backend / f"{spec.run_id}-{profile_cell}.trace.json.gz"
    operator_table, trace_path = profile_one_cell(profiled, workload.requests(workload.cell(profile_cell)), trace)
    profiled.teardown()
    print(operator_table)
    print(f"Chrome trace: {trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")"""


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
    print(out)


if __name__ == "__main__":
    main()
