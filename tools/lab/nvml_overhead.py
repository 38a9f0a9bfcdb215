"""A/B on the GPU: does the NVML memory sampler slow the decode loop it observes?

Same process, same backend, same cell; per-step decode ms of hf_cached with (a) no sampler,
(b) the first runner's sampling (two samplers, 5 ms, /proc walk every sample), (c) the current
sampler (one, 20 ms, tree cached 1 s). Prints and writes JSON.

    python3 tools/lab/nvml_overhead.py OUT.json [cell_id] [repeats]
"""

from __future__ import annotations

import json
import statistics
import sys
from contextlib import ExitStack

import torch

from rollout_lib.backends import create_backend
from rollout_lib.measure.memory import NVMLSampler
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.prereg import load
from rollout_lib.study.workload import Workload


def main() -> None:
    out = sys.argv[1]
    cell_id = sys.argv[2] if len(sys.argv) > 2 else "p128-r64-n1-greedy"
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    study = load("params/rollout-runtime-v2.yaml")
    work = Workload(study)
    backend = create_backend("hf_cached", study, device="cuda")
    backend.cold_start()
    backend.sync_policy(policy_versions(work.arch, study.actor.lora, study.actor.payload_digest, 1)[-1])
    requests = work.requests(work.cell(cell_id))
    backend.generate(requests)  # warmup, excluded
    configs = {"none": [], "legacy_2x5ms_walk": [dict(interval_s=0.005, tree_refresh_s=0.0)] * 2,
               "current_1x20ms_cached": [dict(interval_s=0.02, tree_refresh_s=1.0)]}
    results = {name: [] for name in configs}
    for _ in range(repeats):  # interleaved, so drift hits every config alike
        for name, samplers in configs.items():
            with ExitStack() as stack:
                for kwargs in samplers:
                    stack.enter_context(NVMLSampler(torch.cuda.current_device(), **kwargs))
                batch = backend.generate(requests)
            results[name].append(1000 * batch.phases["decode_s"].seconds / batch.decode_steps)
    summary = {name: {"decode_ms_per_step": values, "median": statistics.median(values)}
               for name, values in results.items()}
    report = {"cell_id": cell_id, "backend": "hf_cached", "repeats": repeats, "results": summary,
              "gpu": torch.cuda.get_device_name(0)}
    print(json.dumps(report, indent=1))
    with open(out, "w") as handle:
        json.dump(report, handle, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
