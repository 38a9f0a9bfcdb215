"""Reproducibility of the generated tokens, computed from a campaign's raw files.

Every repetition record lists, per request, the SHA-256 of the token ids it generated. A request is
*stable* when every measured repetition of its cell gave the same hash, across all the processes
(engine starts) whose repetitions the frozen calculator uses for that cell: the run that completed the
cell and the segments it continues. Warm-up repetitions are excluded, as the calculator excludes them;
the count with the warm-up included is reported beside it.

For greedy cells with n > 1 the same prompt is sent n times in one batch: `batch_mates_agree` counts
the (repetition, prompt) groups whose n requests generated identical tokens (greedy decoding of one
prompt should not depend on its batch mates).

    rollout reproducibility --campaign h200-v2 --params params/rollout-runtime-v2.yaml --output-dir outputs

Nothing here reads or changes a gate: it is a diagnostic of the evidence, beside the conformance files.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

BACKEND_ORDER = ("hf_reference", "hf_cached", "vllm")
DEFINITION = ("a request is stable when every measured repetition of its cell (warm-up excluded) generated the "
              "same token ids, over every process (engine start) whose repetitions the calculator uses for the "
              "cell: its completing run and the segments it continues")


def _prompt_of(request_id: str) -> str:
    """`p128-r64-n4-greedy/q0s3` -> `q0` (the logical prompt; `s3` is the sample)."""
    tail = request_id.rsplit("/", 1)[-1]
    return tail.split("s", 1)[0]


def reproducibility(aggregate: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Per backend and sampling: requests, stable requests (measured repetitions; with the warm-up), how many
    requests span more than one process, and batch-mate agreement for greedy n > 1. `aggregate` is the frozen
    calculator's (which raw file and segments each cell uses); `inputs` is `publish.collect_inputs`'s (the
    sealed raw files' records)."""
    records = {raw["path"]: raw["records"] for raw in inputs["raw_files"]}
    hashes: dict[tuple[str, str], dict[str, dict[str, set[str]]]] = defaultdict(
        lambda: defaultdict(lambda: {"measured": set(), "all": set(), "processes": set()}))
    groups: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for cell in aggregate["cells"]:
        if not cell.get("valid") or not cell.get("raw_file"):
            continue
        key = (cell["backend"], cell["sampling"])
        files = [cell["raw_file"], *(s["raw_file"] for s in cell.get("segments") or [])]
        for path in files:
            for record in records.get(path, []):
                if record.get("record") != "repetition" or record.get("cell_id") != cell["cell_id"]:
                    continue
                if not record.get("valid", True):
                    continue
                by_prompt: dict[str, set[str]] = defaultdict(set)
                for request in record.get("requests") or []:
                    digest = request.get("token_ids_sha256")
                    if digest is None:
                        continue
                    entry = hashes[key][request["request_id"]]
                    entry["all"].add(digest)
                    entry["processes"].add(path)
                    if not record.get("warmup"):
                        entry["measured"].add(digest)
                        by_prompt[_prompt_of(request["request_id"])].add(digest)
                if cell["sampling"] == "greedy" and cell.get("samples_per_prompt", 1) > 1:
                    groups[key] += [len(found) == 1 for found in by_prompt.values()]
    rows = []
    for backend in BACKEND_ORDER + tuple(sorted({b for b, _ in hashes} - set(BACKEND_ORDER))):
        for sampling in ("greedy", "stochastic"):
            requests = hashes.get((backend, sampling))
            if not requests:
                continue
            measured = [r for r in requests.values() if r["measured"]]
            several = [r for r in measured if len(r["processes"]) > 1]
            agree = groups.get((backend, sampling))
            rows.append({"backend": backend, "sampling": sampling, "requests": len(measured),
                         "stable_requests": sum(len(r["measured"]) == 1 for r in measured),
                         "stable_requests_with_warmup": sum(len(r["all"]) == 1 for r in measured),
                         "requests_over_several_processes": len(several),
                         "stable_over_several_processes": sum(len(r["measured"]) == 1 for r in several),
                         "batch_mate_groups": len(agree) if agree is not None else None,
                         "batch_mates_agree": sum(agree) if agree is not None else None})
    return {"campaign": aggregate.get("campaign"), "definition": DEFINITION, "rows": rows}


def for_campaign(study, campaign: str, output_dir) -> dict[str, Any]:
    """Derive the aggregate with the hash-checked frozen calculator (nothing written), then count."""
    from pathlib import Path

    from rollout_lib.evidence.publish import collect_inputs, derive

    _, aggregate = derive(study, campaign, Path(output_dir))
    return reproducibility(aggregate, collect_inputs(study, campaign, Path(output_dir)))


def row_sentence(row: dict[str, Any]) -> str:
    """`vllm greedy: 36 of 120 requests stable (31 with the warm-up)` and the batch-mate count when it applies."""
    text = (f"{row['backend']} {row['sampling']}: {row['stable_requests']} of {row['requests']} requests stable "
            f"({row['stable_requests_with_warmup']} with the warm-up")
    if row["requests_over_several_processes"]:
        text += (f"; {row['stable_over_several_processes']} of the {row['requests_over_several_processes']} "
                 "measured over more than one process")
    text += ")"
    if row["batch_mate_groups"]:
        text += f"; batch mates agree in {row['batch_mates_agree']} of {row['batch_mate_groups']} n>1 prompt groups"
    return text


def summary_text(result: dict[str, Any]) -> str:
    lines = [f"reproducibility of campaign {result['campaign']} ({result['definition']}):"]
    lines += [f"  {row_sentence(row)}" for row in result["rows"]] or ["  no valid cell with token hashes"]
    return "\n".join(lines)
