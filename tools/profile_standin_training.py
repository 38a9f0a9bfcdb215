"""Where `rollout models train` spends its time (issue 42: the pair took 6.6 GPU-minutes on the H200 in lease
22, against a budget of 5; the issue's trial trained ~2x faster per token). Profile before changing the recipe.

    python tools/profile_standin_training.py --arch qwen3-0.6b --device cuda --attention eager,sdpa --out DIR

Regime: one process. First the setup phases `train_standin` runs before its loop, each timed: the seeded
initial snapshot (`build_snapshot`), the corpus token streams, loading the float32 model, the held-out
metrics of the initial model. Then, per attention implementation, `--warmup` training steps (named,
excluded), `--steps` timed steps (CUDA synchronized around forward, loss, backward, clipping, optimizer
step: per-phase medians), and one step under torch.profiler: Chrome trace `DIR/trace-<attention>.json`
(trim with tools/lab/trim_trace.py before committing) and the top CUDA kernels and CPU ops in
`DIR/summary.json`. The steps use the recipe's batch, sequence length, optimizer and autocast, on the
recipe's first batches; nothing is written but DIR.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _timed(device: str, fn):
    _sync(device)
    started = time.perf_counter()
    value = fn()
    _sync(device)
    return value, time.perf_counter() - started


def _step_phases(model, optimizer, batch, recipe, autocast: bool, device: str) -> dict[str, float]:
    import torch

    phases = {}

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=batch[:, :-1]).logits

    logits, phases["forward_s"] = _timed(device, forward)
    loss, phases["loss_s"] = _timed(device, lambda: torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))
    optimizer.zero_grad(set_to_none=True)
    _, phases["backward_s"] = _timed(device, loss.backward)
    _, phases["clip_s"] = _timed(device, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                                 recipe.grad_clip))
    _, phases["optimizer_s"] = _timed(device, optimizer.step)
    phases["step_s"] = sum(phases.values())
    return phases


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="qwen3-0.6b", help="qwen3-0.6b, qwen3-1.7b or tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default="eager,sdpa", help="comma-separated: eager, sdpa")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", required=True, type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    attentions = args.attention.split(",")
    if any(a not in ("eager", "sdpa") for a in attentions):
        parser.error(f"--attention: {args.attention!r}; allowed: eager, sdpa (comma-separated)")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps: integers >= 1")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rollout_lib.models.synthetic import build_snapshot
    from rollout_lib.models.train_standin import (
        TrainError,
        _deterministic_setup,
        _load_float32,
        batch_indices,
        eval_windows,
        heldout_metrics,
        plan_training,
        token_stream,
        windows,
    )
    from rollout_lib.study.arch import UnknownArchitectureError

    try:
        plan = plan_training(args.arch, device=args.device)
    except (TrainError, UnknownArchitectureError) as exc:
        parser.error(str(exc).strip("'\""))
    args.out.mkdir(parents=True, exist_ok=True)
    recipe, device = plan.recipe, plan.device
    _deterministic_setup(device)
    torch.manual_seed(plan.seed)
    summary: dict = {"arch": plan.arch.name, "device": device, "compute_dtype": plan.compute_dtype,
                     "tokens_per_step": recipe.tokens_per_step, "setup_s": {}, "attention": {}}
    with tempfile.TemporaryDirectory(prefix="standin-profile-") as tmp:
        _, summary["setup_s"]["build_initial_snapshot"] = _timed(
            device, lambda: build_snapshot(plan.arch, plan.seed, Path(tmp), logit_scale=1.0))
        (train_ids, heldout_ids), summary["setup_s"]["token_streams"] = _timed(device, lambda: (
            token_stream(plan.manifest, plan.bpe_vocab_size, "train"),
            token_stream(plan.manifest, plan.bpe_vocab_size, "heldout")))
        train_set, eval_set = windows(train_ids, recipe.sequence_tokens), eval_windows(heldout_ids, recipe)
        for attention in attentions:
            model, load_s = _timed(device, lambda a=attention: _load_float32(Path(tmp), device, a))
            row: dict = {"load_s": load_s}
            if attention == attentions[0]:
                model.eval()
                _, row["init_heldout_metrics_s"] = _timed(
                    device, lambda m=model: heldout_metrics(m, eval_set, device, with_fingerprint=False))
            model.train()
            decay = [p for p in model.parameters() if p.ndim >= 2]
            no_decay = [p for p in model.parameters() if p.ndim < 2]
            optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                           {"params": no_decay, "weight_decay": 0.0}],
                                          lr=recipe.peak_lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
            autocast = device.startswith("cuda") and plan.compute_dtype == "bfloat16"
            timed = []
            for step in range(args.warmup + args.steps + 1):
                batch = torch.as_tensor(train_set[batch_indices(plan.seed, len(train_set), step,
                                                                recipe.batch_sequences)], device=device)
                if step < args.warmup + args.steps:
                    phases = _step_phases(model, optimizer, batch, recipe, autocast, device)
                    if step >= args.warmup:
                        timed.append(phases)
                    continue
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
                with profile(activities=activities) as prof:
                    _step_phases(model, optimizer, batch, recipe, autocast, device)
                prof.export_chrome_trace(str(args.out / f"trace-{attention}.json"))
                averages = prof.key_averages()
                device_key = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
                row["top_ops_by_self_time_us"] = [
                    {"name": e.key, "calls": e.count, "self_us": round(getattr(e, device_key), 1)}
                    for e in sorted(averages, key=lambda e: -getattr(e, device_key))[:25]]
            row["steps"] = len(timed)
            row["median_s"] = {k: round(statistics.median(p[k] for p in timed), 5) for k in timed[0]}
            row["tokens_per_s"] = round(recipe.tokens_per_step / row["median_s"]["step_s"], 1)
            summary["attention"][attention] = row
            del model, optimizer
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    path = args.out / "summary.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    for attention, row in summary["attention"].items():
        print(f"{attention}: step {row['median_s']['step_s']:.3f} s ({row['tokens_per_s']:.0f} tok/s): "
              + ", ".join(f"{k} {v:.3f}" for k, v in row["median_s"].items() if k != "step_s"))
    print("setup: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary["setup_s"].items()) + f"; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
