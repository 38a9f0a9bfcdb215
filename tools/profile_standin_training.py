"""Where `rollout models train` spends its time, and what each kernel choice buys (issue 42: the pair took
6.6 GPU-minutes on the H200 in lease 22, against a budget of 5; the issue's trial trained ~2x faster per token).
Profile before changing the recipe.

    python tools/profile_standin_training.py --arch qwen3-0.6b --device cuda \
        --variants eager,sdpa,sdpa+nofill,sdpa+nofill+fused,sdpa+nofill+fused+chunked --out DIR

A variant is an attention implementation (`eager`, the reference, or `sdpa`: FlashAttention-2 with its
deterministic backward) with optional modifiers, each one `TrainKernels` choice of
`rollout_lib/models/train_standin.py` (the product's own step code, not a copy): `+chunked` (head and
cross-entropy per 1,024 tokens), `+fused` (fused AdamW), `+nofill` (no NaN fill of fresh allocations), `+graph`
(the whole step as one CUDA graph, replayed; with sdpa on CUDA: timed per replay, its phases not apart), and
`+batch16` (16 sequences per step instead of the recipe's 8: tokens/s at another batch, not a kernel).

Regime: one process. First the setup phases `train_standin` runs before its loop, each timed: the seeded
initial snapshot (`build_snapshot`), the corpus token streams; the first variant also times loading the
float32 model and the held-out metrics of the initial model. Then, per variant, from the same initial
weights under that variant's deterministic settings: `--warmup` training steps (named, excluded),
`--steps` timed steps (CUDA synchronized around forward, loss, backward, clipping, optimizer step:
per-phase medians), the peak allocated memory, one step under torch.profiler (Chrome trace
`DIR/trace-<variant>.json`, trim with tools/lab/trim_trace.py before committing; the top CUDA kernels and
CPU ops in `DIR/summary.json`), and a determinism check: the gradients of one fixed batch computed twice
from the same weights, compared bit for bit. The steps use the recipe's optimizer, learning rate and
autocast on the recipe's first batches; nothing is written but DIR.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODIFIERS = ("chunked", "fused", "nofill", "graph", "batch16")


def parse_variant(text: str):
    """`sdpa+nofill+fused` -> (TrainKernels, batch multiplier); ValueError naming the bad part."""
    from rollout_lib.models.train_standin import TrainKernels

    attention, *mods = text.split("+")
    if attention not in ("eager", "sdpa"):
        raise ValueError(f"{text!r}: attention {attention!r}; allowed: eager, sdpa")
    for mod in mods:
        if mod not in MODIFIERS or mods.count(mod) > 1:
            raise ValueError(f"{text!r}: modifier {mod!r}; allowed once each: {', '.join(MODIFIERS)}")
    kernels = TrainKernels(attention=attention, loss="chunked" if "chunked" in mods else "full",
                           optimizer="fused" if "fused" in mods else "foreach",
                           fill_uninitialized="nofill" not in mods, step="graph" if "graph" in mods else "eager")
    return kernels, 2 if "batch16" in mods else 1


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


def _step_phases(model, optimizer, batch, recipe, kernels, autocast: bool, device: str) -> dict[str, float]:
    import torch

    from rollout_lib.models.train_standin import forward_for_loss, loss_of

    phases = {}
    out, phases["forward_s"] = _timed(device, lambda: forward_for_loss(model, batch[:, :-1], kernels, autocast))
    loss, phases["loss_s"] = _timed(device, lambda: loss_of(model, out, batch[:, 1:], kernels, autocast))
    out = None  # the loss holds what backward needs
    optimizer.zero_grad(set_to_none=True)
    _, phases["backward_s"] = _timed(device, loss.backward)
    _, phases["clip_s"] = _timed(device, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                                 recipe.grad_clip))
    _, phases["optimizer_s"] = _timed(device, optimizer.step)
    phases["step_s"] = sum(phases.values())
    return phases


def gradients_repeat(model, batch, kernels, autocast: bool) -> dict:
    """The gradients of one batch computed twice from the same weights: bit-identical, or by how much not."""

    from rollout_lib.models.train_standin import forward_for_loss, loss_of

    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, forward_for_loss(model, batch[:, :-1], kernels, autocast), batch[:, 1:], kernels,
                       autocast)
        loss.backward()
        runs.append((loss.detach().clone(), [p.grad.detach().clone() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    return _compare_runs(runs)


def _compare_runs(runs: list) -> dict:
    """Two (loss, gradients) runs: bit-identical, or how many gradient tensors differ and by how much at most."""
    import torch

    (loss_a, grads_a), (loss_b, grads_b) = runs
    differing = [i for i, (a, b) in enumerate(zip(grads_a, grads_b, strict=True)) if not torch.equal(a, b)]
    worst = max((float((grads_a[i] - grads_b[i]).abs().max()) for i in differing), default=0.0)
    return {"loss_identical": bool(torch.equal(loss_a, loss_b)), "tensors": len(grads_a),
            "tensors_differing": len(differing), "max_abs_grad_diff": worst,
            "identical": not differing and bool(torch.equal(loss_a, loss_b))}


def _write_summary(out: Path, summary: dict, names: list[str]) -> None:
    """summary.json after each variant (a job cut off keeps what it measured), with each variant's tok/s over the
    first variant's where both measured."""
    reference = summary["variants"].get(names[0], {}).get("tokens_per_s")
    for row in summary["variants"].values():
        if reference and "tokens_per_s" in row:
            row["tokens_per_s_over_first"] = round(row["tokens_per_s"] / reference, 3)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(out / "summary.json")


