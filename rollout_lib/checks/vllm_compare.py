"""vLLM settings side by side (issue 13), diagnostics beside the preregistered gates, never part of them.

Two comparisons, each a list of settings ("rungs") run one after the other in one machine hold, on
the same requests, seeds and policy versions:

- `ladder` — the precision ladder for PG-k1: (a) bf16 as preregistered; (b) bf16 with vLLM's
  float32 LM head (`--hf-overrides {"head_dtype": "float32"}`); (c) both sides in float32: vLLM
  `--dtype float32` serving the float32 dequantization with the adapter merged in float32
  (W + s*B@A, the merged refresh path), and the NF4 actor scoring in float32. Tells a user whether
  the machinery agrees when precision is not the limit. The issue's first form of (c), vLLM's LoRA
  in float32, does not start on the GPU: vLLM 0.26.0's Triton LoRA kernels take only fp16/bf16
  weights (lease 10); it stays as the optional rung `c_float32` (vLLM's CPU backend runs it).
- `refresh-paths` — the adapter refresh (preregistered) against merged weights W + s*B@A reloaded
  in place (`refresh: merged`): sync time per version, tok/s, exactness.

Per rung: the server's cold start, `versions` policy syncs (each timed), then at the last version
the stochastic cells (tok/s; every sampled token's log-probability against the NF4 actor scoring
the same tokens teacher-forced: max and mean |d logprob|) and the greedy cells (every greedy token
of the engine against the actor's argmax at that position: agreement, and the actor's logit gap
for each disagreement against the preregistered tie margin), the attention backend vLLM picked
(from its log) and the identity it served. A setting that fails is a row with its error; the others
still run, and the caller can write the report after each one (see `run_comparison`).
"""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_lib.backends import create_backend
from rollout_lib.checks.conformance import score_sampled
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.prereg import Preregistration
from rollout_lib.study.workload import Workload

FP32_HEAD = ["--hf-overrides", '{"head_dtype": "float32"}']
COMPARISONS: dict[str, dict[str, dict[str, Any]]] = {
    "ladder": {
        "a_bf16": {"options": {}, "scoring_dtype": "bfloat16", "about": "bf16 as preregistered"},
        "b_bf16_fp32_head": {"options": {"extra_server_args": FP32_HEAD}, "scoring_dtype": "bfloat16",
                             "about": "bf16 with vLLM's float32 LM head"},
        "c_float32_merged": {"options": {"dtype": "float32", "refresh": "merged"}, "scoring_dtype": "float32",
                             "about": "vLLM --dtype float32 serving W + s*B@A merged in float32 (no LoRA kernel) "
                                      "and the NF4 actor scoring in float32"},
        # only when asked for (`--rungs`): float32 through vLLM's LoRA path. On the GPU, vLLM 0.26.0's Triton
        # LoRA kernels take only fp16/bf16 weights (lease 10: `assert weight.dtype in [torch.float16,
        # torch.bfloat16]`, lora/ops/triton_ops/lora_expand_op.py:183, raised during engine init, with and
        # without --enforce-eager), so (c) merges the adapter instead; vLLM's CPU backend runs this one
        "c_float32": {"options": {"dtype": "float32"}, "scoring_dtype": "float32", "optional": True,
                      "about": "vLLM --dtype float32 with its LoRA in float32 (CPU backend only in vLLM 0.26.0) "
                               "and the NF4 actor scoring in float32"},
        # only when asked for: the float32 rung with Triton's f32 dots in IEEE float32. vLLM's Triton
        # attention (v1/attention/ops/triton_unified_attention.py) calls tl.dot(Q, K) and tl.dot(P, V)
        # without input_precision, and Triton's default for float32 operands on NVIDIA is tf32 (10-bit
        # mantissa) unless TRITON_F32_DEFAULT says otherwise (a cache-invalidating variable in Triton)
        "c_float32_merged_ieee": {"options": {"dtype": "float32", "refresh": "merged",
                                              "server_env": {"TRITON_F32_DEFAULT": "ieee"}},
                                  "scoring_dtype": "float32", "optional": True,
                                  "about": "c_float32_merged with TRITON_F32_DEFAULT=ieee in the server: Triton "
                                           "attention's float32 dots in IEEE float32, not tf32"},
        "c_float32_eager": {"options": {"dtype": "float32", "extra_server_args": ["--enforce-eager"]},
                            "scoring_dtype": "float32", "optional": True,
                            "about": "c_float32 with --enforce-eager: no CUDA graphs, no torch.compile"},
    },
    "refresh-paths": {
        "adapter": {"options": {"refresh": "adapter"}, "scoring_dtype": None,
                    "about": "exact float32 LoRA written as a peft adapter, load_lora_adapter (preregistered)"},
        "merged": {"options": {"refresh": "merged"}, "scoring_dtype": None,
                   "about": "W + s*B@A in float32 rounded once, reload_weights in place, prefix cache reset"},
    },
}
ATTENTION_PATTERNS = (r"Using (\w+) attention backend", r"Using (?:AttentionBackendEnum\.)?(\w+) backend\.")


