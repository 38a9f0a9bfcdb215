"""Programmatic dependent launch (PDL) between a decode step's cuBLAS GEMM and the Triton epilogue after it, timed
alone before any engine setting is built (issue 43 candidate).

Why: every kernel of the picked engine's step is a chain of dependent memory round trips (lease 39: the o/down
epilogue's time is "its chain of dependent global-memory trips, not B's bandwidth"; every GEMM ~5.5 us whatever its
size, lease 34), and ~110 of a step's 350 kernels are epilogues right after a GEMM. With PDL (sm_90) a kernel
launched with the programmatic-serialization attribute may start while the kernel before it finishes: what it loads
before `griddepcontrol.wait` (the layer's LoRA B and norm weight, which no kernel of the step writes) overlaps the
GEMM's tail; what it loads after (the GEMM's output, the residual) is ordered after the GEMM's writes. Inductor's
PDL (`+pdl`, lease 28) waits first in every kernel and lost 0.09-0.51 ms a step; this asks whether the weights-first
placement gains, and whether cuBLAS's kernels let a dependent start before they end at all.

The model of a layer: x [rows, 1,024] bf16 -> cuBLAS bf16 GEMM with a float32 output (`mm_float32`) against W
[1,024 + 3 r, 1,024] (the o/down projections' shape with the shrink's rows appended, r = 16) -> one Triton kernel a
row (8 warps, as O_/DOWN_EPILOGUE's): the rank terms (A's three parts) times B [r, 1,024] float32 rank-major, the
LoRA add and the residual in bf16, the row's RMS norm times the norm weight -> the next layer's x. `--layers`
distinct layers (default 28, ~62 MB of W: past an H100's L2) in one CUDA graph, replayed `--repeats` times; the
median replay per layer. Modes of the epilogue: `off` (no PDL), `wait_first` (PDL, the wait before any load:
Inductor's placement), `weights_first` (PDL, B and the norm weight loaded before the wait). Beside them the GEMMs
alone and the epilogues alone (each on a fixed input), so a pair's overlap reads as pair - (GEMM + epilogue). Every
mode's chain, run once from one input, must give the `off` chain's bits (`same_bits`): the same operations, only
where the wait sits.

    python tools/lab/pdl_bench.py --out outputs/perf/decode-s/pdl-bench.json [--rows 4 16] [--calls 56] \
        [--layers 28] [--repeats 20]

A GPU of compute capability 9.0 or later; bad input is refused in one line before anything runs. Writes JSON
atomically; prints one line per (rows, mode)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rollout_lib.core import write_json_atomic  # noqa: E402
from tools.lab.gemm_bench import bench_parser, refuse_bad_input, time_in_graph  # noqa: E402

FEATURES = 1024  # the hidden size: o's and down's outputs, the norm's row
RANK = 16
PARTS = 3  # the shrink's three bf16 parts of A, appended to the GEMM's output features
WARPS = 8
MODES = {"off": 0, "wait_first": 1, "weights_first": 2}  # WAIT: where the kernel waits for the GEMM (0: no PDL)


@functools.cache
def _kernel():
    """The model epilogue (see the module), defined once per process."""
    import triton
    import triton.language as tl

    @triton.jit
    def pdl_epilogue_kernel(y_ptr, b_ptr, w_ptr, h_ptr, h_out_ptr, x_out_ptr, y_row, eps,
                            FEATURES: tl.constexpr, RANK: tl.constexpr, WAIT: tl.constexpr):
        m = tl.program_id(0)
        n = tl.arange(0, FEATURES)
        r = tl.arange(0, RANK)
        if WAIT == 1:
            tl.extra.cuda.gdc_wait()
        b = tl.load(b_ptr + r[:, None] * FEATURES + n[None, :])  # the layer's B: no kernel of the step writes it
        weight = tl.load(w_ptr + n).to(tl.float32)
        if WAIT == 2:
            tl.extra.cuda.gdc_wait()  # what follows reads what the GEMM (and the kernels before it) wrote
        row = y_ptr + m * y_row
        base = tl.load(row + n).to(tl.bfloat16)
        xa = (tl.load(row + FEATURES + r) + tl.load(row + FEATURES + RANK + r)) + tl.load(row + FEATURES + 2 * RANK + r)
        low = tl.sum(xa[:, None] * b, axis=0)
        o = (base.to(tl.float32) + low).to(tl.bfloat16)
        h = (tl.load(h_ptr + m * FEATURES + n).to(tl.float32) + o.to(tl.float32)).to(tl.bfloat16)
        tl.store(h_out_ptr + m * FEATURES + n, h)
        stream = h.to(tl.float32)
        scale = tl.rsqrt(tl.sum(stream * stream, axis=0) / FEATURES + eps)
        x = (weight * (stream * scale).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
        tl.store(x_out_ptr + m * FEATURES + n, x)

    return pdl_epilogue_kernel


def epilogue(y, b, w, h, h_out, x_out, mode: str) -> None:
    """One model epilogue launch over the rows of `y` [rows, FEATURES + PARTS RANK] float32, PDL as `mode` says."""
    wait = MODES[mode]
    _kernel()[(y.shape[0],)](y, b, w, h, h_out, x_out, y.stride(0), 1e-6, FEATURES=FEATURES, RANK=RANK, WAIT=wait,
                             launch_pdl=wait > 0, num_warps=WARPS)


def layers(rows: int, count: int, seed: int = 45) -> dict[str, Any]:
    """`count` layers' operands on the GPU (W, B, norm weight, residual; the outputs each layer writes) and x0."""
    import torch

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device=device, generator=generator) * scale).to(dtype)

    return {"w": [randn(FEATURES + PARTS * RANK, FEATURES, scale=0.03) for _ in range(count)],
            "b": [randn(RANK, FEATURES, scale=0.05, dtype=torch.float32) for _ in range(count)],
            "norm": [1 + randn(FEATURES, scale=0.1) for _ in range(count)],
            "h": [randn(rows, FEATURES) for _ in range(count)],
            "h_out": [torch.empty(rows, FEATURES, dtype=torch.bfloat16, device=device) for _ in range(count)],
            "x": [torch.empty(rows, FEATURES, dtype=torch.bfloat16, device=device) for _ in range(count + 1)],
            "x0": randn(rows, FEATURES)}


