"""Per-step GPU kernel breakdown of a profiled decode window (issue 43, item 1): what a torch-profiler
Chrome trace says one decode step costs, by kind of kernel.

    rollout profile-breakdown TRACE.json[.gz] [--layers N] [--steps N] [--label TEXT] [--json OUT]

Input: a Chrome trace of whole decode steps (the measure notebook's `profile_cell` writes one per profiled
cell; the lab's probe writes 20 ms windows), CUDA graphs included (CUPTI records the kernels inside a
graph). Output, per decode step:
- the kernel count, the GPU busy time (the sum of kernel durations: kernels on two streams at once count each,
  e.g. WEIGHT_PREFETCH's L2 prefetch beside the attention) and the GPU active time (the span less its gaps:
  some kernel running), against the window's span;
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
  `mul_sum` and the expand's `add_mul_select_slice_sum`: the LoRA shrink/expand at rank 16, and the
  hand-written epilogue kernels that carry the LoRA expand), KV-cache write (index kernels), activation
  (SiLU), memset/memcpy, other.
The step count is `--steps`; else the read-backs: with CUDA graphs each step ends with one device-to-host
copy of its tokens (`Memcpy DtoH`), so the window is cut to the whole steps between the first and the last
(lease 30: FA3 launches two kernels a layer, split-KV and its combine, so counting attention kernels gave
twice the steps); else the attention kernels divided by `layers` (one attention call per layer per step),
where a window that cuts a step at either end makes that a fraction, reported as is.
Categories are name heuristics: the kernel names themselves are in the record (top 40 by time) to check
them against.
Also, per inductor reduction kernel (`triton_per_*`, `triton_red_*`) and launch shape (the trace's `grid` and
`block`), its calls per step and mean duration: the launch configuration inductor picked for it when the
compiled piece first ran (lease 28: the same kernel source drew different picks in different compilations,
1.5 us against 10.9 us for one kernel), so two traces' reductions can be told apart by pick, not only by time.

A trace with no GPU kernel (a CPU run) has no breakdown: `NoGPUKernels`, which the notebook reports as
not_applicable (any other refusal as not_measured, with its reason). The record (`breakdown_record`, kind
"decode_step_breakdown") names its trace by path and SHA-256 and its GPU as the trace's `deviceProperties` give
it, so the report's table can be re-derived.
"""
from __future__ import annotations

import gzip
import io
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from rollout_lib.core import sha256_bytes
from rollout_lib.safe_read import loads_json, read_bytes

RECORD_KIND = "decode_step_breakdown"
RECORD_SCHEMA = 1
MAX_TRACE_JSON_BYTES = 1024 * 1024 * 1024  # once decompressed: a gzip bomb stops here
HOST_WAIT_US = 20.0  # a gap this long is the host's: inside a CUDA graph, nodes follow each other in ~0.4-2 us
MAX_LABEL_CHARS = 120
RECORD_ROWS = 20  # kernels and launch shapes a record keeps, the most time first (the trace has them all)
CELL_IN_NAME = re.compile(r"p\d+-r\d+-n\d+-(?:greedy|stochastic)")


class StepProfileError(ValueError):
    """A trace that cannot give a per-step breakdown (not a trace, no GPU kernel, no way to count steps)."""


class NoGPUKernels(StepProfileError):
    """A trace without GPU work (a CPU run): a kernel breakdown is not applicable to it."""


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
def read_trace(path: str | Path, root: str | Path | None = None) -> tuple[dict[str, Any], bytes]:
    """The trace's JSON object and the file's bytes (for its SHA-256): a regular file within safe_read's "trace"
    limit (inside `root` when given), gzip-compressed or plain, at most MAX_TRACE_JSON_BYTES once decompressed."""
    raw = read_bytes(path, kind="trace", root=root)
    data = raw
    if raw[:2] == b"\x1f\x8b":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as unzipped:
                data = unzipped.read(MAX_TRACE_JSON_BYTES + 1)
        except (OSError, EOFError) as exc:
            raise StepProfileError(f"trace: {path} is not a readable gzip file ({exc})") from None
        if len(data) > MAX_TRACE_JSON_BYTES:
            raise StepProfileError(f"trace: {path} decompresses past {MAX_TRACE_JSON_BYTES} bytes")
    trace = loads_json(data, str(path))
    if isinstance(trace, list):  # a bare event list is a valid Chrome trace too
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise StepProfileError(f"trace: {path} has no traceEvents list (not a Chrome trace)")
    return trace, raw