def attention_backend(log_text: str) -> str:
    for pattern in ATTENTION_PATTERNS:
        found = re.findall(pattern, log_text)
        if found:
            return found[-1]
    return "not_measured: no attention-backend line in the server log"


def greedy_gaps(model: Any, prompt: tuple[int, ...], tokens: list[int], device: Any) -> list[float]:
    """The actor's logit of its own argmax minus its logit of the engine's token, per position (0 where
    they agree), teacher-forced on the engine's sequence."""
    import torch

    if not tokens:
        return []
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(tokens)).logits[0].float()
        chosen = logits.gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0]
        return (logits.max(dim=-1).values - chosen).tolist()


def _rung(study: Preregistration, workload: Workload, name: str, spec: dict[str, Any], cells: list[str],
          versions: int, device: str | None, cache_dir: str | None, backend_options: dict[str, Any]) -> dict[str, Any]:
    policies = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, versions)
    scoring_dtype = spec["scoring_dtype"] or study.actor.quantization.compute_dtype
    scorer = create_backend("hf_reference", study, device=device, compute_dtype=scoring_dtype, cache_dir=cache_dir)
    engine = None
    try:
        scorer.cold_start()
        scorer.sync_policy(policies[-1])
        engine = create_backend("vllm", study, **(backend_options | spec["options"]))
        return _measure_rung(study, workload, name, spec, cells, policies, scoring_dtype, scorer, engine)
    finally:  # once, on success or failure: a failed rung must not leave its server or its memory to the next
        for stage in (engine, scorer):
            if stage is not None:
                stage.teardown()


def _measure_rung(study: Preregistration, workload: Workload, name: str, spec: dict[str, Any], cells: list[str],
                  policies: list[Any], scoring_dtype: str, scorer: Any, engine: Any) -> dict[str, Any]:
    cold = engine.cold_start()
    syncs = []
    for policy in policies:
        _ = policy.tensors, policy.identity  # synthesizing version k is not the sync's cost (see refresh.py)
        started = time.perf_counter()
        served = engine.sync_policy(policy)
        syncs.append({"version": policy.version, "sync_s": time.perf_counter() - started, "served_identity": served,
                      "policy_identity": policy.identity, "exact": served == policy.identity})
    tie_margin = study.tolerances.bf16_teacher_forced_tie_margin_logits
    rows, diffs, worst, positions, beyond, disagree = [], [], 0.0, 0, 0, 0
    for cell_id in cells:
        cell = workload.cell(cell_id)
        requests = workload.requests(cell)
        engine.generate(requests)  # warmup, excluded
        batch = engine.generate(requests)
        tokens = sum(len(r.token_ids) for r in batch.results)
        row = {"cell_id": cell_id, "wall_s": batch.wall_s, "generated_tokens": tokens,
               "tokens_per_s": tokens / batch.wall_s if batch.wall_s > 0 else None}
        if cell.sampling.name == "greedy":
            gaps = [g for request, result in zip(requests, batch.results, strict=True)
                    for g in greedy_gaps(scorer.model, request.prompt_token_ids, list(result.token_ids),
                                         scorer.device)]
            off = [g for g in gaps if g > 0]
            positions, disagree = positions + len(gaps), disagree + len(off)
            beyond += sum(g >= tie_margin for g in off)
            row |= {"teacher_forced_positions": len(gaps), "argmax_disagreements": len(off),
                    "max_gap_logits": max(off) if off else 0.0}
        else:
            scored, here, missing = score_sampled(scorer, requests, batch.results)
            cell_diffs = [r["mean_abs_logprob_diff"] * r["generated_tokens"] for r in scored
                          if r.get("mean_abs_logprob_diff") is not None]
            diffs.append((sum(cell_diffs), sum(r["generated_tokens"] for r in scored
                                               if r.get("mean_abs_logprob_diff") is not None)))
            worst = max(worst, here)
            row |= {"max_abs_logprob_diff": here, "requests_without_logprobs": missing}
        rows.append(row)
    environment = engine.environment()
    log = environment.get("log")
    log_text = Path(log).read_text(errors="replace") if log else ""
    served = list(engine.served_policies)
    total, count = sum(d for d, _ in diffs), sum(n for _, n in diffs)
    return {"rung": name, "about": spec["about"], "options": spec["options"], "scoring_dtype": scoring_dtype,
            "cold_start_s": cold.seconds, "syncs": syncs, "sync_s": [s["sync_s"] for s in syncs], "cells": rows,
            "max_abs_logprob_diff": worst if count else None,
            "mean_abs_logprob_diff": total / count if count else None,
            "teacher_forced": {"positions": positions, "argmax_disagreements": disagree,
                               "beyond_tie_margin": beyond, "tie_margin_logits": tie_margin},
            "attention_backend": attention_backend(log_text), "served_policies": served,
            "backend_environment": environment}