def chain(ops: dict[str, Any], mode: str):
    """The step's model as a function of the call index i (`time_in_graph`'s): layer i % layers' GEMM on the previous
    layer's x (x0 for the first), then its epilogue writing this layer's x."""
    from rollout_lib.models.actor import mm_float32

    count = len(ops["w"])

    def call(i: int) -> None:
        layer = i % count
        source = ops["x0"] if layer == 0 else ops["x"][layer]
        y = mm_float32(source, ops["w"][layer].t())
        epilogue(y, ops["b"][layer], ops["norm"][layer], ops["h"][layer], ops["h_out"][layer], ops["x"][layer + 1],
                 mode)

    return call


def gemms_alone(ops: dict[str, Any]):
    """Layer i % layers' GEMM on x0, as a function of the call index (no epilogue, nothing depends on it)."""
    from rollout_lib.models.actor import mm_float32

    return lambda i: mm_float32(ops["x0"], ops["w"][i % len(ops["w"])].t())


def epilogues_alone(ops: dict[str, Any], y, mode: str):
    """Layer i % layers' epilogue on one fixed GEMM output `y`, as a function of the call index."""
    count = len(ops["w"])
    return lambda i: epilogue(y, ops["b"][i % count], ops["norm"][i % count], ops["h"][i % count],
                              ops["h_out"][i % count], ops["x"][1], mode)


def measure_mode(ops: dict[str, Any], y, mode: str, calls: int, repeats: int) -> tuple[dict[str, Any], list]:
    """One mode's figures (us a layer: the epilogue alone, the GEMM + epilogue chain) and its chain's bits, from
    one eager pass over the layers from x0; a launch the driver refuses under capture is recorded, not invented."""
    import torch

    figures: dict[str, Any] = {}
    try:
        figures["epilogue_alone_us"] = time_in_graph(epilogues_alone(ops, y, mode), calls, repeats) * 1e6
        step = chain(ops, mode)
        for i in range(len(ops["w"])):
            step(i)
        torch.cuda.synchronize()
        bits = [t.clone() for t in ops["h_out"] + ops["x"][1:]]
        figures["pair_us"] = time_in_graph(step, calls, repeats) * 1e6
        return figures, bits
    except Exception as error:
        figures.setdefault("epilogue_alone_us", "not_measured")
        figures["pair_us"] = "not_measured"
        figures["not_run"] = f"{type(error).__name__}: {error}"[:500]
        return figures, []


def run(params: Path, rows_list: list[int], calls: int, repeats: int, count: int) -> dict[str, Any]:
    import torch
    import triton

    from rollout_lib.models.actor import mm_float32

    device = torch.device("cuda")
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "triton": triton.__version__, "calls_per_graph": calls, "repeats": repeats,
                              "layers": count, "features": FEATURES, "rank": RANK, "warps": WARPS,
                              "params": str(params), "rows": []}
    for rows in rows_list:
        ops = layers(rows, count)
        entry: dict[str, Any] = {"rows": rows, "gemm_alone_us": time_in_graph(gemms_alone(ops), calls, repeats) * 1e6}
        y = mm_float32(ops["x0"], ops["w"][0].t())
        reference: list = []
        for mode in MODES:
            figures, bits = measure_mode(ops, y, mode, calls, repeats)
            reference = reference or bits
            if bits:
                figures["same_bits_as_off"] = all(torch.equal(a, b) for a, b in zip(reference, bits, strict=True))
            if isinstance(figures["pair_us"], float) and isinstance(figures["epilogue_alone_us"], float):
                figures["overlap_us"] = entry["gemm_alone_us"] + figures["epilogue_alone_us"] - figures["pair_us"]
            entry[mode] = figures
            print(f"x{rows} {mode}: {figures} (GEMM alone {entry['gemm_alone_us']:.2f} us)", flush=True)
        report["rows"].append(entry)
    return report


def build_parser():
    return bench_parser(__doc__.split("\n\n")[0], "layers (a GEMM and its epilogue)", "layers",
                        "distinct layers the calls cycle through (default 28: a step's, W past an H100's L2)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_bad_input(parser, args, "layers")
    import torch

    if torch.cuda.get_device_capability()[0] < 9:
        parser.error(f"a GPU of compute capability 9.0 or later is needed (PDL): {torch.cuda.get_device_name()} is "
                     f"{'.'.join(map(str, torch.cuda.get_device_capability()))}")
    write_json_atomic(args.out, run(args.params, args.rows, args.calls, args.repeats, args.layers))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