def trace_gpu(trace: dict[str, Any]) -> str:
    """The GPU the trace ran on, from its `deviceProperties` (torch's Kineto traces carry them); else
    not_measured. Several distinct names are joined with ' + '."""
    devices = trace.get("deviceProperties")
    names = sorted({str(d.get("name")) for d in (devices if isinstance(devices, list) else []) if isinstance(d, dict)
                    and d.get("name")})
    return " + ".join(names) if names else "not_measured"


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
    """Kernels (`gpu_events`' form) whose names start with one of `prefixes` (all, by default) by (name, grid,
    block): calls per step and mean us per call, the most time per step first."""
    launches: dict[tuple, list[float]] = defaultdict(list)
    for kernel in kernels:
        name = kernel["name"]
        if kernel["cat"] == "kernel" and name.startswith(prefixes):
            shape = tuple(_dims(kernel["args"].get(key)) for key in ("grid", "block"))
            launches[(name, *shape)].append(kernel["dur"])
    rows = [{"name": name, "grid": list(grid), "block": list(block), "calls_per_step": round(len(d) / steps, 2),
             "us_per_call": round(sum(d) / len(d), 2), "us_per_step": round(sum(d) / steps, 2)}
            for (name, grid, block), d in launches.items()]
    return sorted(rows, key=lambda row: -row["us_per_step"])


def _dims(value: Any) -> tuple:
    """A launch's grid or block as the trace gives it ([x, y, z]); anything else is unknown (empty)."""
    return tuple(value) if isinstance(value, list) and all(isinstance(v, int) for v in value) else ()


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


GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def gpu_events(events: list[Any]) -> list[dict[str, Any]]:
    """The trace's complete GPU events (kernels, memsets, memcpys), each with float `ts` and `dur` (us); an event
    whose times are not numbers is refused, naming it."""
    found = []
    for event in events:
        if not (isinstance(event, dict) and event.get("ph") == "X" and event.get("cat") in GPU_CATEGORIES):
            continue
        try:  # a complete event ("X") has both: one without its duration is refused, not read as 0 us
            ts, dur = float(event["ts"]), float(event["dur"])
        except (KeyError, TypeError, ValueError):
            raise StepProfileError(f"trace: GPU event {str(event.get('name'))[:60]!r} has no numeric ts/dur") from None
        if not (math.isfinite(ts) and math.isfinite(dur) and dur >= 0):
            raise StepProfileError(f"trace: GPU event {str(event.get('name'))[:60]!r} has ts {ts}, dur {dur}")
        args = event.get("args") if isinstance(event.get("args"), dict) else {}
        found.append({**event, "ts": ts, "dur": dur, "name": str(event.get("name", "")), "args": args})
    return found


