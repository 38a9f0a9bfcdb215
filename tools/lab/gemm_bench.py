"""The decode step's projection GEMMs alone, cuBLAS against GEMM_KERNEL "triton_skinny" (issue 43): for each of a
layer's four projections of the study's actor, with the shrink's rows appended as LORA_SHRINK "in_base_gemm"
appends them (three bf16 parts of A), at the decode step's row counts, the time per GEMM inside a CUDA graph of
back-to-back calls (as a decode step's graph replays them: no launch from the host between them), and the bytes
read per second against the GPU's nominal bandwidth (`rollout_lib/measure/floor.py`).

    python tools/lab/gemm_bench.py --out outputs/perf/decode-fewest/gemm-sweep.json [--rows 4 16] [--calls 56] \
        [--weights 28] [--sweep]

Each GEMM's graph is warmed up, captured, replayed `--repeats` times; the median replay over `--calls` is the
time per call. The calls cycle through `--weights` distinct weight matrices (default 28, a decode step's layers:
~240 MB for qkv, more than the GPU's L2, so each call reads its weight from memory as a step does; with 1, lease
33's bench, every call after the first read it from L2). The two kernels' results are compared too
(`max_abs_diff`: float32 sums in two orders). `--sweep`: the skinny kernel under each launch configuration of
SWEEP too (`skinny_gemm.Launch`: features per program, K per iteration, warps, stages, slices of K), the fastest
named per (projection, rows), the file rewritten after each projection (a job cut short keeps what it measured).
Writes JSON atomically; prints one line per (projection, rows). A GPU only; bad input is refused in one line
before anything runs."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rollout_lib.core import write_json_atomic  # noqa: E402

DEFAULT_PARAMS = ROOT / "params" / "rollout-runtime-v2.yaml"


def projection_shapes(arch: Any, rank: int) -> dict[str, tuple[int, int]]:
    """(outputs with the shrink's three bf16 parts of A appended, inner) per projection group of one layer."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    hidden, inner = arch.hidden_size, arch.intermediate_size
    return {"qkv": (q + 2 * kv + 3 * 3 * rank, hidden), "o": (hidden + 3 * rank, q),
            "gate_up": (2 * inner + 3 * 2 * rank, hidden), "down": (hidden + 3 * rank, inner)}


# the launch configurations `--sweep` times (features per program, K per iteration, (warps, stages), slices of K:
# None is splits_for's choice, "double" twice that): 3 x 3 x 3 x 2 = 54 per projection, one Triton compilation each
SWEEP_BLOCK_N = (32, 64, 128)
SWEEP_BLOCK_K = (64, 128, 256)
SWEEP_WARPS_STAGES = ((4, 3), (4, 4), (8, 4))
SWEEP_SPLITS = (None, "double")


def sweep_configs(features: int, inner: int, multiprocessors: int) -> list[Any]:
    """SWEEP's launch configurations for one projection, its slices resolved (doubled up to MAX_SPLITS, and only
    while each slice keeps a whole iteration), without repeats."""
    from rollout_lib.backends import skinny_gemm

    configs = []
    for block_n in SWEEP_BLOCK_N:
        for block_k in SWEEP_BLOCK_K:
            auto = skinny_gemm.splits_for(features, inner, multiprocessors, block_n, block_k)
            for warps, stages in SWEEP_WARPS_STAGES:
                for choice in SWEEP_SPLITS:
                    splits = auto if choice is None else min(2 * auto, skinny_gemm.MAX_SPLITS)
                    if splits * block_k > inner:
                        continue
                    config = skinny_gemm.Launch(block_n, block_k, warps, stages, splits)
                    if config not in configs:
                        configs.append(config)
    return configs


def time_in_graph(fn, calls: int, repeats: int) -> float:
    """Median seconds per call of `fn` (called with the call's index) captured `calls` times back to back in one
    CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for index in range(3):
            fn(index)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(calls):
            fn(index)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / calls)
    return statistics.median(times)


def l2_flush(device: Any) -> Any:
    """A call that reads a buffer of twice the GPU's L2 into one float (graph-capturable: its output is allocated
    once): after it, what a kernel loads comes from HBM, as in a decode step, where ~43 MB of one layer's weights
    pass between two calls of one epilogue kernel."""
    import torch

    elements = 2 * torch.cuda.get_device_properties(device).L2_cache_size // 4
    scratch = torch.ones(elements, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    return lambda: torch.sum(scratch, dim=0, out=total)


def time_cold(fn, flush, calls: int, repeats: int) -> float:
    """Median seconds per call of `fn` with the L2 flushed before each call (`l2_flush`): the graph of flush + call
    timed less the graph of the flush alone (each `calls` times), so the call's loads come from HBM."""
    both = time_in_graph(lambda index: (flush(), fn(index)), calls, repeats)
    return both - time_in_graph(lambda index: flush(), calls, repeats)


