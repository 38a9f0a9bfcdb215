"""The decode step's hand-written epilogue kernels alone, under each launch configuration (issue 43): the o/down
kernel (`norm_epilogue`: LoRA expand + residual + RMSNorm, one program per row) by its warps, on the GEMM's output,
over slices of each row (`o_down_slices`: NORM_EPILOGUE_ROW "slices", by features a program and warps) and on its
split-K partials (`o_down_splitk`: GEMM_SPLIT_K "auto"'s slices for the o projection on this GPU),
gate_up's (`mlp_epilogue`: both LoRA expands + SiLU product) by its features per program and warps, and qkv's
(`qkv_epilogue`: LoRA expand + q/k norms + rotary + cache writes, one program per row and head) by its warps, at
the study's actor's shapes and the decode step's row counts, B stored rank-major as the engine stores it; and the
decode attention kernel (`decode_attention`, ATTENTION_BACKEND "triton") by its slices, columns per iteration,
warps and software-pipeline stages, over a p128 cell's cache (`attention`: 192 columns, 160 in use) and a p512
cell's (`attention_long`: 768, 640 in use); and its DECODE_PREFIX "shared" kernel (`decode_attention.attend_shared`)
over the same caches, the rows in GRPO groups of 4 sharing a prompt of 128 / 512 columns (`attention_shared`,
`attention_shared_long`: the same columns in use as `attention` / `attention_long`, so their times compare).

    python tools/lab/epilogue_bench.py --out outputs/perf/decode-warps/epilogue-bench.json [--rows 4 16] \
        [--calls 56] [--layers 28] [--kernels attention_long attention_shared_long]

Why: a step's trace gives each kernel's time at the one configuration the module names; a configuration is chosen
here by measurement, a minute of GPU, not one lease at a time (lease 36: the o/down kernel 4.9 us a call on its 32
warps, 2.5-2.7 on 8). Each configuration's graph is warmed up, captured with `--calls` back-to-back calls cycling
through `--layers` distinct operand sets (a step's layers), replayed `--repeats` times; the median replay over
`--calls` is the time per call (`gemm_bench.time_in_graph`); `cold_l2_us` is the same with the L2 flushed before
each call (`gemm_bench.time_cold`: in the engine ~43 MB of a layer's weights pass between two calls, so B and the
residual come from HBM: lease 37 timed the o/down kernel at 3.9 us a call in the engine, 2.55 here warm). Each
configuration's output is compared with the module's default configuration's on the same operands
(`max_abs_diff`: warps change the order of the float32 sums only). The file is written once at the end (progress
in `<out>.partial.json` after each kernel); one line per (kernel, rows). A GPU only; bad input is refused in one
line before anything runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rollout_lib.core import write_json_atomic  # noqa: E402
from tools.lab.gemm_bench import (  # noqa: E402
    bench_parser,
    l2_flush,
    partial_path,
    refuse_bad_input,
    time_cold,
    time_in_graph,
)

KERNELS = ("o_down", "o_down_slices", "o_down_splitk", "gate_up", "qkv", "attention", "attention_long",
           "attention_shared", "attention_shared_long")
# norm_epilogue's kernels: one program a row on the GEMM's output, one a slice of a row (NORM_EPILOGUE_ROW
# "slices"), one a row on the GEMM's split-K partials
NORM_KERNELS = ("o_down", "o_down_slices", "o_down_splitk")
# the launch configurations timed: the o/down kernel's warps (one row of H features a program), gate_up's
# (features per program, warps) with 16 rows a program, qkv's warps (one row's head of D features a program)
NORM_WARPS = (4, 8, 16, 32)
SLICE_CONFIGS = tuple((features, warps) for features in (64, 128, 256) for warps in (2, 4, 8))
GATE_UP_CONFIGS = tuple((block_n, warps) for block_n in (32, 64, 128) for warps in (2, 4, 8))
QKV_WARPS = (1, 2, 4, 8)
CACHE_LENGTH = 256  # the qkv kernel's k/v caches: columns per row (it writes one, column CACHE_LENGTH // 2)
# the attention kernel's caches: (columns, the column this step writes) of a p128-r64 and a p512-r256 cell's step
ATTENTION_CACHES = {"attention": (192, 159), "attention_long": (768, 639), "attention_shared": (192, 159),
                    "attention_shared_long": (768, 639)}
# the shared kernels' GRPO groups: rows a prompt, and the prompt's end (the first decode column) in each cache
SHARED_ROWS = 4
SHARED_PREFIX_END = {"attention_shared": 128, "attention_shared_long": 512}
# its launch configurations: slices ("auto": decode_attention.splits_for's), columns per iteration, warps, stages
ATTENTION_CONFIGS = tuple((splits, block_n, warps, 2) for splits in ("auto", 1, 2, 4, 8, 16) for block_n in (32, 64)
                          for warps in (2, 4, 8)) \
    + tuple(("auto", block_n, warps, stages) for block_n, stages in ((64, 1), (64, 3), (64, 4), (128, 1), (128, 2),
                                                                     (128, 3)) for warps in (2, 4))
# (lease 40: ~2 us a loop iteration whatever the slices; 128 columns at 4 stages would need 256 KiB of shared memory)


def _operands(kernel: str, arch: Any, rank: int, rows: int, generator: Any, splits: int = 1) -> dict[str, Any]:
    """One layer's operands of `kernel` at `rows` rows (one position each: a decode step): the GEMM's float32
    output with the shrink's three parts appended (`o_down_splitk`: `splits` partial sums of it), B rank-major
    ([features, ranks] with the features contiguous), the o/down kernel's residual stream and norm weight, the qkv
    kernel's q/k norm weights, rotary cos/sin, k/v caches and the column it writes."""
    import torch

    device = generator.device
    hidden, inner = arch.hidden_size, arch.intermediate_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator)

    if kernel in NORM_KERNELS:
        both = randn(splits, rows, hidden + 3 * rank) if kernel == "o_down_splitk" else randn(rows, hidden + 3 * rank)
        return {"both": both, "lora_b": (randn(rank, hidden) * 0.02).t(), "h": randn(rows, hidden).bfloat16(),
                "weight": (1 + randn(hidden) * 0.05).bfloat16()}
    if kernel == "gate_up":
        return {"both": randn(rows, 2 * inner + 6 * rank), "lora_b": (randn(2 * rank, 2 * inner) * 0.02).t(),
                "inter": inner}
    heads, kv_heads, head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    if kernel in ATTENTION_CACHES:
        columns, write = ATTENTION_CACHES[kernel]
        operands = {"q": randn(rows, kv_heads, heads // kv_heads, head_dim).bfloat16(),
                    "cache_k": randn(rows, kv_heads, columns, head_dim).bfloat16(),
                    "cache_v": randn(rows, kv_heads, columns, head_dim).bfloat16(),
                    "pad": torch.zeros(rows, dtype=torch.long, device=device),
                    "write": torch.tensor([write], dtype=torch.long, device=device)}
        if kernel in SHARED_PREFIX_END:
            operands["prefix_end"] = torch.tensor([SHARED_PREFIX_END[kernel]], dtype=torch.long, device=device)
        return operands
    features = (heads + 2 * kv_heads) * head_dim
    angle = randn(rows, head_dim // 2)
    cache = torch.zeros(rows, kv_heads, CACHE_LENGTH, head_dim, dtype=torch.bfloat16, device=device)
    return {"both": randn(rows, features + 9 * rank), "lora_b": (randn(3 * rank, features) * 0.02).t(),
            "q_norm": (1 + randn(head_dim) * 0.05).bfloat16(), "k_norm": (1 + randn(head_dim) * 0.05).bfloat16(),
            "cos": torch.cat([angle.cos()] * 2, dim=-1).bfloat16(),
            "sin": torch.cat([angle.sin()] * 2, dim=-1).bfloat16(),
            "cache_k": cache, "cache_v": cache.clone(), "heads": heads,
            "write": torch.tensor([CACHE_LENGTH // 2], dtype=torch.long, device=device)}


def _call(kernel: str, operands: dict[str, Any], config: dict[str, Any]) -> torch.Tensor:
    from rollout_lib.backends import decode_attention, mlp_epilogue, norm_epilogue, qkv_epilogue

    if kernel in ATTENTION_CACHES:
        launch = decode_attention.Launch(block_n=config["block_n"], warps=config["warps"], stages=config["stages"],
                                         splits=None if config["splits"] == "auto" else config["splits"])
        if "prefix_end" in operands:
            return decode_attention.attend_shared(operands["q"], operands["cache_k"], operands["cache_v"],
                                                  operands["pad"], operands["write"], operands["prefix_end"],
                                                  SHARED_ROWS, 1.0 / operands["q"].shape[-1] ** 0.5, launch)
        return decode_attention.attend(operands["q"], operands["cache_k"], operands["cache_v"], operands["pad"],
                                       operands["write"], 1.0 / operands["q"].shape[-1] ** 0.5, launch)
    if kernel in NORM_KERNELS:
        return norm_epilogue.launch(operands["both"], operands["lora_b"], operands["h"], operands["weight"], 2.0,
                                    1e-6, warps=config["warps"], slices=kernel == "o_down_slices",
                                    slice_features=config.get("slice_features"))
    if kernel == "gate_up":
        return mlp_epilogue.launch(operands["both"], operands["lora_b"], 2.0, operands["inter"],
                                   block_n=config["block_n"], warps=config["warps"])
    return qkv_epilogue.launch(operands["both"], operands["lora_b"], operands["q_norm"], operands["k_norm"],
                               operands["cos"], operands["sin"], operands["cache_k"], operands["cache_v"],
                               operands["write"], operands["heads"], 1, 2.0, 1e-6, warps=config["warps"])


def configs(kernel: str) -> list[dict[str, int]]:
    """The configurations timed for `kernel`, the module's default among them."""
    if kernel == "o_down_slices":
        return [{"slice_features": features, "warps": warps} for features, warps in SLICE_CONFIGS]
    if kernel in NORM_KERNELS:
        return [{"warps": warps} for warps in NORM_WARPS]
    if kernel == "gate_up":
        return [{"block_n": block_n, "warps": warps} for block_n, warps in GATE_UP_CONFIGS]
    if kernel in ATTENTION_CACHES:
        return [{"splits": splits, "block_n": block_n, "warps": warps, "stages": stages}
                for splits, block_n, warps, stages in ATTENTION_CONFIGS]
    return [{"warps": warps} for warps in QKV_WARPS]


def default_config(kernel: str) -> dict[str, int]:
    from rollout_lib.backends import decode_attention, mlp_epilogue, norm_epilogue, qkv_epilogue

    if kernel in ATTENTION_CACHES:
        return {"splits": "auto", "block_n": decode_attention.BLOCK_N, "warps": decode_attention.WARPS,
                "stages": decode_attention.STAGES}
    if kernel == "o_down_slices":
        return {"slice_features": norm_epilogue.SLICE_FEATURES, "warps": norm_epilogue.SLICE_WARPS}
    if kernel in NORM_KERNELS:
        return {"warps": norm_epilogue.WARPS}
    if kernel == "gate_up":
        return {"block_n": mlp_epilogue.BLOCK_N, "warps": mlp_epilogue.WARPS}
    return {"warps": qkv_epilogue.WARPS}


def o_splits(arch: Any, rank: int, multiprocessors: int) -> int:
    """GEMM_SPLIT_K "auto"'s slices of the o projection's GEMM (its partials are what `o_down_splitk` reads)."""
    from rollout_lib.backends.compact_qwen3 import gemm_splits

    return gemm_splits(arch.hidden_size + 3 * rank, arch.num_attention_heads * arch.head_dim, "auto",
                       multiprocessors)


def run(params: Path, rows_list: list[int], calls: int, repeats: int, layers: int = 28,
        out: Path | None = None, kernels: tuple[str, ...] = KERNELS) -> dict[str, Any]:
    import torch
    import triton

    from rollout_lib.backends import decode_attention, norm_epilogue
    from rollout_lib.study.prereg import load
    from rollout_lib.study.workload import Workload

    study = load(params)
    arch, rank = Workload(study).arch, study.actor.lora.rank
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(43)
    flush = l2_flush(device)
    norm_epilogue.prepare(device)  # the "slices" kernel's counters
    decode_attention.prepare(device)  # the attention kernel's
    splits = o_splits(arch, rank, torch.cuda.get_device_properties(device).multi_processor_count)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "triton": triton.__version__, "calls_per_graph": calls, "repeats": repeats,
                              "distinct_layers": layers, "rank": rank, "o_down_splitk_splits": splits, "rows": [],
                              "best": []}
    for kernel in kernels:
        default = default_config(kernel)
        for rows in rows_list:
            if kernel in SHARED_PREFIX_END and rows % SHARED_ROWS:
                print(f"{kernel} x{rows}: not timed (rows in groups of {SHARED_ROWS})", flush=True)
                continue
            stack = [_operands(kernel, arch, rank, rows, generator, splits) for _ in range(layers)]
            want = _call(kernel, stack[0], default).float()
            timed = []
            for config in configs(kernel):
                seconds = time_in_graph(lambda i, k=kernel, s=stack, c=config: _call(k, s[i % layers], c), calls,
                                        repeats)
                cold = time_cold(lambda i, k=kernel, s=stack, c=config: _call(k, s[i % layers], c), flush, calls,
                                 repeats)
                diff = float((_call(kernel, stack[0], config).float() - want).abs().max())
                timed.append({"kernel": kernel, "rows": rows, "config": config, "default": config == default,
                              "us": seconds * 1e6, "cold_l2_us": cold * 1e6, "max_abs_diff_vs_default": diff})
            report["rows"].extend(timed)
            best = min(timed, key=lambda entry: entry["us"])
            coldest = min(timed, key=lambda entry: entry["cold_l2_us"])
            at_default = next((entry for entry in timed if entry["default"]), None)
            report["best"].append({"kernel": kernel, "rows": rows, "config": best["config"], "us": best["us"],
                                   "default_us": at_default["us"] if at_default else "not_measured",
                                   "cold_l2_config": coldest["config"], "cold_l2_us": coldest["cold_l2_us"],
                                   "default_cold_l2_us": at_default["cold_l2_us"] if at_default else "not_measured"})
            print(f"{kernel} x{rows}: best {best['us']:.2f} us at {best['config']} (L2 flushed: "
                  f"{coldest['cold_l2_us']:.2f} at {coldest['config']}); default {default} "
                  + (f"{at_default['us']:.2f} / {at_default['cold_l2_us']:.2f} us; " if at_default else "not timed; ")
                  + ", ".join(f"{entry['config']} {entry['us']:.2f} / {entry['cold_l2_us']:.2f}" for entry in timed),
                  flush=True)
        if out is not None:  # what is measured so far survives a job cut short, beside the sealed file to come
            write_json_atomic(partial_path(out), report, overwrite=True)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__.split("\n\n")[0], "kernel calls", "layers",
                          "distinct operand sets the calls cycle through (default 28: a step's layers)")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), metavar="KERNEL",
                        help=f"the kernels to time (default all: {', '.join(KERNELS)})")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [kernel for kernel in args.kernels if kernel not in KERNELS]
    if unknown:
        parser.error(f"--kernels: {' '.join(unknown)} is not allowed; allowed: {', '.join(KERNELS)}")
    refuse_bad_input(parser, args, "layers")
    write_json_atomic(args.out, run(args.params, args.rows, args.calls, args.repeats, args.layers, args.out,
                                    tuple(dict.fromkeys(args.kernels))))
    partial_path(args.out).unlink(missing_ok=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