def breakdown(events: list[dict[str, Any]], layers: int = 28, steps: float | None = None) -> dict[str, Any]:
    """Per-step figures of the GPU work in `events` (see the module docstring)."""
    kernels = sorted(gpu_events(events), key=lambda e: (e["ts"], e["dur"]))
    if not kernels:
        raise NoGPUKernels("trace: no GPU kernels in it (a CPU run, or a trace without CUDA activity)")
    steps_from = "given"
    if steps is None:
        kernels, readbacks = whole_steps(kernels)
        if readbacks >= 2:
            steps, steps_from = readbacks - 1, "read-backs (whole steps between the first and the last)"
    span_us = max(k["ts"] + k["dur"] for k in kernels) - kernels[0]["ts"]
    busy_us, gaps_us, gaps_before_attention_us, host_waits_us, end = 0.0, 0.0, 0.0, 0.0, None
    per_category: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "us": 0.0})
    per_name: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "us": 0.0})
    for kernel in kernels:
        start, duration = kernel["ts"], kernel["dur"]
        label = category(kernel["name"], kernel["cat"])
        if end is not None and start > end:
            gaps_us += start - end
            if label == "attention":
                gaps_before_attention_us += start - end
            if start - end > HOST_WAIT_US:
                host_waits_us += start - end
        end = start + duration if end is None else max(end, start + duration)
        busy_us += duration
        per_category[label]["count"] += 1
        per_category[label]["us"] += duration
        per_name[kernel["name"]]["count"] += 1
        per_name[kernel["name"]]["us"] += duration
    if steps is None:
        attention_calls = per_category["attention"]["count"] if "attention" in per_category else 0
        if not attention_calls:
            raise StepProfileError("trace: no read-backs and no attention kernel to count steps by; "
                                   "give --steps")
        steps, steps_from = attention_calls / layers, f"attention kernels / {layers} layers"
    per_step = {label: {"kernels": round(v["count"] / steps, 2), "us": round(v["us"] / steps, 2),
                        "share_of_busy": round(v["us"] / busy_us, 4) if busy_us else "not_measured"}
                for label, v in sorted(per_category.items(), key=lambda item: -item[1]["us"])}
    top = sorted(per_name.items(), key=lambda item: -item[1]["us"])[:40]
    return {"steps": round(steps, 3), "steps_from": steps_from,
            "kernels_per_step": round(len(kernels) / steps, 1), "span_us_per_step": round(span_us / steps, 1),
            "gpu_busy_us_per_step": round(busy_us / steps, 1),
            "gpu_active_us_per_step": round((span_us - gaps_us) / steps, 1),
            "gaps_us_per_step": round(gaps_us / steps, 1),
            "gaps_before_attention_us_per_step": round(gaps_before_attention_us / steps, 1),
            "host_waits_us_per_step": round(host_waits_us / steps, 1),
            "busy_share_of_span": round(busy_us / span_us, 4) if span_us else "not_measured",
            "categories": per_step, "reduction_launches": reduction_launches(kernels, steps),
            "kernel_launches": kernel_launches(kernels, steps),
            "top_kernels": [{"name": name, "count": int(v["count"]), "us_total": round(v["us"], 1)} for name, v in top]}


def _percent(share: Any, digits: int = 0) -> str:
    return f"{100 * share:.{digits}f}%" if isinstance(share, int | float) else str(share)


def render(result: dict[str, Any]) -> str:
    lines = [f"{result['steps']} steps ({result['steps_from']}): {result['kernels_per_step']} kernels/step, "
             f"span {result['span_us_per_step']} us/step, GPU busy {result['gpu_busy_us_per_step']} us/step "
             f"({_percent(result['busy_share_of_span'])} of the span; streams that overlap count each), "
             f"GPU active {result['gpu_active_us_per_step']} us/step, gaps {result['gaps_us_per_step']} us/step "
             f"(before attention kernels {result['gaps_before_attention_us_per_step']}, host waits over "
             f"{HOST_WAIT_US:g} us {result['host_waits_us_per_step']})",
             f"{'category':<22}{'kernels/step':>14}{'us/step':>10}{'share':>8}"]
    for label, row in result["categories"].items():
        lines.append(f"{label:<22}{row['kernels']:>14}{row['us']:>10}{_percent(row['share_of_busy'], 1):>8}")
    if result.get("reduction_launches"):
        lines.append("inductor reductions by launch shape (the configuration picked at first run):")
        lines.append(f"{'grid':>12}{'block':>10}{'calls/step':>12}{'us/call':>9}{'us/step':>9}  kernel")
        for row in result["reduction_launches"]:
            lines.append(f"{'x'.join(map(str, row['grid'])) or '?':>12}{'x'.join(map(str, row['block'])) or '?':>10}"
                         f"{row['calls_per_step']:>12}{row['us_per_call']:>9}{row['us_per_step']:>9}  {row['name']}")
    return "\n".join(lines)


