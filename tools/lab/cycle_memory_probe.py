"""Before/after, side by side in one process: the actor update's memory and time at the cycle
study's largest cell, without and with the trainer's memory strategy (issue 15, lease 11's OOM).

Regime: the NF4 + LoRA actor of the preregistration on one GPU, one micro-batch of
`micro_batch_rows` rows of p512-r512 length (random token ids from a seed), one forward + backward
per setting, each setting after one warmup step (excluded). Measures the torch peak allocated above
the resident set (weights, LoRA, gradients) and the step's wall seconds (synchronized). Settings:
`before` (every activation kept, the LM head's [tokens, vocab] blocks kept: the code of lease 11),
`after` (checkpointed decoder layers and checkpointed LM-head chunks: the trainer's strategy now).
Writes one JSON file (`--out`). `--device cpu` runs it on the tiny study in the CPU tests.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params/rollout-runtime-v2-cycle.yaml")
    parser.add_argument("--cell", default="p512-r512-n4-stochastic")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda:0", help="cpu: the CPU test's run (no memory figures)")
    parser.add_argument("--cache-dir", default=None, help="the synthetic snapshot cache (default: the project's)")
    parser.add_argument("--out", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    import torch

    from rollout_lib.core import canonical_json_bytes
    from rollout_lib.measure.identity import environment_identity
    from rollout_lib.models.actor import add_lora, load_nf4_base, torch_dtype
    from rollout_lib.models.local_snapshot import resolve_model_snapshot
    from rollout_lib.models.training import LOGPROB_CHUNK_TOKENS, lora_parameters, token_logprobs
    from rollout_lib.study.cycle import load
    from rollout_lib.study.workload import Workload

    args = build_parser().parse_args(argv)

    study = load(args.params)
    rollout = study.rollout
    workload = Workload(rollout)
    cell = workload.cell(args.cell)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    spec = rollout.actor
    snapshot = resolve_model_snapshot(spec, cache_dir=args.cache_dir, study_path=rollout.source_path)
    actor = add_lora(load_nf4_base(snapshot.path, spec.quantization, torch_dtype(spec.quantization.compute_dtype),
                                   str(device)), spec.lora)
    params = lora_parameters(actor)
    for param in params:
        param.requires_grad_(True)
    generator = torch.Generator().manual_seed(15)
    vocab = workload.arch.vocab_size
    rows = [(tuple(torch.randint(0, vocab, (cell.prompt_tokens,), generator=generator).tolist()),
             tuple(torch.randint(0, vocab, (cell.response_tokens,), generator=generator).tolist()))
            for _ in range(study.optimizer.micro_batch_rows)]
    tokens = sum(len(r) for _, r in rows)

    def step(checkpointed: bool) -> dict:
        if checkpointed:
            actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            actor.gradient_checkpointing_disable()
        for param in params:
            param.grad = None
        if on_gpu:
            torch.cuda.synchronize(device)
            resident = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        actor.train()
        try:
            token_logprobs(actor, rows, device, workload.arch.bos_token_id, len(rows), grad=True,
                           on_micro_batch=lambda _i, lp: sum(x.sum() for x in lp) / tokens,
                           chunk_tokens=LOGPROB_CHUNK_TOKENS if checkpointed else 10**9,
                           checkpoint_head=checkpointed)
        finally:
            actor.eval()
        if not on_gpu:
            return {"wall_s": time.perf_counter() - started, "memory": "not_applicable (CPU run)",
                    "grad_norm": float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))}
        torch.cuda.synchronize(device)
        return {"wall_s": time.perf_counter() - started,
                "peak_above_resident_bytes": int(torch.cuda.max_memory_allocated(device) - resident),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
                "grad_norm": float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))}

    results = {}
    for name, checkpointed in (("before", False), ("after", True)):
        step(checkpointed)  # warmup (kernels, allocator), excluded
        if on_gpu:
            torch.cuda.empty_cache()
        results[name] = [step(checkpointed) for _ in range(args.repeats)]
    out = {"kind": "cycle_memory_probe", "cell_id": args.cell, "micro_batch_rows": len(rows),
           "logprob_chunk_tokens": LOGPROB_CHUNK_TOKENS, "settings": results,
           "environment": environment_identity(model_digests={"actor": spec.payload_digest},
                                               preregistration_sha256=rollout.sha256)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(canonical_json_bytes(out))
    for name, runs in results.items():
        print(name, " ".join(f"{r.get('peak_above_resident_bytes', 0) / 2**30:.2f} GiB {r['wall_s']:.3f} s"
                             for r in runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
