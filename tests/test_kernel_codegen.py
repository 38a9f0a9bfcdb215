"""The hand-written epilogue kernels compiled for a Hopper GPU (sm_90a) on any machine with Triton: Triton's own
compiler and the ptxas it ships, no GPU and no driver. It catches what the CPU interpreter cannot: a kernel that
does not compile for the GPU, that spills registers, or (gate_up's and qkv's) that waits out its loads of LoRA B
one after another (read from the SASS, disassembled by the nvdisasm Triton ships). Lease 34 (H100) found the o/down
kernel at 10.5 us a call with B row-major (each rank term's loads a B row apart across a warp); lease 35, with B
rank-major, at 5.0 us: loaded term by term, two terms in flight at a time; lease 36, B as one tile, 2.5-2.7 us on 8
warps and 4.9 on 32.

Arguments are specialized as Triton specializes them at a launch: an integer equal to 1 becomes a constant, one
divisible by 16 and every pointer (allocations are 256-byte aligned) carry `tt.divisibility` 16, except the
arguments a kernel names in `do_not_specialize`. Skipped where Triton is not installed (the CPU CI)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs Triton (its compiler and ptxas) to compile for sm_90a; not installed")


_COMPILE = r"""
import json, re, subprocess, sys
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = json.loads(sys.argv[1])
name = spec["module"] if "." in spec["module"] else "rollout_lib.backends." + spec["module"]  # or a lab tool's
module = __import__(name, fromlist=["_kernel"])
kernel = getattr(module, spec.get("factory", "_kernel"))()
signature, constants, attrs = {}, dict(spec["constexprs"]), {}
for index, name in enumerate(kernel.arg_names):
    if name not in spec["constexprs"] and name not in spec["args"]:  # a constexpr left at its default (PDL=False)
        spec["constexprs"][name] = constants[name] = kernel.params[index].default
    if name in spec["constexprs"]:
        signature[name] = "constexpr"
        continue
    value = spec["args"][name]
    free = name in kernel.do_not_specialize
    if isinstance(value, str):
        signature[name] = value
        attrs[(index,)] = [["tt.divisibility", 16]]
    elif isinstance(value, float):
        signature[name] = "fp32"
    elif value == 1 and not free:
        signature[name] = "constexpr"
        constants[name] = 1
    else:
        signature[name] = "i32"
        if value % 16 == 0 and not free:
            attrs[(index,)] = [["tt.divisibility", 16]]
compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": spec["num_warps"], **spec.get("options", {})})
ptx = compiled.asm["ptx"]
# The ptxas and nvdisasm Triton itself used (TRITON_PTXAS_PATH where set, else its own copy): the PTX's version
# follows that ptxas, and another one may refuse it (lease 43's device: exit 255 from the bundled copy).
ptxas, nvdisasm = triton.knobs.nvidia.ptxas.path, triton.knobs.nvidia.nvdisasm.path
ptx_file = Path(sys.argv[2]) / "kernel.ptx"
ptx_file.write_text(ptx)
done = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx_file), "-o", str(Path(sys.argv[2]) / "ptxas.cubin")],
                      capture_output=True, text=True)
if done.returncode != 0:
    sys.exit(f"{ptxas} exit {done.returncode}: {done.stderr[-2000:]}")
