"""Logit-scale calibration: pick the final-norm factor that gives the preregistered mean entropy.

Random weights give almost flat next-token distributions (about ln(vocab) nats); a trained model
sits near 2-3 nats. With RMSNorm feeding a tied LM head, a factor `s` on the final norm weight
scales every logit by `s`, so entropy is a monotone function of `s` and one forward pass suffices:
we compute the unscaled logits z at every position of the workload's prompts (the 4 logical
prompts at the longest prompt length; shorter prompts are their prefixes), then bisect on log(s)
for mean H(softmax(s * z)) = target. The scale is stored in bfloat16 (the snapshot's dtype), so the
reported entropy is measured at the bf16-rounded scale. Compute is float32.

    rollout models calibrate --arch qwen3-0.6b [--device cuda]
"""

from __future__ import annotations

import math
from typing import Any

from rollout_lib.models.synthetic import bf16_round, ensure_snapshot, load_causal_lm
from rollout_lib.study.prereg import Preregistration


def _mean_entropy(logits, scale: float, chunk: int = 256) -> float:
    import torch

    total, count = 0.0, 0
    for start in range(0, logits.shape[0], chunk):
        block = logits[start:start + chunk] * scale
        logp = torch.log_softmax(block, dim=-1)
        total += float(-(logp.exp() * logp).sum(dim=-1).double().sum())
        count += block.shape[0]
    return total / count


def calibrate_logit_scale(study: Preregistration, arch_name: str, device: str = "cpu",
                          target_nats: float | None = None, role: str | None = None) -> dict[str, Any]:
    import torch

    from rollout_lib.study.workload import Workload

    spec = study.model_for_arch(arch_name, role)
    if spec.source != "synthetic":
        raise ValueError(f"{spec.role}.source: {spec.source!r}: the logit scale is calibrated for synthetic weights "
                         "only (a snapshot's weights are its own)")
    target = target_nats if target_nats is not None else spec.logit_calibration.target_mean_entropy_nats
    unscaled = ensure_snapshot(arch_name, spec.synthetic_seed, 1.0)
    model = load_causal_lm(unscaled.path, torch.float32, device)
    workload = Workload(study)
    longest = max(study.workload.prompt_tokens)
    prompts = [workload.prompt(i, longest) for i in range(study.workload.logical_prompts)]
    with torch.no_grad():
        ids = torch.tensor(prompts, dtype=torch.long, device=device)
        hidden = model.model(input_ids=ids).last_hidden_state  # final norm with weight 1.0
        logits = (hidden.reshape(-1, hidden.shape[-1]) @ model.get_output_embeddings().weight.T).float()
    base = _mean_entropy(logits, 1.0)
    low, high = math.log(1e-3), math.log(1e3)
    for _ in range(60):  # entropy decreases with scale
        mid = (low + high) / 2
        if _mean_entropy(logits, math.exp(mid)) > target:
            low = mid
        else:
            high = mid
    scale = bf16_round(math.exp((low + high) / 2))
    measured = _mean_entropy(logits, scale)
    return {"arch": arch_name, "role": spec.role, "synthetic_seed": spec.synthetic_seed,
            "target_mean_entropy_nats": target,
            "logit_scale": scale, "measured_mean_entropy_nats": round(measured, 6),
            "unscaled_mean_entropy_nats": round(base, 6), "positions": int(logits.shape[0]),
            "compute_dtype": "float32", "device": device}
