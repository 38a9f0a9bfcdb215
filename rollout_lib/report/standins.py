"""The exactness ladder by stand-in model (issue 42), beside the gates, never part of them.

The campaign's conformance gates judge its own preregistered actor. Whether a bf16 failure comes from the
backend or from how the stand-in was built is answered by running the same checks on another stand-in: a
model trained for a few GPU-minutes (`rollout models train`) instead of h200-v2's random, logit-scaled one.
Those runs live in `<output-dir>/perf/standins-*/`: the training records (`rollout models train --record`),
the preregistration the trained models were measured under (a YAML file there), and the conformance
evidence of each rung (`rollout conformance` with `--candidate hf_cached`, `--candidate vllm`,
`--oracle-self-check`). This module reads them into one row per stand-in; every cell names its file.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from rollout_lib.core import sha256_file
from rollout_lib.models.train_standin import KERNEL_PRESETS
from rollout_lib.safe_read import read_json

KINDS = ("local_conformance", "vllm_conformance", "oracle_self_consistency")
# the trainer's reference kernels as its records write them (lease 22's stand-ins)
REFERENCE_KERNELS = asdict(KERNEL_PRESETS["reference"])


def _label(evidence: dict[str, Any], study_sha256: str, preregs: dict[str, Path],
           records: dict[str, dict[str, Any]]) -> str:
    sha = evidence.get("preregistration_sha256", "")
    if sha == study_sha256:
        return "this study's actor (random weights, logit-scaled)"
    if sha in preregs and records:
        actor = next((r for r in records.values() if r.get("role") == "actor"), None)
        if actor is not None:
            final = actor["final_metrics"]
            # two stand-ins of one recipe trained with other kernels differ in rounding: two rows, not one
            kernels = actor.get("kernels") or {}
            other = [f"{v}" if isinstance(v, str) else f"{k.replace('_', ' ')} {'on' if v else 'off'}"
                     for k, v in kernels.items() if k in REFERENCE_KERNELS and v != REFERENCE_KERNELS[k]]
            # a named set (`--kernels fast`) by its name and what it turns on
            named = next((name for name, preset in KERNEL_PRESETS.items() if name != "reference" and all(
                kernels.get(k) == v for k, v in asdict(preset).items())), None)
            return (f"trained {actor['arch']} ({actor['trained_tokens'] / 1e6:.1f}M tokens"
                    + (f", kernels {named} ({', '.join(other)})" if named else
                       f", kernels {', '.join(other)}" if other else "")
                    + f", held-out loss {final['heldout_loss_nats']:.2f} nats, entropy "
                    f"{final['mean_entropy_nats']:.2f}, no logit scale)")
    return f"preregistration {sha[:12]}"


def _sampled_max(local: dict[str, Any]) -> float | None:
    """A local conformance file's bf16 sampled-token max |Δ log p| (None where it has none)."""
    return ((local.get("bfloat16") or {}).get("sampled_logprob") or {}).get("max_abs_diff")


def _vllm_sampled_max(vllm: dict[str, Any]) -> float | None:
    """A vLLM conformance file's sampled-token max |Δ log p| (None where it has none)."""
    return (vllm.get("sampled_logprob") or {}).get("max_abs_diff")


def _sampled_cells(vllm: dict[str, Any]) -> list[str]:
    """The cells a vLLM conformance file sampled (it records no settings block)."""
    return sorted((vllm.get("sampled_logprob") or {}).get("cells") or {})


def _cells(evidence: dict[str, Any]) -> str:
    settings = evidence.get("settings") or {}
    if not settings:
        return "—"
    return (f"prompts {','.join(map(str, settings.get('prompt_tokens', [])))}, responses "
            f"{','.join(map(str, settings.get('response_tokens', [])))}")


def _rungs(evidence: dict[str, Any]) -> dict[str, str]:
    kind = evidence["kind"]
    if kind == "local_conformance":
        f32, bf16 = evidence.get("float32") or {}, evidence.get("bfloat16") or {}
        tf = bf16.get("teacher_forced") or {}
        sampled = bf16.get("sampled_logprob") or {}
        return {"float32 exact (greedy, partitions)":
                f"{f32.get('greedy_free_running_identical')}/{f32.get('greedy_free_running_requests')}, "
                f"{f32.get('partitions_identical')}/{f32.get('partitions_requests')}",
                "bf16 hf_cached vs oracle: sampled max |Δ log p|": f"{sampled.get('max_abs_diff', float('nan')):.3g}",
                "bf16 argmax agreement (beyond tie margin)":
                f"{100 * tf.get('argmax_agreement_rate', 0):.2f} % ({tf.get('disagreements_beyond_tie_margin')})",
                "cells": _cells(evidence)}
    if kind == "vllm_conformance":
        value = _vllm_sampled_max(evidence)
        return {"vLLM PG-k1 vs oracle: sampled max |Δ log p|": f"{float('nan') if value is None else value:.3g}"}
    noise = evidence.get("scoring_noise") or {}
    return {"oracle's scoring vs itself: run to run / batch composition":
            (f"{noise['run_to_run_max_abs_diff']:.3g} / {noise['batch_composition_max_abs_diff']:.3g}"
             if noise else "not_measured (file without scoring_noise)"),
            "oracle vs itself, the same check: its generation vs its scoring":
            f"{evidence.get('max_abs_diff', float('nan')):.3g}"}


