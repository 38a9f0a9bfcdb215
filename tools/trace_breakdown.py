"""Per-kernel breakdown of a decode window from a torch-profiler Chrome trace (issue 43, item 1).

    python tools/trace_breakdown.py TRACE.json[.gz] [--layers 28] [--steps N] [--json OUT]

Reads the GPU kernels (`cat: kernel`, plus memsets and memcpys) of a trace taken over whole decode
steps (tools/lab/fast_path_probe.py writes 20 ms windows, CUDA graphs included: CUPTI records the
kernels inside a graph), sorts them by start time and reports, per decode step:
- the kernel count and the GPU busy time (sum of kernel durations) against the window's span;
- the gaps: time between the end of one kernel and the start of the next (launch and dependency
  latency; with CUDA graphs, the graph's own inter-node latency), and the part of them just before an
  attention kernel (h200-v2's cuDNN kernel waits ~5.5 us there against ~0.4 us between other kernels),
  and the gaps longer than 20 us: the GPU waiting for the host (a step's tokens read back, the Python loop,
  the next launch), not for a graph's next node;
- the time and count per category, matched on the kernel name in this order: attention, float32 GEMM
  (cuBLAS's `f32f32` / `sgemm` kernels: the LoRA expand as a GEMM, `+expandgemm`, or an old float32 LM
  head), GEMM (the bf16 projections and head; with `+shrinkgemm` the LoRA shrink rides in them and cannot be
  told apart), RMSNorm (an `rsqrt` in an inductor kernel's name: norms, fused with what inductor put beside
  them), sampling, low-rank reductions (inductor's reductions with `mul` then `sum` in the name, e.g.
  `mul_sum` and the expand's `add_mul_select_slice_sum`: the LoRA shrink/expand at rank 16), KV-cache write
  (index kernels), activation (SiLU), memset/memcpy, other.
The step count is `--steps`; else the read-backs: with CUDA graphs each step ends with one device-to-host
copy of its tokens (`Memcpy DtoH`), so the window is cut to the whole steps between the first and the last
(lease 30: FA3 launches two kernels a layer, split-KV and its combine, so counting attention kernels gave
twice the steps); else the attention kernels divided by `--layers` (one attention call per layer per step),
where a window that cuts a step at either end makes that a fraction, reported as is.
Categories are name heuristics: the kernel names themselves are in the JSON (top 40 by time) to check
them against.
Also, per inductor reduction kernel (`triton_per_*`, `triton_red_*`) and launch shape (the trace's `grid` and
`block`), its calls per step and mean duration: the launch configuration inductor picked for it when the
compiled piece first ran (lease 28: the same kernel source drew different picks in different compilations,
1.5 us against 10.9 us for one kernel), so two traces' reductions can be told apart by pick, not only by time.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"sdpa|flash|fmha|attention|attn"),
    # cuBLAS's float32 kernels: xmma `f32f32_...`, SIMT `sgemm`, gemv `gemmSN_TN_kernel<float`, and nvjet with
    # `s` as its first type letter (read from our traces: the bf16-operand head and `+shrinkgemm`'s float32-output
    # projections are `nvjet_sm90_tss_...`, h200-v2's bf16-output projections `nvjet_sm90_tst_...`)
    ("gemm_float32", r"f32f32_f32f32|sgemm|gemmsn_tn_kernel<float|nvjet_sm\d+_s"),
    ("gemm", r"nvjet|gemm|cublas|cutlass|xmma|splitkreduce"),
    ("rmsnorm", r"rsqrt"),
    # SAMPLER triton's kernel by name (the chunked sampler's inductor reductions mostly fall into the rest)
    ("sampling", r"exponential|argmax|topk|sort|multinomial|softmax|philox|counter_sample"),
    # the epilogue kernels (GATE_UP_, O_, DOWN_, QKV_EPILOGUE) are a LoRA expand with what they carry (the SiLU
    # product; the residual add and a norm; the q/k norms, the rotary embedding and the cache writes)
    ("low_rank_reductions", r"mul_(\w+_)?sum|sum_mul|gate_up_epilogue|residual_norm_epilogue|qkv_epilogue"),
    ("kv_cache_write", r"index_elementwise|index_put|index_copy|scatter"),
    ("activation", r"silu|gelu"),
    # WEIGHT_PREFETCH's kernel, on its own stream beside the attention (its L2 fills are not in its time)
    ("weight_prefetch", r"l2_prefetch"),
)
MAX_TRACE_BYTES = 512 * 1024 * 1024
HOST_WAIT_US = 20.0  # a gap this long is the host's: inside a CUDA graph, nodes follow each other in ~0.4-2 us


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The trace's events; refuses anything but a regular file under the size limit."""
    if not path.is_file():
        raise SystemExit(f"trace: {path} is not a regular file")
    if path.stat().st_size > MAX_TRACE_BYTES:
        raise SystemExit(f"trace: {path} is larger than {MAX_TRACE_BYTES} bytes")
    raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    data = json.loads(raw)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise SystemExit(f"trace: {path} has no traceEvents list")
    return events


