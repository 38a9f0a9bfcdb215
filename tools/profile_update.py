"""Profile the training half of one RL cycle: actor update (and teacher/actor scoring) on a cell of the
cycle study, with the real NF4 + LoRA actor, on fixed rows (the workload's prompts and seeded random
responses of the cell's length: the update's cost does not depend on which tokens were sampled).

Regime: one process; `--warmup` updates named and excluded, then `--repeats` timed updates (CUDA
synchronized at both ends), then one update under torch.profiler whose Chrome trace is written to
`--out/trace-<path>.json` with a summary (top kernels and CPU ops, kernel count, GPU busy vs wall).

    python tools/profile_update.py --cell p128-r256-n4-stochastic --path reference --out /tmp/prof
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rows(workload, cell, vocab: int, seed: int = 7):
    import torch

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for request in workload.requests(cell):
        response = torch.randint(1000, vocab - 1000, (cell.response_tokens,), generator=generator).tolist()
        rows.append((tuple(request.prompt_token_ids), tuple(response)))
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    from rollout_lib.models.actor import add_lora, load_nf4_base, torch_dtype
    from rollout_lib.models.local_snapshot import resolve_model_snapshot
    from rollout_lib.models.training import ActorTrainer, gkd_loss
    from rollout_lib.study.cycle import load
    from rollout_lib.study.workload import Workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=str(ROOT / "params" / "rollout-runtime-v2-cycle.yaml"))
    parser.add_argument("--cell", default="p128-r256-n4-stochastic")
    parser.add_argument("--path", default="reference", help="training path: reference | fast (see models.training)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=8192, help="fast path: padded tokens per micro-batch")
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on",
                        help="fast path: gradient checkpointing")
    parser.add_argument("--kernel", default="liger", help="fast path: liger | torch_chunked")
    parser.add_argument("--label", default="", help="suffix of the output files (several fast-path settings)")
    args = parser.parse_args(argv)

    study = load(args.params)
    rollout = study.rollout
    workload = Workload(rollout)
    cell = workload.cell(args.cell)
    device = torch.device("cuda")
    spec = rollout.actor
    snapshot = resolve_model_snapshot(spec, study_path=rollout.source_path)
    started = time.perf_counter()
    actor = add_lora(load_nf4_base(snapshot.path, spec.quantization, torch_dtype(spec.quantization.compute_dtype),
                                   "cuda"), spec.lora)
    load_s = time.perf_counter() - started
    rows = _rows(workload, cell, workload.arch.vocab_size)
    tokens = sum(len(r) for _, r in rows)
    teacher = [torch.full((len(r),), -2.0) for _, r in rows]
    pad_id = workload.arch.bos_token_id
    started = time.perf_counter()
    if args.path == "reference":
        trainer = ActorTrainer(actor, study.optimizer)
    else:
        from rollout_lib.models.fast_training import FastActorTrainer
        from rollout_lib.study.cycle import TrainingSpec

        training = TrainingSpec(path="fused_mirror", max_tokens_per_micro_batch=args.max_tokens,
                                gradient_checkpointing=args.checkpointing == "on", logprob_kernel=args.kernel)
        trainer = FastActorTrainer(actor, study.optimizer, str(snapshot.path), training,
                                   torch_dtype(spec.quantization.compute_dtype), device)
    build_s = time.perf_counter() - started

    def loss_for(indices, logprobs):
        return gkd_loss(logprobs, [teacher[i] for i in indices], tokens)

    def update() -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        trainer.step(loss_for, rows, device, pad_id)
        torch.cuda.synchronize()
        return time.perf_counter() - began

    warm = [update() for _ in range(args.warmup)]
    timed = [update() for _ in range(args.repeats)]
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    update()
    peak = torch.cuda.max_memory_allocated()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"cell": args.cell, "path": args.path, "label": args.label,
               "settings": trainer.strategy() if hasattr(trainer, "strategy") else "reference (models.training)",
               "rows": len(rows), "response_tokens": tokens,
               "load_s": load_s, "trainer_build_s": build_s, "warmup_s": warm, "update_s": timed,
               "update_median_s": statistics.median(timed), "peak_allocated_bytes": int(peak),
               "update_transient_peak_bytes": int(peak - resident), "resident_bytes": int(resident),
               "gpu": torch.cuda.get_device_name()}
    if not args.no_trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = update()
        trace = out / f"trace-{args.path}{args.label}-{args.cell}.json"
        prof.export_chrome_trace(str(trace))
        events = prof.key_averages()
        by_device = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:25]
        by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
        data = json.loads(trace.read_text())
        kernels = [e for e in data["traceEvents"] if e.get("cat") == "kernel"]
        busy_us = sum(e.get("dur", 0) for e in kernels)
        summary["profiled"] = {
            "wall_s": wall, "kernels": len(kernels), "gpu_kernel_busy_s": busy_us / 1e6,
            "top_device_ops": [[e.key[:90], e.count, round(e.self_device_time_total / 1e3, 2)] for e in by_device],
            "top_cpu_ops": [[e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 2)] for e in by_cpu]}
    print(json.dumps(summary, indent=1))
    (out / f"summary-{args.path}{args.label}-{args.cell}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