report = done.stderr
cubin = Path(sys.argv[2]) / "kernel.cubin"
cubin.write_bytes(compiled.asm["cubin"])
sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
order = [("load" if "LDG" in line else "fma") for line in sass.splitlines() if "LDG" in line or "FFMA" in line]
lines = ptx.splitlines()
waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
ptx_loads = [i for i, line in enumerate(lines) if re.search(r"\bld\.global", line)]
sass_lines = sass.splitlines()
acquire = next((i for i, line in enumerate(sass_lines) if "ACQBULK" in line), None)  # griddepcontrol.wait's SASS
print(json.dumps({"loads": Counter(re.findall(r"ld\.global(?:\.[a-z]+\d*)*\.v?\d*\.?b\d+", ptx)),
                  "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
                  "spill_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)),
                  "global_loads": order.count("load"),
                  "loads_before_first_fma": order.index("fma") if "fma" in order else len(order),
                  "global_stores": len(re.findall(r"\bst\.global", ptx)),
                  "bulk_prefetches_ptx": ptx.count("cp.async.bulk.prefetch.L2.global"),
                  "bulk_prefetches_sass": sass.count("UBLKPF.L2"),
                  "ptx_waits": len(waits),
                  "ptx_loads_before_wait": sum(i < waits[0] for i in ptx_loads) if waits else None,
                  "ptx_loads_after_wait": sum(i > waits[0] for i in ptx_loads) if waits else None,
                  "sass_loads_before_wait": (sum("LDG" in line for line in sass_lines[:acquire])
                                             if acquire is not None else None),
                  "ptx_prefetches_before_wait": (sum("cp.async.bulk.prefetch.L2" in line for line in lines[:waits[0]])
                                                 if waits else None),
                  "sass_prefetches_before_wait": (sum("UBLKPF.L2" in line for line in sass_lines[:acquire])
                                                  if acquire is not None else None)}))
"""


def _compile_for_hopper(module: str, args: dict, constexprs: dict, num_warps: int, tmp_path: Path,
                        factory: str = "_kernel", num_stages: int | None = None) -> dict:
    """The kernel of `rollout_lib.backends.<module>` compiled for sm_90a with `args` (name -> "*fp32" / "*bf16" /
    "*i64" for a pointer, an int or a float as a launch passes them) and `constexprs`: the PTX's global loads by
    width, ptxas's registers and spill bytes, and from the SASS (nvdisasm) the global loads and how many of them
    issue before the first float32 FMA. In a fresh process: Triton's interpreter, which the kernel tests
    switch on, and its compiler do not share one (each decides at import how `@triton.jit` functions are built).
    `factory`: the module's function that defines the kernel; `num_stages`: its software pipeline's (None:
    Triton's default)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    spec = {"module": module, "args": args, "constexprs": constexprs, "num_warps": num_warps, "factory": factory,
            "options": {} if num_stages is None else {"num_stages": num_stages}}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(spec), str(tmp_path)], capture_output=True,
                          text=True, env=env, cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["loads"] = Counter(result["loads"])
    return result


def _issues_its_loads_up_front(result: dict) -> bool:
    """At least half of the kernel's global loads issue before its first FMA, so their round trips overlap: lease
    35's o/down, gate_up and qkv kernels loaded B term by term in a loop, ptxas kept two or three terms in flight
    (6 of 31, 32 of 164 and 13 of ~110 loads before the first FMA) and the kernels took 5.0, 7.6 and 5.4 us a
    call, waiting out one round trip after another."""
    return result["loads_before_first_fma"] >= 0.5 * result["global_loads"]


@pytest.mark.parametrize("splits", [1, 4])
def test_the_norm_epilogue_compiles_for_hopper_without_spills_with_b_rank_major(splits, tmp_path):
    """O_/DOWN_EPILOGUE at Qwen3-0.6B's o projection (1,024 features, rank 16) at the module's warps, B stored
    rank-major (b_row 1, b_col 1,024) as the engine stores it: it compiles for sm_90a without spills. No check of
    its load order: lease 36's bench (H100) timed it at 4.9 us a call on 32 warps, where 13 of its 19 loads issue
    before the first FMA, and at 2.5-2.7 us on 8 warps, where 6 of 31 do (the norm's row sum across 32 warps
    costs more than the loads' overlap saves), so that count does not predict this kernel's time."""
    from rollout_lib.backends import norm_epilogue

    hidden, rank = 1024, 16
    args = {"both_ptr": "*fp32", "b_ptr": "*fp32", "h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "hidden": hidden, "split_stride": 4 * (hidden + 3 * rank), "both_row": hidden + 3 * rank,
            "h_row": hidden, "out_rows": 4, "out_row": hidden, "scaling": 2.0, "eps": 1e-6, "b_row": 1,
            "b_col": hidden}
    constexprs = {"RANK": rank, "SPLITS": splits, "ORACLE_ROUNDING": False, "BLOCK_H": hidden, "RANK_BLOCK": rank}
    result = _compile_for_hopper("norm_epilogue", args, constexprs, norm_epilogue.WARPS, tmp_path)
    assert result["global_loads"] > 0, result
    assert result["spill_bytes"] == 0, result