def replays_repeat(graph, batch) -> dict:
    """A captured step replayed twice from the same weights and optimizer state (saved, then written back in
    place, where the graph reads them): its gradients and loss bit-identical, or by how much not."""
    import torch

    params = list(graph.model.parameters())
    state = [t for p in params for t in graph.optimizer.state[p].values() if torch.is_tensor(t)]
    saved = [t.detach().clone() for t in (*params, *state)]
    runs = []
    for _ in range(2):
        with torch.no_grad():
            for tensor, value in zip((*params, *state), saved, strict=True):
                tensor.copy_(value)
        loss = graph(batch).clone()
        runs.append((loss, [p.grad.detach().clone() for p in params]))
    return _compare_runs(runs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="qwen3-0.6b", help="qwen3-0.6b, qwen3-1.7b or tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default="eager,sdpa",
                        help="comma-separated: eager or sdpa, each with optional +" + ", +".join(MODIFIERS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", required=True, type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    try:
        variants = {name: parse_variant(name) for name in names}
    except ValueError as exc:
        parser.error(f"--variants: {exc}")
    if len(variants) != len(names):
        parser.error(f"--variants: {args.variants!r} names a variant twice")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps: integers >= 1")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rollout_lib.models.synthetic import build_snapshot
    from rollout_lib.models.train_standin import (
        GraphStep,
        TrainError,
        _attn_implementation,
        _load_float32,
        batch_indices,
        check_kernels,
        deterministic_kernels,
        eval_windows,
        heldout_metrics,
        make_optimizer,
        plan_training,
        token_stream,
        windows,
    )
    from rollout_lib.study.arch import UnknownArchitectureError

    try:
        plan = plan_training(args.arch, device=args.device)
        for name, (kernels, _) in variants.items():
            try:
                check_kernels(kernels, plan.device)
            except TrainError as exc:
                raise TrainError(f"--variants: {name!r}: {exc}") from None
    except (TrainError, UnknownArchitectureError) as exc:
        parser.error(str(exc).strip("'\""))
    args.out.mkdir(parents=True, exist_ok=True)
    device, cuda = plan.device, plan.device.startswith("cuda")
    torch.manual_seed(plan.seed)
    summary: dict = {"arch": plan.arch.name, "device": device, "compute_dtype": plan.compute_dtype,
                     "gpu": torch.cuda.get_device_name(device) if cuda else None, "torch": torch.__version__,
                     "tokens_per_step": plan.recipe.tokens_per_step, "setup_s": {}, "variants": {}}
    autocast = cuda and plan.compute_dtype == "bfloat16"
    with tempfile.TemporaryDirectory(prefix="standin-profile-") as tmp:
        with deterministic_kernels(device, variants[names[0]][0]):
            _, summary["setup_s"]["build_initial_snapshot"] = _timed(
                device, lambda: build_snapshot(plan.arch, plan.seed, Path(tmp), logit_scale=1.0))
            (train_ids, heldout_ids), summary["setup_s"]["token_streams"] = _timed(device, lambda: (
                token_stream(plan.manifest, plan.bpe_vocab_size, "train"),
                token_stream(plan.manifest, plan.bpe_vocab_size, "heldout")))
        eval_set = eval_windows(heldout_ids, plan.recipe)
        train_set = windows(train_ids, plan.recipe.sequence_tokens)
        def measure(name: str, row: dict) -> None:
            kernels, batch_factor = variants[name]
            recipe = replace(plan.recipe, batch_sequences=plan.recipe.batch_sequences * batch_factor)
            row["tokens_per_step"] = recipe.tokens_per_step
            with deterministic_kernels(device, kernels):
                model, row["load_s"] = _timed(device, lambda k=kernels: _load_float32(
                    Path(tmp), device, _attn_implementation(k.attention)))
                if name == names[0]:
                    model.eval()
                    _, row["init_heldout_metrics_s"] = _timed(
                        device, lambda m=model: heldout_metrics(m, eval_set, device, with_fingerprint=False))
                model.train()
                optimizer = make_optimizer(model, recipe, kernels)
                graph = (GraphStep(model, optimizer, recipe, kernels, autocast,
                                   (recipe.batch_sequences, recipe.sequence_tokens + 1), device)
                         if kernels.step == "graph" else None)
                # a graph variant's warm-up includes its eager steps and the capture
                warmup = max(args.warmup, GraphStep.WARMUP_STEPS + 1) if graph else args.warmup

                def one_step(batch) -> dict[str, float]:
                    if graph is None:
                        return _step_phases(model, optimizer, batch, recipe, kernels, autocast, device)
                    return {"step_s": _timed(device, lambda: graph(batch))[1]}  # one replay: no phases apart

                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                timed = []
                for step in range(warmup + args.steps + 1):
                    batch = torch.as_tensor(train_set[batch_indices(plan.seed, len(train_set), step,
                                                                    recipe.batch_sequences)], device=device)
                    if step < warmup + args.steps:
                        phases = one_step(batch)
                        if step >= warmup:
                            timed.append(phases)
                        continue
                    if cuda:
                        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
                    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                    with profile(activities=activities) as prof:
                        one_step(batch)
                    prof.export_chrome_trace(str(args.out / f"trace-{name}.json"))
                    averages = prof.key_averages()
                    device_key = "self_device_time_total" if cuda else "self_cpu_time_total"
                    row["top_ops_by_self_time_us"] = [
                        {"name": e.key, "calls": e.count, "self_us": round(getattr(e, device_key), 1)}
                        for e in sorted(averages, key=lambda e: -getattr(e, device_key))[:25]]
                    row["gradients_repeat"] = (gradients_repeat(model, batch, kernels, autocast) if graph is None
                                               else replays_repeat(graph, batch))
            row["steps"] = len(timed)
            row["median_s"] = {k: round(statistics.median(p[k] for p in timed), 5) for k in timed[0]}
            row["tokens_per_s"] = round(recipe.tokens_per_step / row["median_s"]["step_s"], 1)

        for name in names:
            row: dict = {"kernels": variants[name][0].describe()}
            summary["variants"][name] = row
            try:
                measure(name, row)
            except Exception as exc:  # one variant failing (flash refusing an input, an OOM) must not cost the rest
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            if cuda:
                torch.cuda.empty_cache()
            _write_summary(args.out, summary, names)
    for name, row in summary["variants"].items():
        if "error" in row:
            print(f"{name}: FAILED {row['error']}")
            continue
        repeat = row["gradients_repeat"]
        ratio = row.get("tokens_per_s_over_first")
        print(f"{name}: step {row['median_s']['step_s']:.3f} s ({row['tokens_per_s']:.0f} tok/s"
              + (f", x{ratio:.2f}" if ratio is not None else "") + "): "
              + ", ".join(f"{k} {v:.3f}" for k, v in row["median_s"].items() if k != "step_s")
              + f"; gradients {'identical' if repeat['identical'] else 'DIFFER'} when repeated")
    path = args.out / "summary.json"
    print("setup: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary["setup_s"].items()) + f"; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