def chosen_rungs(comparison: str, rungs: list[str] | None) -> list[str]:
    """The rungs to run (the comparison's non-optional ones by default); an unknown name fails naming the
    allowed ones."""
    if comparison not in COMPARISONS:
        raise ValueError(f"comparison {comparison!r} is not known; allowed: {', '.join(COMPARISONS)}")
    known = COMPARISONS[comparison]
    for rung in rungs or []:
        if rung not in known:
            raise ValueError(f"rungs: {rung!r} is not a rung of {comparison}; allowed: {', '.join(known)}")
    return list(rungs or [name for name, spec in known.items() if not spec.get("optional")])


def run_comparison(study: Preregistration, comparison: str, cells: list[str], versions: int = 2,
                   rungs: list[str] | None = None, device: str | None = None, cache_dir: str | None = None,
                   backend_options: dict[str, Any] | None = None,
                   on_rung: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One report for `comparison` (ladder | refresh-paths): one row per rung, run in order.

    A rung that raises (a server that dies, an engine that refuses a setting) becomes a row with
    `status: failed` and the error, and the next rung still runs. `on_rung` receives the report so
    far after every rung (`complete: false` until the last), so a caller can write it as it grows
    and a deadline or a lost machine keeps the rungs already run."""
    chosen = chosen_rungs(comparison, rungs)
    known = COMPARISONS[comparison]
    workload = Workload(study)
    tolerance = study.tolerances.nf4_sampled_logprob_abs
    report: dict[str, Any] = {
        "kind": f"vllm_{comparison.replace('-', '_')}", "comparison": comparison, "cells": cells,
        "policy_versions": versions, "preregistration_sha256": study.sha256,
        "preregistered_tolerance_logprob_abs": tolerance,
        "note": "diagnostic beside the preregistered gates; it changes none of them",
        "rungs_planned": chosen, "complete": False, "rungs": []}
    for rung in chosen:
        started = time.perf_counter()
        try:
            row = _rung(study, workload, rung, known[rung], cells, versions, device, cache_dir, backend_options or {})
            row["status"] = "measured"
        except Exception as exc:
            row = {"rung": rung, "about": known[rung]["about"], "options": known[rung]["options"], "status": "failed",
                   "error": f"{type(exc).__name__}: {exc}",
                   "root_cause": getattr(exc, "root_cause", None),  # a server start's first exception line
                   "traceback_tail": traceback.format_exc().splitlines()[-12:]}
        row["rung_wall_s"] = time.perf_counter() - started
        report["rungs"].append(row)
        report["complete"] = len(report["rungs"]) == len(chosen)
        if on_rung is not None:
            on_rung(report)
    return report