def test_the_norm_epilogue_over_slices_compiles_for_hopper_without_spills(tmp_path):
    """NORM_EPILOGUE_ROW "slices" at Qwen3-0.6B's o projection (8 slices of 128 features a row) at the module's
    warps, B rank-major: it compiles for sm_90a, with its atomic count and the last program's whole-row norm,
    without spills."""
    from rollout_lib.backends import norm_epilogue

    hidden, rank = 1024, 16
    args = {"both_ptr": "*fp32", "b_ptr": "*fp32", "h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "sums_ptr": "*fp32", "lock_ptr": "*i32", "hidden": hidden, "split_stride": 4 * (hidden + 3 * rank),
            "both_row": hidden + 3 * rank, "b_row": 1, "b_col": hidden, "h_row": hidden, "out_rows": 4,
            "out_row": hidden, "scaling": 2.0, "eps": 1e-6}
    slices = hidden // norm_epilogue.SLICE_FEATURES
    constexprs = {"RANK": rank, "SPLITS": 1, "ORACLE_ROUNDING": False, "BLOCK_N": norm_epilogue.SLICE_FEATURES,
                  "SLICES": slices, "SLICES_BLOCK": slices, "BLOCK_H": hidden, "RANK_BLOCK": rank}
    result = _compile_for_hopper("norm_epilogue", args, constexprs, norm_epilogue.SLICE_WARPS, tmp_path,
                                 factory="_slices_kernel")
    assert result["global_loads"] > 0, result
    assert result["spill_bytes"] == 0, result


def test_the_gate_up_epilogue_loads_b_up_front_with_b_rank_major(tmp_path):
    """GATE_UP_EPILOGUE at Qwen3-0.6B's gate_up (3,072 intermediate features a part, rank 16 a part), B
    rank-major: gate's and up's B tiles and the shrink's parts are loaded before the first FMA; no spills."""
    from rollout_lib.backends import mlp_epilogue

    inter, rank = 3072, 16
    args = {"both_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16", "rows": 4, "inter": inter,
            "both_row": 2 * inter + 6 * rank, "out_row": inter, "scaling": 2.0, "b_row": 1, "b_col": 2 * inter}
    constexprs = {"RANK": rank, "LOW": 2 * rank, "ACTIVATION": True, "ORACLE_ROUNDING": False,
                  "BLOCK_M": mlp_epilogue.BLOCK_M, "BLOCK_N": mlp_epilogue.BLOCK_N, "RANK_BLOCK": rank}
    result = _compile_for_hopper("mlp_epilogue", args, constexprs, mlp_epilogue.WARPS, tmp_path)
    assert _issues_its_loads_up_front(result), result
    assert result["spill_bytes"] == 0, result


def test_the_qkv_epilogue_compiles_for_hopper_without_spills_with_b_rank_major(tmp_path):
    """QKV_EPILOGUE at Qwen3-0.6B's qkv (16 query heads, 8 kv heads of 128, rank 16 a part), B rank-major, at the
    module's warps: it compiles, spills nothing, and issues at least half its loads before its first FMA.
    Rank-major B makes a warp's 32 loads of a term one 128-byte line instead of 32 lines, which the PTX does not
    show (lease 35's trace: 7.1 -> 5.4 us a call). On 4 warps it also issued fewer load instructions than with B
    row-major (19 against 24); on the 1 warp lease 37's bench timed fastest (2.15 / 2.39 us against 2.41 / 3.58 on
    4) it issues more (49 against 28: each one line for the warp), so the count is no longer checked."""
    from rollout_lib.backends import qkv_epilogue

    heads, kv_heads, head_dim, rank = 16, 8, 128, 16
    features = (heads + 2 * kv_heads) * head_dim
    args = {"both_ptr": "*fp32", "b_ptr": "*fp32", "q_norm_ptr": "*bf16", "k_norm_ptr": "*bf16", "cos_ptr": "*bf16",
            "sin_ptr": "*bf16", "write_ptr": "*i64", "q_ptr": "*bf16", "cache_k_ptr": "*bf16",
            "cache_v_ptr": "*bf16", "length": 1, "both_row": features + 9 * rank, "cos_row": head_dim,
            "sin_row": head_dim, "cache_batch": kv_heads * 640 * head_dim, "cache_head": 640 * head_dim,
            "cache_column": head_dim, "scaling": 2.0, "eps": 1e-6}
    constexprs = {"HEADS": heads, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "RANK": rank,
                  "ORACLE_ROUNDING": False, "RANK_BLOCK": rank}
    rank_major = _compile_for_hopper("qkv_epilogue", {**args, "b_row": 1, "b_col": features}, constexprs,
                                     qkv_epilogue.WARPS, tmp_path)
    assert _issues_its_loads_up_front(rank_major), rank_major
    assert rank_major["spill_bytes"] == 0


