"""The fused-mirror training path against the reference trainer at full size (issue 41, item 3): per-token
log-probabilities, loss and LoRA gradients of one update on the preregistered actor, in float32 compute
(where the two must agree: logprobs within 1e-5, gradient cosine >= 0.999 and relative norm difference
<= 1e-3, loss within 1e-5) and in the measured bf16 (reported), plus Liger's fused head against the
chunked float32 head on the same hidden states. Rows: the cell's prompts with seeded random responses.

    python tools/fast_training_exactness.py --cell p128-r256-n4-stochastic --out outputs/perf/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

THRESHOLDS = {"float32": {"max_abs_logprob_diff": 1e-5, "abs_loss_diff": 1e-5, "grad_cosine_min": 0.999,
                          "grad_relative_norm_diff": 1e-3}}


def compare(dtype_name: str, cell_id: str, params: str, rows_limit: int | None = None, kernel: str = "liger") -> dict:
    import torch

    from rollout_lib.models.actor import add_lora, load_nf4_base, torch_dtype
    from rollout_lib.models.fast_training import FastActorTrainer, batched_logprobs, fused_logprobs, model_head
    from rollout_lib.models.local_snapshot import resolve_model_snapshot
    from rollout_lib.models.policy import load_policy_into_peft, policy_versions
    from rollout_lib.models.training import gkd_loss, lora_parameters, token_logprobs
    from rollout_lib.study.cycle import TrainingSpec, load
    from rollout_lib.study.workload import Workload

    study = load(params)
    rollout = study.rollout
    workload = Workload(rollout)
    cell = workload.cell(cell_id)
    spec = rollout.actor
    dtype = torch_dtype(dtype_name)
    snapshot = resolve_model_snapshot(spec, study_path=rollout.source_path)
    actor = add_lora(load_nf4_base(snapshot.path, spec.quantization, dtype, "cuda"), spec.lora)
    # a trained-looking policy (version 3 of the preregistered sequence): B != 0, so LoRA shapes the output
    load_policy_into_peft(actor, policy_versions(workload.arch, spec.lora, spec.payload_digest, 4)[3])
    generator = torch.Generator().manual_seed(11)
    rows = [(tuple(r.prompt_token_ids),
             tuple(torch.randint(1000, workload.arch.vocab_size - 1000, (cell.response_tokens,),
                                 generator=generator).tolist())) for r in workload.requests(cell)][:rows_limit]
    pad, device = workload.arch.bos_token_id, torch.device("cuda")
    tokens = sum(len(r) for _, r in rows)
    teacher = [torch.full((len(r),), -3.0) for _, r in rows]
    params_ = lora_parameters(actor)
    for param in params_:
        param.requires_grad_(True)

    def loss_for(indices, logprobs):
        return gkd_loss(logprobs, [teacher[i] for i in indices], tokens)

    def grads():
        return torch.cat([p.grad.detach().flatten().double() for p in params_])

    for param in params_:
        param.grad = None
    actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    actor.train()
    ref_losses = []

    def on_micro_batch(indices, logprobs):
        loss = loss_for(indices, logprobs)
        ref_losses.append(float(loss.detach()))
        return loss

    ref_lp = token_logprobs(actor, rows, device, pad, study.optimizer.micro_batch_rows, grad=True,
                            on_micro_batch=on_micro_batch)
    actor.eval()
    ref_grad = grads()
    # control: the reference path against itself, all rows in one micro-batch instead of pairs (float32
    # rounding of another batch shape: the floor any two paths can agree to)
    control = token_logprobs(actor, rows, device, pad, len(rows))
    control_diff = float(torch.cat([(a - b).abs() for a, b in zip(control, ref_lp, strict=True)]).max())
    trainer = FastActorTrainer(actor, study.optimizer, str(snapshot.path),
                               TrainingSpec(path="fused_mirror", max_tokens_per_micro_batch=8192,
                                            gradient_checkpointing=True, logprob_kernel=kernel), dtype, device)
    for param in params_:
        param.grad = None
    losses, fast_lp = [], [None] * len(rows)
    from rollout_lib.models.fast_training import micro_batches

    trainer.mirror.train()
    for group in micro_batches(rows, 8192):
        logprobs = batched_logprobs(trainer.decoder, trainer.head, rows, group, pad, device, kernel)
        loss = loss_for(group, logprobs)
        loss.backward()
        losses.append(float(loss.detach()))
        for i, values in zip(group, logprobs, strict=True):
            fast_lp[i] = values.detach().float().cpu()
    trainer.mirror.eval()
    fast_grad = grads()
    diffs = torch.cat([(a - b).abs() for a, b in zip(fast_lp, ref_lp, strict=True)])
    cosine = float(torch.nn.functional.cosine_similarity(ref_grad, fast_grad, dim=0))
    rel = abs(float(fast_grad.norm()) - float(ref_grad.norm())) / float(ref_grad.norm())
    # the two heads on the same hidden states (the mirror's, one micro-batch)
    with torch.inference_mode():
        group = list(range(min(4, len(rows))))
        from rollout_lib.models.fast_training import _pack

        ids, positions, targets, _ = _pack(rows, group, pad, device)
        hidden = trainer.decoder(input_ids=ids, use_cache=False).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        chunked = fused_logprobs(flat, model_head(actor, "torch_chunked"), targets, "torch_chunked")
        heads = {name: float((fused_logprobs(flat, model_head(actor, name), targets, name) - chunked).abs().max())
                 for name in ("liger", "bf16_operands") if name != "bf16_operands" or flat.dtype == torch.bfloat16}
    result = {"dtype": dtype_name, "cell": cell_id, "rows": len(rows), "response_tokens": tokens,
              "max_abs_logprob_diff": float(diffs.max()), "mean_abs_logprob_diff": float(diffs.mean()),
              "abs_loss_diff": abs(sum(losses) - sum(ref_losses)), "loss_reference": sum(ref_losses),
              "grad_cosine": cosine, "grad_relative_norm_diff": rel,
              "kernel": kernel, "head_vs_chunked_float32_max_abs_diff": heads,
              "reference_self_batching_max_abs_logprob_diff": control_diff,
              "mean_abs_logprob": float(torch.cat(ref_lp).abs().mean())}
    limits = THRESHOLDS.get(dtype_name)
    if limits:
        result["passes"] = {"logprobs": result["max_abs_logprob_diff"] <= limits["max_abs_logprob_diff"],
                            "loss": result["abs_loss_diff"] <= limits["abs_loss_diff"],
                            "gradients": cosine >= limits["grad_cosine_min"]
                            and rel <= limits["grad_relative_norm_diff"]}
    del trainer, actor
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=str(ROOT / "params" / "rollout-runtime-v2-cycle.yaml"))
    parser.add_argument("--cell", default="p128-r256-n4-stochastic")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kernel", default="liger", help="bf16 runs: liger | bf16_operands (float32: liger)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    results = [compare(name, args.cell, args.params,
                       kernel=args.kernel if name == "bfloat16" else "liger") for name in args.dtypes.split(",")]
    text = json.dumps({"thresholds": THRESHOLDS, "results": results}, indent=1)
    print(text)
    Path(args.out).write_text(text + "\n")
    failed = [r["dtype"] for r in results if r.get("passes") and not all(r["passes"].values())]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