def category(name: str, cat: str) -> str:
    if cat in ("gpu_memset", "gpu_memcpy"):
        return "memset_memcpy"
    lowered = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return label
    return "other"


REDUCTION_PREFIXES = ("triton_per_", "triton_red_")


def reduction_launches(kernels: list[dict[str, Any]], steps: float) -> list[dict[str, Any]]:
    """Inductor's reduction kernels by (name, grid, block): calls per step and mean us per call, by time."""
    return kernel_launches(kernels, steps, REDUCTION_PREFIXES)


def kernel_launches(kernels: list[dict[str, Any]], steps: float,
                    prefixes: tuple[str, ...] = ("",)) -> list[dict[str, Any]]:
    """Kernels whose names start with one of `prefixes` (all, by default) by (name, grid, block): calls per step
    and mean us per call, the most time per step first."""
    launches: dict[tuple, list[float]] = defaultdict(list)
    for kernel in kernels:
        name = kernel.get("name", "")
        if kernel.get("cat", "kernel") == "kernel" and name.startswith(prefixes):
            args = kernel.get("args") or {}
            shape = tuple(tuple(args.get(key) or ()) for key in ("grid", "block"))
            launches[(name, *shape)].append(float(kernel.get("dur", 0)))
    rows = [{"name": name, "grid": list(grid), "block": list(block), "calls_per_step": round(len(d) / steps, 2),
             "us_per_call": round(sum(d) / len(d), 2), "us_per_step": round(sum(d) / steps, 2)}
            for (name, grid, block), d in launches.items()]
    return sorted(rows, key=lambda row: -row["us_per_step"])


def is_readback(event: dict[str, Any]) -> bool:
    """A step's tokens copied to the host (the graph path's one blocking read-back per decode step)."""
    return event.get("cat") == "gpu_memcpy" and "dtoh" in str(event.get("name", "")).lower()