def _compile_decode_attention(columns: int, splits: int, block_n: int, warps: int, tmp_path: Path,
                              num_stages: int | None = None, shared_rows: int | None = None,
                              pdl: bool | None = None, weight_regions: int = 0) -> dict:
    """The decode attention kernel at Qwen3-0.6B's attention (8 kv heads of 128, two query heads each) over a cache
    of `columns`, compiled for sm_90a (`_compile_for_hopper`); with `shared_rows`, DECODE_PREFIX shared's kernel
    for blocks of that many rows; with `pdl`, the plain kernel's PDL constexprs as `attend` passes them; with
    `weight_regions`, the plain kernel asking the L2 for that many regions of weights (WEIGHT_PREFETCH_BY
    attention)."""
    from rollout_lib.backends import decode_attention

    kv_heads, group, head_dim = 8, 2, 128
    args = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pad_ptr": "*i64", "write_ptr": "*i64",
            **({"prefix_ptr": "*i64"} if shared_rows else {}),
            "out_ptr": "*bf16", "part_ptr": "*fp32", "stat_ptr": "*fp32", "lock_ptr": "*i32",
            **({} if shared_rows else {"weights_ptr": "*i64"}),
            "q_batch": kv_heads * group * head_dim, "q_head": group * head_dim,
            "cache_batch": kv_heads * columns * head_dim, "cache_head": columns * head_dim, "cache_column": head_dim,
            "scale_log2": 0.1275}
    constexprs = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_N": block_n, "SPLITS": splits, "INTERPRETED": False}
    if shared_rows:
        constexprs |= {"ROWS": shared_rows, "BLOCK_T": decode_attention.shared_tile(shared_rows, group)}
        return _compile_for_hopper("decode_attention", args, constexprs, warps, tmp_path, factory="_shared_kernel",
                                   num_stages=num_stages)
    constexprs["BLOCK_G"] = decode_attention.BLOCK_G
    if pdl is not None:
        constexprs |= {"PDL": pdl, "LANES": decode_attention.PREFETCH_LANES}
    if weight_regions:
        constexprs |= {"WEIGHT_REGIONS": weight_regions, "WEIGHT_LANES": decode_attention.WEIGHT_LANES}
    return _compile_for_hopper("decode_attention", args, constexprs, warps, tmp_path, num_stages=num_stages)


@pytest.mark.parametrize("pdl", [False, True])
def test_the_decode_attention_asks_the_l2_for_the_layers_weights_once_per_region(pdl, tmp_path):
    """WEIGHT_PREFETCH_BY attention at 8 regions (a "through_next_qkv" plan with LORA_SHRINK in_base_gemm), at the
    long cache's launch, with and without PDL's k/v prefetch: each region becomes one predicated bulk L2 prefetch
    per thread (PTX and SASS), on top of what the kernel issued without them, with no store and no spill added;
    under PDL the weights' prefetches come before the wait, as the k/v ones do."""
    from rollout_lib.backends import decode_attention

    config = decode_attention.launch_for(768)
    (tmp_path / "plain").mkdir()
    (tmp_path / "asking").mkdir()
    plain = _compile_decode_attention(768, 4, config.block_n, config.warps, tmp_path / "plain", config.stages,
                                      pdl=pdl)
    asking = _compile_decode_attention(768, 4, config.block_n, config.warps, tmp_path / "asking", config.stages,
                                       pdl=pdl, weight_regions=8)
    assert asking["bulk_prefetches_ptx"] == plain["bulk_prefetches_ptx"] + 8, (plain, asking)
    assert asking["bulk_prefetches_sass"] == plain["bulk_prefetches_sass"] + 8, (plain, asking)
    assert asking["global_stores"] == plain["global_stores"] and asking["spill_bytes"] == 0, asking
    if pdl:
        assert asking["ptx_waits"] == 1, asking
        assert asking["ptx_prefetches_before_wait"] == asking["bulk_prefetches_ptx"], asking
        assert asking["sass_prefetches_before_wait"] == asking["bulk_prefetches_sass"], asking