def time_config(fn, calls: int, repeats: int) -> dict[str, Any]:
    """`time_in_graph` in microseconds ({"us": ...}), or, for a launch configuration the GPU cannot hold (Triton's
    OutOfResources at its first launch, before any capture: lease 36's sweep stopped on one needing 294,912 bytes of
    shared memory on an H100's 232,448), {"us": "not_measured", "not_run": why}."""
    from triton.runtime.errors import OutOfResources

    try:
        return {"us": time_in_graph(fn, calls, repeats) * 1e6}
    except OutOfResources as error:
        return {"us": "not_measured", "not_run": str(error)}


def fastest(timed: list[dict[str, Any]]) -> dict[str, Any] | str:
    """The fastest of the configurations that ran, or "not_measured" where none did."""
    ran = [entry for entry in timed if isinstance(entry["us"], float)]
    return min(ran, key=lambda entry: entry["us"]) if ran else "not_measured"


def run(params: Path, rows_list: list[int], calls: int, repeats: int, weights: int = 28, sweep: bool = False,
        out: Path | None = None) -> dict[str, Any]:
    import dataclasses

    import torch

    from rollout_lib.backends import skinny_gemm
    from rollout_lib.measure.floor import HBM_BYTES_PER_S
    from rollout_lib.models.actor import mm_float32
    from rollout_lib.study.prereg import load
    from rollout_lib.study.workload import Workload

    study = load(params)
    arch = Workload(study).arch
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = HBM_BYTES_PER_S.get(gpu)
    skinny_gemm.prepare(device)
    generator = torch.Generator(device=device).manual_seed(43)
    report: dict[str, Any] = {"gpu": gpu, "bandwidth_bytes_per_s": bandwidth or "not_measured",
                              "calls_per_graph": calls, "repeats": repeats, "distinct_weights": weights,
                              "torch": torch.__version__, "rows": [], "sweep": [] if sweep else "not_measured"}
    for name, (features, inner) in projection_shapes(arch, study.actor.lora.rank).items():
        stack = [(torch.randn(features, inner, device=device, generator=generator) * 0.02).bfloat16()
                 for _ in range(weights)]
        weight_bytes = features * inner * 2
        floor_us = weight_bytes / bandwidth * 1e6 if bandwidth else "not_measured"
        configs = sweep_configs(features, inner, multiprocessors) if sweep else []
        for rows in rows_list:
            x = torch.randn(rows, inner, device=device, generator=generator).bfloat16()
            cublas_s = time_in_graph(lambda i, x=x, w=stack: mm_float32(x, w[i % weights].t()), calls, repeats)
            skinny_s = time_in_graph(lambda i, x=x, w=stack: skinny_gemm.skinny_mm_float32(x, w[i % weights]),
                                     calls, repeats)
            diff = float((mm_float32(x, stack[0].t()) - skinny_gemm.skinny_mm_float32(x, stack[0])).abs().max())
            row = {"projection": name, "rows": rows, "features": features, "inner": inner,
                   "splits": skinny_gemm.splits_for(features, inner, multiprocessors),
                   "weight_bytes": weight_bytes, "cublas_us": cublas_s * 1e6, "skinny_us": skinny_s * 1e6,
                   "cublas_bytes_per_s": weight_bytes / cublas_s, "skinny_bytes_per_s": weight_bytes / skinny_s,
                   "floor_us": floor_us, "max_abs_diff": diff}
            timed = [{**dataclasses.asdict(config),
                      **time_config(lambda i, x=x, w=stack, c=config: skinny_gemm.launch(x, w[i % weights], c),
                                    calls, repeats)} for config in configs]
            best_text = ""
            if sweep:
                best = fastest(timed)
                row["sweep_best"] = best
                report["sweep"].append({"projection": name, "rows": rows, "configs": timed})
                ran = sum(isinstance(entry["us"], float) for entry in timed)
                best_text = (f"; sweep best {best['us']:.2f} us (block_n {best['block_n']}, block_k "
                             f"{best['block_k']}, {best['warps']} warps, {best['stages']} stages, {best['splits']} "
                             f"slices) of {ran} run, {len(timed) - ran} the GPU cannot hold"
                             if isinstance(best, dict) else "; no sweep configuration ran on this GPU")
            report["rows"].append(row)
            print(f"{name} x{rows}: cuBLAS {row['cublas_us']:.2f} us ({row['cublas_bytes_per_s'] / 1e12:.2f} TB/s), "
                  f"skinny {row['skinny_us']:.2f} us ({row['skinny_bytes_per_s'] / 1e12:.2f} TB/s, {row['splits']} "
                  f"slices), floor {floor_us if isinstance(floor_us, str) else round(floor_us, 2)}"
                  f" us; max |diff| {diff:.2e}{best_text}", flush=True)
        if out is not None:  # what is measured so far survives a job cut short, beside the sealed file to come
            write_json_atomic(partial_path(out), report, overwrite=True)
    return report


