"""How much of a policy's LoRA delta survives folding it into the bf16 mirror (issue 43, item 2: folding
LoRA into the mirror for the life of a policy version needs an exactness argument first).

    python tools/lora_fold_error.py [--params params/rollout-runtime-v2.yaml] [--versions 1,8] --out OUT.json

For every LoRA target of every layer: W = the snapshot's bf16 weight, dW = scaling * B @ A in float32 (the
policy version's exact tensors), folded = bf16(W + dW) - W (what a folded bf16 mirror would apply). Reports
per projection the relative error ||folded - dW|| / ||dW|| (the share of the policy's update the fold
loses or distorts), |dW| and |W|, and the bf16 spacing at |W|. The unfolded path applies dW in float32 and
rounds only the layer's output. CPU only; it reads the snapshot (built into --cache-dir if missing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params/rollout-runtime-v2.yaml")
    parser.add_argument("--versions", default="1,8", help="policy versions, comma-separated (1 = the start)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        versions = sorted({int(v) for v in args.versions.split(",")})
    except ValueError:
        parser.error(f"--versions: {args.versions!r} is not a comma-separated list of positive integers")
    if not versions or versions[0] < 1:
        parser.error("--versions: positive integers (1 = the start policy)")
    if args.out.exists():
        parser.error(f"--out: {args.out} exists (never overwritten)")

    from safetensors import safe_open

    from rollout_lib.models.local_snapshot import resolve_model_snapshot
    from rollout_lib.models.policy import policy_versions
    from rollout_lib.study.prereg import load
    from rollout_lib.study.workload import Workload

    study = load(args.params)
    snapshot = resolve_model_snapshot(study.actor, cache_dir=args.cache_dir, study_path=study.source_path)
    (weights_file,) = sorted(Path(snapshot.path).glob("*.safetensors"))
    policies = policy_versions(Workload(study).arch, study.actor.lora, study.actor.payload_digest, versions[-1])
    result = {"kind": "lora_fold_error", "preregistration_sha256": study.sha256,
              "snapshot_digest": snapshot.payload_digest, "versions": {}}
    with safe_open(str(weights_file), "pt") as weights:
        for version in versions:
            policy = policies[version - 1]
            by_projection: dict[str, list[dict[str, float]]] = {}
            for name, lora_a in sorted(policy.tensors.items()):
                if not name.endswith(".lora_A"):
                    continue
                base = name.removesuffix(".lora_A")
                w = weights.get_tensor(f"{base}.weight").float()
                delta = policy.scaling * (policy.tensors[f"{base}.lora_B"].float() @ lora_a.float())
                folded = (w + delta).bfloat16().float() - w
                norm = float(delta.norm())
                spacing = float(w.abs().mean() * 2.0 ** -7)  # bf16: 8 significant bits
                by_projection.setdefault(base.rsplit(".", 1)[-1], []).append(
                    {"relative_error": float((folded - delta).norm()) / norm if norm else 0.0,
                     "mean_abs_delta": float(delta.abs().mean()), "mean_abs_weight": float(w.abs().mean()),
                     "bf16_spacing_at_mean_weight": spacing})
            result["versions"][str(version)] = {
                projection: {"layers": len(rows),
                             "relative_error_median": statistics.median(r["relative_error"] for r in rows),
                             "relative_error_max": max(r["relative_error"] for r in rows),
                             "mean_abs_delta": statistics.fmean(r["mean_abs_delta"] for r in rows),
                             "mean_abs_weight": statistics.fmean(r["mean_abs_weight"] for r in rows),
                             "bf16_spacing_at_mean_weight": statistics.fmean(r["bf16_spacing_at_mean_weight"]
                                                                             for r in rows)}
                for projection, rows in sorted(by_projection.items())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    tmp.replace(args.out)
    for version, projections in result["versions"].items():
        for projection, row in projections.items():
            print(f"v{version} {projection:<10} fold loses {100 * row['relative_error_median']:.1f} % of dW (max "
                  f"{100 * row['relative_error_max']:.1f} %); |dW| {row['mean_abs_delta']:.2e}, |W| "
                  f"{row['mean_abs_weight']:.2e}, bf16 spacing {row['bf16_spacing_at_mean_weight']:.1e}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