@pytest.mark.parametrize("pdl", [False, True])
def test_the_decode_attention_asks_the_l2_for_its_slice_before_waiting_under_dependent_launch(pdl, tmp_path):
    """ATTENTION_DEPENDENT_LAUNCH "prefetch_kv" at the long cache's launch (768 columns, 4 slices): with PDL the
    kernel loads its slice's bounds (pad, write) and issues its bulk L2 prefetches of k and v (PTX and SASS) before
    its one `griddepcontrol.wait`, and q and the cache after it; without PDL no wait and no prefetch. No spills."""
    from rollout_lib.backends import decode_attention

    config = decode_attention.launch_for(768)
    result = _compile_decode_attention(768, 4, config.block_n, config.warps, tmp_path, config.stages, pdl=pdl)
    assert result["spill_bytes"] == 0 and result["global_loads"] > 0, result
    if not pdl:
        assert (result["ptx_waits"], result["bulk_prefetches_ptx"], result["bulk_prefetches_sass"]) == (0, 0, 0)
        return
    assert result["ptx_waits"] == 1 and result["bulk_prefetches_ptx"] > 0, result
    assert result["ptx_prefetches_before_wait"] == result["bulk_prefetches_ptx"], result
    assert result["sass_prefetches_before_wait"] == result["bulk_prefetches_sass"] > 0, result
    assert result["ptx_loads_before_wait"] == 2 and result["sass_loads_before_wait"] == 2, result  # pad, write
    assert result["ptx_loads_after_wait"] > 0, result


@pytest.mark.parametrize("splits", [1, 8])
def test_the_decode_attention_compiles_for_hopper_without_spills(splits, tmp_path):
    """ATTENTION_BACKEND "triton" over a 640-column cache, at the module's warps, with one slice (no merge) and with
    8 (the merge by the last program, its atomic count): it compiles for sm_90a without spills."""
    from rollout_lib.backends import decode_attention

    result = _compile_decode_attention(640, splits, decode_attention.BLOCK_N, decode_attention.WARPS, tmp_path)
    assert result["global_loads"] > 0, result
    assert result["spill_bytes"] == 0, result


@pytest.mark.parametrize("columns", [192, 768])
def test_the_decode_attention_at_the_launch_its_cache_length_chooses_compiles_without_spills(columns, tmp_path):
    """ATTENTION_LAUNCH "by_columns": the short cache's launch (128 columns an iteration, 4 warps, 3 stages, one
    slice) and the long cache's (DEFAULT: 64 columns, 2 warps, 2 stages, the slices `splits_for` gives 4 rows on
    132 SMs) compile for sm_90a without spills."""
    from rollout_lib.backends import decode_attention

    config = decode_attention.launch_for(columns)
    splits = decode_attention.splits_for(4 * 8, columns, 132, config.block_n)
    result = _compile_decode_attention(columns, splits, config.block_n, config.warps, tmp_path, config.stages)
    assert (splits == 1) == (columns < decode_attention.SHORT_CACHE_COLUMNS)
    assert result["global_loads"] > 0, result
    assert result["spill_bytes"] == 0, result