def whole_steps(kernels: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The events from the first read-back up to the last one (excluded), and how many read-backs the window
    holds: each whole step as the previous step's read-back, the host's wait and the step's kernels, so the
    waits between steps are counted once per step. With fewer than two read-backs, all events and that count."""
    at = [i for i, event in enumerate(kernels) if is_readback(event)]
    if len(at) < 2:
        return kernels, len(at)
    return kernels[at[0]:at[-1]], len(at)


def breakdown(events: list[dict[str, Any]], layers: int = 28, steps: float | None = None) -> dict[str, Any]:
    """Per-step figures of the GPU work in `events` (see the module docstring)."""
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset",
                                                                                    "gpu_memcpy")),
                     key=lambda e: (float(e["ts"]), float(e.get("dur", 0))))
    if not kernels:
        raise SystemExit("trace: no GPU kernels in it (a trace without CUDA activity?)")
    steps_from = "given"
    if steps is None:
        kernels, readbacks = whole_steps(kernels)
        if readbacks >= 2:
            steps, steps_from = readbacks - 1, "read-backs (whole steps between the first and the last)"
    span_us = max(float(k["ts"]) + float(k.get("dur", 0)) for k in kernels) - float(kernels[0]["ts"])
    busy_us, gaps_us, gaps_before_attention_us, host_waits_us, end = 0.0, 0.0, 0.0, 0.0, None
    per_category: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "us": 0.0})
    per_name: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "us": 0.0})
    for kernel in kernels:
        start, duration = float(kernel["ts"]), float(kernel.get("dur", 0))
        label = category(kernel.get("name", ""), kernel.get("cat", ""))
        if end is not None and start > end:
            gaps_us += start - end
            if label == "attention":
                gaps_before_attention_us += start - end
            if start - end > HOST_WAIT_US:
                host_waits_us += start - end
        end = max(end or start, start + duration)
        busy_us += duration
        per_category[label]["count"] += 1
        per_category[label]["us"] += duration
        per_name[kernel.get("name", "")]["count"] += 1
        per_name[kernel.get("name", "")]["us"] += duration
    if steps is None:
        attention_calls = per_category["attention"]["count"] if "attention" in per_category else 0
        if not attention_calls:
            raise SystemExit("trace: no attention kernel to count steps by; give --steps")
        steps, steps_from = attention_calls / layers, f"attention kernels / {layers} layers"
    per_step = {label: {"kernels": round(v["count"] / steps, 2), "us": round(v["us"] / steps, 2),
                        "share_of_busy": round(v["us"] / busy_us, 4)}
                for label, v in sorted(per_category.items(), key=lambda item: -item[1]["us"])}
    top = sorted(per_name.items(), key=lambda item: -item[1]["us"])[:40]
    return {"steps": round(steps, 3), "steps_from": steps_from,
            "kernels_per_step": round(len(kernels) / steps, 1), "span_us_per_step": round(span_us / steps, 1),
            "gpu_busy_us_per_step": round(busy_us / steps, 1), "gaps_us_per_step": round(gaps_us / steps, 1),
            "gaps_before_attention_us_per_step": round(gaps_before_attention_us / steps, 1),
            "host_waits_us_per_step": round(host_waits_us / steps, 1),
            "busy_share_of_span": round(busy_us / span_us, 4) if span_us else None,
            "categories": per_step, "reduction_launches": reduction_launches(kernels, steps),
            "kernel_launches": kernel_launches(kernels, steps),
            "top_kernels": [{"name": name, "count": int(v["count"]), "us_total": round(v["us"], 1)} for name, v in top]}


def render(result: dict[str, Any]) -> str:
    lines = [f"{result['steps']} steps ({result['steps_from']}): {result['kernels_per_step']} kernels/step, "
             f"span {result['span_us_per_step']} us/step, GPU busy {result['gpu_busy_us_per_step']} us/step "
             f"({100 * (result['busy_share_of_span'] or 0):.0f} %), gaps {result['gaps_us_per_step']} us/step "
             f"(before attention kernels {result['gaps_before_attention_us_per_step']}, host waits over "
             f"{HOST_WAIT_US:g} us {result['host_waits_us_per_step']})",
             f"{'category':<22}{'kernels/step':>14}{'us/step':>10}{'share':>8}"]
    for label, row in result["categories"].items():
        lines.append(f"{label:<22}{row['kernels']:>14}{row['us']:>10}{100 * row['share_of_busy']:>7.1f}%")
    if result.get("reduction_launches"):
        lines.append("inductor reductions by launch shape (the configuration picked at first run):")
        lines.append(f"{'grid':>12}{'block':>10}{'calls/step':>12}{'us/call':>9}{'us/step':>9}  kernel")
        for row in result["reduction_launches"]:
            lines.append(f"{'x'.join(map(str, row['grid'])) or '?':>12}{'x'.join(map(str, row['block'])) or '?':>10}"
                         f"{row['calls_per_step']:>12}{row['us_per_call']:>9}{row['us_per_step']:>9}  {row['name']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (one attention call each per step)")
    parser.add_argument("--steps", type=float, default=None, help="decode steps in the window (else from attention)")
    parser.add_argument("--json", type=Path, default=None, help="also write the breakdown as JSON here")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers: must be >= 1")
    if args.steps is not None and args.steps <= 0:
        parser.error("--steps: must be > 0")
    result = breakdown(read_trace(args.trace), args.layers, args.steps)
    result["trace"] = str(args.trace)
    print(render(result))
    if args.json:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