def _evidence_by_stand_in(output_dir: Path, study_sha256: str) -> dict[str, dict[str, Any]]:
    """{label: {"kinds": {kind: evidence}, "paths": [relative paths], "study": this study's actor, "trained": a
    trained stand-in (its preregistration and actor record beside it)}} for every stand-in under
    `<output_dir>/perf/standins-*/`; where one rung has several files, the last in folder and name order gives it."""
    output_dir = Path(output_dir)
    found: dict[str, dict[str, Any]] = {}
    for folder in sorted((output_dir / "perf").glob("standins-*")):
        if not folder.is_dir():
            continue
        preregs = {sha256_file(p): p for p in sorted(folder.glob("*.yaml")) if p.is_file()}
        records, evidences = {}, []
        for path in sorted(folder.glob("*.json")):
            try:
                data = read_json(path, kind="evidence", root=output_dir)
            except (ValueError, UnicodeDecodeError):
                continue
            if not isinstance(data, dict):
                continue
            if "payload_digest" in data and "final_metrics" in data:
                records[path.stem] = data
            elif data.get("kind") in KINDS:
                evidences.append((path, data))
        for path, evidence in evidences:
            label = _label(evidence, study_sha256, preregs, records)
            sha = evidence.get("preregistration_sha256")
            entry = found.setdefault(label, {"kinds": {}, "paths": [], "study": sha == study_sha256,
                                             "trained": sha != study_sha256 and sha in preregs and any(
                                                 r.get("role") == "actor" for r in records.values())})
            entry["kinds"][evidence["kind"]] = evidence
            entry["paths"].append(str(path.relative_to(output_dir)))
    return found


def standin_ladder(output_dir: Path, study_sha256: str) -> list[dict[str, str]]:
    """One row per stand-in found under `<output_dir>/perf/standins-*/` (empty when none); where one rung
    has several files, the last in folder and name order gives it; a rung without a file reads
    `not_measured`."""
    rows = []
    for label, entry in _evidence_by_stand_in(output_dir, study_sha256).items():
        row = {"stand-in": label}
        for evidence in entry["kinds"].values():
            row.update(_rungs(evidence))
        row["evidence"] = ", ".join(entry["paths"])
        rows.append(row)
    columns = ("stand-in", "float32 exact (greedy, partitions)", "bf16 hf_cached vs oracle: sampled max |Δ log p|",
               "oracle vs itself, the same check: its generation vs its scoring",
               "bf16 argmax agreement (beyond tie margin)",
               "oracle's scoring vs itself: run to run / batch composition",
               "vLLM PG-k1 vs oracle: sampled max |Δ log p|", "cells", "evidence")
    return [{c: row.get(c, "not_measured") for c in columns} for row in rows]


def trained_reading(output_dir: Path, study_sha256: str) -> dict[str, Any] | None:
    """The numbers the report's verdict can cite from the ladder: the trained stand-in's bf16 local conformance
    (`local_max`, on `cells`), this study's actor on the same kind of run beside it (`random_max`, or None),
    and the oracle against itself on the trained stand-in: its own generation-time log-probabilities against its
    teacher-forced scoring, the same check with the oracle as the candidate (`oracle_self_max`; on this study's
    actor, same cells: `random_oracle_self_max`), and its scoring's batch-composition and run-to-run noise
    (`oracle_batch_max`, `oracle_run_max`), and vLLM PG-k1 against the oracle on the trained stand-in
    (`vllm_max`; on this study's actor, same cells: `random_vllm_max`); each None when not measured. None when no
    trained stand-in has a local conformance file."""
    found = _evidence_by_stand_in(output_dir, study_sha256)
    trained = [(label, e) for label, e in found.items() if e["trained"] and "local_conformance" in e["kinds"]]
    if not trained:
        return None
    label, entry = trained[-1]
    local = entry["kinds"]["local_conformance"]
    maximum = _sampled_max(local)
    if maximum is None:
        return None
    # this study's actor beside it only where it was measured on the same cells (a ratio across subsets means little)
    own = next((e["kinds"]["local_conformance"] for e in found.values()
                if e["study"] and "local_conformance" in e["kinds"]
                and _cells(e["kinds"]["local_conformance"]) == _cells(local)), None)
    random_max = _sampled_max(own) if own else None
    oracle = entry["kinds"].get("oracle_self_consistency") or {}
    noise = oracle.get("scoring_noise") or {}
    # the oracle against itself on this study's actor, where it ran on the same cells as the trained one's
    own_oracle = next((e["kinds"]["oracle_self_consistency"] for e in found.values()
                       if e["study"] and "oracle_self_consistency" in e["kinds"]
                       and sorted(e["kinds"]["oracle_self_consistency"].get("cells") or {})
                       == sorted(oracle.get("cells") or {})), None) if oracle else None
    # vLLM PG-k1 against the oracle (bf16 only): on the trained stand-in, and on this study's actor on the same cells
    vllm = entry["kinds"].get("vllm_conformance") or {}
    own_vllm = next((e["kinds"]["vllm_conformance"] for e in found.values()
                     if vllm and e["study"] and "vllm_conformance" in e["kinds"]
                     and _sampled_cells(e["kinds"]["vllm_conformance"]) == _sampled_cells(vllm)), None)
    return {"label": label, "local_max": float(maximum), "cells": _cells(local),
            "vllm_max": _vllm_sampled_max(vllm), "random_vllm_max": _vllm_sampled_max(own_vllm) if own_vllm else None,
            "random_max": float(random_max) if random_max is not None else None,
            "oracle_self_max": oracle.get("max_abs_diff"),
            "random_oracle_self_max": own_oracle.get("max_abs_diff") if own_oracle else None,
            "oracle_batch_max": noise.get("batch_composition_max_abs_diff"),
            "oracle_run_max": noise.get("run_to_run_max_abs_diff"), "evidence": entry["paths"]}