@pytest.mark.parametrize("splits", [1, 8])
def test_the_decode_attention_from_the_qkv_projection_compiles_for_hopper_without_spills(splits, tmp_path):
    """ATTENTION_BACKEND "triton_qkv" at Qwen3-0.6B's qkv and attention (16 query heads, 8 kv heads of 128, rank 16
    a part, B rank-major) over a 640-column cache, at the module's warps, with one slice and with 8: it compiles for
    sm_90a without spills."""
    from rollout_lib.backends import decode_attention

    heads, kv_heads, head_dim, rank, columns = 16, 8, 128, 16, 640
    features = (heads + 2 * kv_heads) * head_dim
    args = {"both_ptr": "*fp32", "b_ptr": "*fp32", "q_norm_ptr": "*bf16", "k_norm_ptr": "*bf16", "cos_ptr": "*bf16",
            "sin_ptr": "*bf16", "cache_k_ptr": "*bf16", "cache_v_ptr": "*bf16", "pad_ptr": "*i64",
            "write_ptr": "*i64", "out_ptr": "*bf16", "part_ptr": "*fp32", "stat_ptr": "*fp32", "lock_ptr": "*i32",
            "both_row": features + 9 * rank, "b_row": 1, "b_col": features, "cos_row": head_dim,
            "sin_row": head_dim, "cache_batch": kv_heads * columns * head_dim, "cache_head": columns * head_dim,
            "cache_column": head_dim, "scaling": 2.0, "eps": 1e-6, "scale_log2": 0.1275}
    constexprs = {"HEADS": heads, "KV_HEADS": kv_heads, "GROUP": heads // kv_heads, "HEAD_DIM": head_dim,
                  "RANK": rank, "RANK_BLOCK": rank, "ORACLE_ROUNDING": False, "BLOCK_G": decode_attention.BLOCK_G,
                  "BLOCK_N": decode_attention.BLOCK_N, "SPLITS": splits, "INTERPRETED": False}
    result = _compile_for_hopper("decode_attention", args, constexprs, decode_attention.WARPS, tmp_path,
                                 factory="_fused_kernel")
    assert result["global_loads"] > 0, result
    assert result["spill_bytes"] == 0, result


@pytest.mark.parametrize(("rows", "splits", "launch_name"), [(4, 1, "DEFAULT"), (4, 8, "DEFAULT"), (8, 8, "DEFAULT"),
                                                             (4, 4, "SHORT_CACHE"), (4, 8, "SHARED_LONG_CACHE")])
def test_the_shared_prompt_decode_attention_compiles_for_hopper_without_spills(rows, splits, launch_name, tmp_path):
    """DECODE_PREFIX "shared" with the Triton kernel at Qwen3-0.6B's attention over a 768-column cache (p512-r256),
    blocks of 4 rows (a 16-row tile: the n4 cells) and of 8 (the same tile, full), with one slice and with 8, at
    the module's launch; at ATTENTION_LAUNCH by_columns' short-cache launch (128 columns an iteration, 4 warps,
    3 stages), as the engine launches it with both settings; and at by_columns_shared's long-cache launch (128
    columns, 4 warps, one stage): it compiles for sm_90a without spills."""
    from rollout_lib.backends import decode_attention

    launch = getattr(decode_attention, launch_name)
    result = _compile_decode_attention(768, splits, launch.block_n, launch.warps, tmp_path, launch.stages,
                                       shared_rows=rows)
    assert result["global_loads"] > 0, result
    assert result["spill_bytes"] == 0, result