def breakdown_record(path: str | Path, layers: int, *, steps: float | None = None, label: str = "",
                     cell: str | None = None, root: str | Path | None = None) -> dict[str, Any]:
    """The breakdown of the trace at `path` as an evidence record: kind, the trace's path, size and SHA-256,
    its GPU, the cell (given, else read from the file name, else not_measured), a free-text label and the
    figures of `breakdown`. Raises StepProfileError (no GPU kernel, ...) or safe_read.UnsafeInput."""
    check_label(label)
    if cell is not None and not CELL_IN_NAME.fullmatch(cell):
        raise StepProfileError(f"cell: {cell[:40]!r} is not allowed; allowed: a cell id such as p128-r64-n1-greedy "
                               "(p<prompt>-r<response>-n<samples>-greedy|stochastic)")
    if layers < 1:
        raise StepProfileError(f"layers: {layers} is not allowed; allowed: an integer >= 1")
    if steps is not None and not steps > 0:
        raise StepProfileError(f"steps: {steps} is not allowed; allowed: a number > 0 (or leave it out)")
    trace, raw = read_trace(path, root)
    found = CELL_IN_NAME.search(Path(path).name)
    figures = breakdown(trace["traceEvents"], layers, steps)
    return {"kind": RECORD_KIND, "schema": RECORD_SCHEMA, "label": label or "not_measured",
            "cell": cell or (found.group(0) if found else "not_measured"), "gpu": trace_gpu(trace),
            "layers": layers, "trace": {"path": str(path), "bytes": len(raw), "sha256": sha256_bytes(raw),
                                        "started_utc": trace_start_utc(trace)},
            **figures, "kernel_launches": figures["kernel_launches"][:RECORD_ROWS],
            "top_kernels": figures["top_kernels"][:RECORD_ROWS]}


def trace_start_utc(trace: dict[str, Any]) -> str:
    """When the profiled window began: the trace's `baseTimeNanoseconds` (torch's Kineto traces carry it) plus its
    earliest event's `ts` (us after that base); else not_measured. The report orders a cell's traces by it."""
    import datetime as dt

    base = trace.get("baseTimeNanoseconds")
    times = [e["ts"] for e in trace["traceEvents"] if isinstance(e, dict) and isinstance(e.get("ts"), int | float)
             and not isinstance(e.get("ts"), bool)]
    if not isinstance(base, int) or isinstance(base, bool) or base <= 0 or not times:
        return "not_measured"
    try:
        return dt.datetime.fromtimestamp(base / 1e9 + min(times) / 1e6, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):  # a time no calendar holds
        return "not_measured"


def check_label(label: str) -> None:
    if len(label) > MAX_LABEL_CHARS or not label.isprintable():
        raise StepProfileError(f"label: {label[:40]!r}... is not allowed; allowed: printable text of at most "
                               f"{MAX_LABEL_CHARS} characters")


# The report's columns: (heading, the categories summed into it); what no column names goes to "other".
COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GEMMs", ("gemm", "gemm_float32")),
    ("attention", ("attention",)),
    ("norms", ("rmsnorm",)),
    ("LoRA terms and epilogues", ("low_rank_reductions",)),
    ("sampling", ("sampling",)),
    ("L2 prefetch (side stream)", ("weight_prefetch",)),
)


def column_us(record: dict[str, Any]) -> dict[str, float]:
    """us per step in each of COLUMNS' groups, then "other" (every category no column names)."""
    categories = record["categories"]
    named = {c for _, group in COLUMNS for c in group}
    out = {heading: round(sum(categories.get(c, {}).get("us", 0.0) for c in group), 1)
           for heading, group in COLUMNS}
    out["other"] = round(sum(v["us"] for c, v in categories.items() if c not in named), 1)
    return out