def partial_path(out: Path) -> Path:
    """Where the projections measured so far are kept while the run goes on (rewritten after each projection,
    removed once `out`, written once, holds the whole run)."""
    return out.with_name(out.stem + ".partial" + out.suffix)


def bench_parser(description: str, calls_help: str, distinct: str, distinct_help: str) -> argparse.ArgumentParser:
    """The options this tool and epilogue_bench share: --out, --params, --rows, --calls, --repeats and the count of
    distinct operand sets (`distinct`: weights here, layers there), each with its default (28: a step's layers)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--params", type=Path, default=DEFAULT_PARAMS, help="the preregistration (its actor)")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16], help="decode rows (1-16; default 4 16)")
    parser.add_argument("--calls", type=int, default=56, help=f"{calls_help} per captured graph (default 56)")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays timed (default 20)")
    parser.add_argument(f"--{distinct}", type=int, default=28, help=distinct_help)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__.split("\n\n")[0], "GEMMs", "weights",
                          "distinct weights the calls cycle through (default 28: a step's layers, past L2)")
    parser.add_argument("--sweep", action="store_true", help="time the skinny kernel's launch configurations too")
    return parser


def refuse_bad_input(parser: argparse.ArgumentParser, args: argparse.Namespace, distinct: str) -> None:
    """A bench's arguments checked before anything runs (this tool's and epilogue_bench's): one line naming the
    field and what is allowed, exit 2. `distinct`: the option naming how many distinct operand sets the calls
    cycle through (--weights here, --layers there)."""
    if any(not 1 <= rows <= 16 for rows in args.rows):
        parser.error(f"--rows: {args.rows} is not allowed; allowed: row counts from 1 to 16 (the kernel's rows)")
    if args.calls < 1 or args.repeats < 1:
        parser.error(f"--calls/--repeats: {args.calls}/{args.repeats} is not allowed; allowed: integers >= 1")
    count = getattr(args, distinct)
    if not 1 <= count <= args.calls:
        parser.error(f"--{distinct}: {count} is not allowed; allowed: 1 to --calls ({args.calls})")
    if not args.params.is_file():
        parser.error(f"--params: {args.params} is not allowed; allowed: a preregistration file that exists")
    if args.out.exists():
        parser.error(f"--out: {args.out} exists; allowed: a new file (evidence files are never rewritten)")
    import torch

    if not torch.cuda.is_available():
        parser.error("a CUDA GPU is needed: torch.cuda.is_available() is False here")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_bad_input(parser, args, "weights")
    write_json_atomic(args.out, run(args.params, args.rows, args.calls, args.repeats, args.weights, args.sweep,
                                    args.out))
    partial_path(args.out).unlink(missing_ok=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