def test_the_weight_prefetch_kernel_compiles_to_one_bulk_l2_prefetch_per_region(tmp_path):
    """WEIGHT_PREFETCH's kernel for sm_90a at 8 regions (a "through_next_qkv" plan with LORA_SHRINK in_base_gemm):
    each region's chunks become one predicated `cp.async.bulk.prefetch.L2.global` per thread (ptxas serializes a
    warp's 32 through the uniform datapath: UBLKPF.L2), nothing is stored and nothing spills."""
    from rollout_lib.backends import weight_prefetch

    result = _compile_for_hopper("weight_prefetch", {"table_ptr": "*i64"},
                                 {"REGIONS": 8, "THREADS": weight_prefetch.THREADS, "ALIGN": weight_prefetch.ALIGN},
                                 weight_prefetch.THREADS // 32, tmp_path)
    assert (result["bulk_prefetches_ptx"], result["bulk_prefetches_sass"]) == (8, 8), result
    assert result["global_stores"] == 0 and result["spill_bytes"] == 0, result


@pytest.mark.parametrize("mode", ["off", "wait_first", "weights_first"])
def test_the_pdl_bench_epilogue_waits_where_its_mode_says(mode, tmp_path):
    """tools/lab/pdl_bench.py's model epilogue for sm_90a at its 8 warps: `off` has no `griddepcontrol.wait` (it is
    launched without PDL); `wait_first` waits before any global load (Inductor's placement); `weights_first` loads
    B and the norm weight before its one wait and what the GEMM wrote (its output, the residual) after it, in the
    PTX and in ptxas's SASS (the wait is ACQBULK there). No spills. The bench's timings mean what they say only if
    the wait sits there."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools.lab import pdl_bench

    args = {"y_ptr": "*fp32", "b_ptr": "*fp32", "w_ptr": "*bf16", "h_ptr": "*bf16", "h_out_ptr": "*bf16",
            "x_out_ptr": "*bf16", "y_row": pdl_bench.FEATURES + pdl_bench.PARTS * pdl_bench.RANK, "eps": 1e-6}
    constexprs = {"FEATURES": pdl_bench.FEATURES, "RANK": pdl_bench.RANK, "WAIT": pdl_bench.MODES[mode]}
    result = _compile_for_hopper("tools.lab.pdl_bench", args, constexprs, pdl_bench.WARPS, tmp_path)
    assert result["spill_bytes"] == 0 and result["global_loads"] > 0, result
    if mode == "off":
        assert result["ptx_waits"] == 0, result
    elif mode == "wait_first":
        assert (result["ptx_waits"], result["ptx_loads_before_wait"], result["sass_loads_before_wait"]) == (1, 0, 0)
        assert result["ptx_loads_after_wait"] > 0, result
    else:  # B [16, 1024] float32 as 16 v4 loads and the weight as one; ptxas keeps them before the wait (ACQBULK)
        assert result["ptx_waits"] == 1 and result["ptx_loads_before_wait"] == 17, result
        assert result["sass_loads_before_wait"] == 17 and result["ptx_loads_after_wait"] > 0, result


@pytest.mark.parametrize("module", ["norm_epilogue", "mlp_epilogue", "qkv_epilogue"])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_epilogues_load_b_before_waiting_for_the_gemm_under_dependent_launch(module, pdl, tmp_path):
    """DEPENDENT_LAUNCH: the o/down kernel (Qwen3-0.6B's o, rank 16), the gate_up kernel (3,072 features a part)
    and the qkv kernel (16 + 2 x 8 heads of 128), compiled for sm_90a with PDL, load B (and o/down the norm's
    weight) before their one `griddepcontrol.wait` (ACQBULK in the SASS: ptxas keeps them there) and the GEMM's
    output after it; without PDL (the default) no wait at all. No spills either way."""
    if module == "qkv_epilogue":
        heads, kv_heads, head_dim, rank = 16, 8, 128, 16
        features = (heads + 2 * kv_heads) * head_dim
        args = {"both_ptr": "*fp32", "b_ptr": "*fp32", "q_norm_ptr": "*bf16", "k_norm_ptr": "*bf16",
                "cos_ptr": "*bf16", "sin_ptr": "*bf16", "write_ptr": "*i64", "q_ptr": "*bf16", "cache_k_ptr": "*bf16",
                "cache_v_ptr": "*bf16", "length": 1, "both_row": features + 9 * rank, "b_row": 1, "b_col": features,
                "cos_row": head_dim, "sin_row": head_dim, "cache_batch": kv_heads * 640 * head_dim,
                "cache_head": 640 * head_dim, "cache_column": head_dim, "scaling": 2.0, "eps": 1e-6}
        constexprs = {"HEADS": heads, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "RANK": rank,
                      "ORACLE_ROUNDING": False, "RANK_BLOCK": rank, "PDL": pdl}
        from rollout_lib.backends.qkv_epilogue import WARPS
    elif module == "norm_epilogue":
        hidden, rank = 1024, 16
        args = {"both_ptr": "*fp32", "b_ptr": "*fp32", "h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                "hidden": hidden, "split_stride": 4 * (hidden + 3 * rank), "both_row": hidden + 3 * rank,
                "h_row": hidden, "out_rows": 4, "out_row": hidden, "scaling": 2.0, "eps": 1e-6, "b_row": 1,
                "b_col": hidden}
        constexprs = {"RANK": rank, "SPLITS": 1, "ORACLE_ROUNDING": False, "BLOCK_H": hidden, "RANK_BLOCK": rank,
                      "PDL": pdl}
        from rollout_lib.backends.norm_epilogue import WARPS
    else:
        inter, rank = 3072, 16
        args = {"both_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16", "rows": 4, "inter": inter,
                "both_row": 2 * inter + 6 * rank, "out_row": inter, "scaling": 2.0, "b_row": 1, "b_col": 2 * inter}
        from rollout_lib.backends import mlp_epilogue
        from rollout_lib.backends.mlp_epilogue import WARPS

        constexprs = {"RANK": rank, "LOW": 2 * rank, "ACTIVATION": True, "ORACLE_ROUNDING": False,
                      "BLOCK_M": mlp_epilogue.BLOCK_M, "BLOCK_N": mlp_epilogue.BLOCK_N, "RANK_BLOCK": rank,
                      "PDL": pdl}
    result = _compile_for_hopper(module, args, constexprs, WARPS, tmp_path)
    assert result["spill_bytes"] == 0 and result["global_loads"] > 0, result
    if not pdl:
        assert result["ptx_waits"] == 0, result
        return
    assert result["ptx_waits"] == 1 and result["ptx_loads_before_wait"] > 0, result
    assert result["sass_loads_before_wait"] == result["ptx_loads_before_wait"], result
    assert result["ptx_loads_after_wait"] > 0, result


def test_the_sampler_kernel_compiles_for_hopper_without_spills_and_hashes_in_32_bits(tmp_path):
    """SAMPLER "triton" at Qwen3's vocabulary (75 chunks of 2,048 entries) at the module's warps: it compiles for
    sm_90a, with its atomic count and the last program's combine, without spills, its logits loaded 16 bytes at a
    time; and the noise's hash multiplies
    in 32 bits (`counter_noise`'s int64 products, masked to 32 bits, cost inductor's sampler 64-bit multiplies, which
    a GPU runs as several 32-bit ones)."""
    from rollout_lib.backends import counter_noise, triton_sampler

    vocab = 151_936
    args = {"logits_ptr": "*fp32", "seeds_ptr": "*i64", "step_ptr": "*i64", "inv_t_ptr": "*fp32", "greedy_ptr": "*u8",
            "m_ptr": "*fp32", "s_ptr": "*fp32", "key_ptr": "*fp32", "at_ptr": "*i32", "lock_ptr": "*i32",
            "tokens_ptr": "*i64", "logp_ptr": "*fp32", "vocab": vocab, "logits_row": vocab}
    chunks = -(-vocab // triton_sampler.BLOCK)
    constexprs = {"CHUNKS": chunks, "CHUNKS_BLOCK": 128, "BLOCK": triton_sampler.BLOCK,
                  "SALT": counter_noise.STREAM_SALT, "MULT_1": counter_noise.MULT_1, "MULT_2": counter_noise.MULT_2}
    result = _compile_for_hopper("triton_sampler", args, constexprs, triton_sampler.WARPS, tmp_path)
    assert result["spill_bytes"] == 0, result
    # the chunk's logits in 16-byte loads (2,048 entries over 128 threads: 4 a thread), the vocabulary and the row's
    # stride specialized (with either left unspecialized, the mask and the address lose their alignment: 16 scalar
    # loads a thread)
    assert result["loads"]["ld.global.v4.b32"] == triton_sampler.BLOCK // (32 * triton_sampler.WARPS * 4), result
    ptx = (tmp_path / "kernel.ptx").read_text()
    assert "atom.global" in ptx  # the row's count
    products = [line.split()[0] for line in ptx.splitlines()
                if "mul" in line and any(str(c) in line for c in (counter_noise.MULT_1, counter_noise.MULT_2))]
    assert products and all(op.endswith(("32", "32;")) and ".wide" not in op for op in products), products
