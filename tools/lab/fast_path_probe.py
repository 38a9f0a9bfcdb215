"""Quick probe of the hf_cached fast path on one GPU: capture time, ms per decode step and tok/s for
the graph path (and optionally the eager path) on a few cells, float32 greedy equality of the two.

    python tools/lab/fast_path_probe.py --params params/rollout-runtime-v2.yaml --out probe.json \
        [--variants off,inductor,eager] [--before FILE] [--profile DIR]

Variants: `off` / `inductor` are the graph path with the step uncompiled / compiled by inductor
before capture; `eager` the transformers + peft loop; `before` the graph path with an older copy
of compact_qwen3.py (`--before FILE`), for before/after in one process. Suffixes on `off` / `inductor`
change one thing each, to read the changes apart: `+f32head` forces the float32 GEMM head, `+dynamic` /
`+perrows` one compilation for every row count / one per row count (STEP_SHAPES), `+again` / `+again2` nothing
changed (a second / third compilation from empty caches: the draw's size in this process), `+kvinside` /
`+kvoutside` the k/v cache write inside / outside the compiled piece (CACHE_WRITE), `+cdt` inductor's
coordinate-descent tuning of launch configurations, `+det` inductor's deterministic mode (one fixed
configuration per reduction, no benchmark at first launch: the choice that moved 16-row steps by
0.2-0.5 ms from hold to hold) (both INDUCTOR_OPTIONS, merged); e.g. `inductor+perrows+det`. Issue 43's
candidates: `+shrinkgemm`, `+expandgemm`, `+unrollexpand`, `+partsexpand`, `+tritonexpand`, `+tunelargest`, `+sdpaeff`,
`+sdpacudnn`, `+flex`, `+fa3` (vLLM staged), `+pdl`,
`+maxat`, `+combo`, `+acrosslayers` (one compiled piece from one layer's attention to the next), `+chunkedsampler`,
`+tritonsampler` (the sampler as one Triton kernel reading the logits once),
`+sharedprefix` (with `+fa3` or `+tritonattn`: each block of n rows reads its shared prompt's k/v once),
`+sharedlong` (the same for prompts of 256 columns or more), `+sharedlaunch` (that kernel's own launch over
256 columns or more),
`+sharedprefill` (one prefill per distinct prompt) and `+prefillgraph` (the prefill compiled and captured):
the last two move `ms_prefill` and the wall, not the decode step; `+pipelined` (each step's tokens read back
while the next step runs), `+edges` (the step's work outside its layers compiled), `+splitk` / `+splitk2` /
`+splitk4` / `+splitk8` (each projection's GEMM split over K, "auto" or that many slices), `+prefetch` /
`+prefetchnext` (a layer's weights after its attention prefetched into the L2 while the attention runs),
`+pdlepilogues` (the o/down and gate_up epilogues launched with PDL, loading B before waiting for the GEMM),
`+pdlnorm` (the o/down epilogues only), `+pdl16` (both, in calls of 16 rows or more), `+pdlqkv16` (and the
qkv epilogue), `+pdlattn` (the attention kernel with PDL, its k/v slice prefetched into the L2 before it waits),
`+attnprefetch` (`+prefetch`'s plans issued by the attention kernel, not a side stream), `+prefetchwide` (the side
stream's prefetch kernel with 8x the programs).
Every variant starts from an empty dynamo cache (compiled entries are shared across engines whose
calls pass their guards) and an empty inductor cache (`torch._inductor.utils.fresh_cache`: otherwise a
kernel of the same source reuses the launch configuration an earlier variant's first launch chose).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollout_lib.backends import create_backend
from rollout_lib.models.policy import policy_versions
from rollout_lib.study.prereg import load
from rollout_lib.study.workload import Workload

# suffix -> (attribute of rollout_lib.backends.compact_qwen3, value while the variant runs)
SUFFIXES = {"f32head": ("_cuda_bf16_gemm_with_float32_output", lambda *_: False),
            "dynamic": ("STEP_SHAPES", "dynamic"),
            "perrows": ("STEP_SHAPES", "per_rows"),
            "cdt": ("INDUCTOR_OPTIONS", {"coordinate_descent_tuning": True}),
            # nothing changed: its parent compiled a second time from empty caches, so its delta is the size of
            # inductor's first-run draw of launch configurations in this process (lease 28/30: up to ~0.5 ms)
            "again": ("INDUCTOR_OPTIONS", {}),
            "again2": ("INDUCTOR_OPTIONS", {}),  # a third compilation (lease 32: the draw's spread, not one pair)
            "det": ("INDUCTOR_OPTIONS", {"deterministic": True}),
            # programmatic dependent launch between inductor's Triton kernels (Hopper; vLLM sets it for its
            # full CUDA graphs through TORCHINDUCTOR_ENABLE_PDL): a kernel's prologue overlaps the previous tail
            "pdl": ("INDUCTOR_OPTIONS", {"triton.enable_pdl": True}),
            # autotuned GEMMs: inductor benchmarks Triton templates against cuBLAS for each projection's skinny
            # GEMM (4-16 rows) at compile time (GEMMs were 0.75 ms of a 16-row step at 3x their weights' floor)
            "maxat": ("INDUCTOR_OPTIONS", {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON,ATEN"}),
            # inductor's combo kernels: data-independent kernels of one compiled piece (q_norm and k_norm, the
            # LoRA terms of a group, the k/v cache writes) launched as one; at 4 rows a step is ~575 launches
            "combo": ("COMBO_KERNELS", "on"),
            "kvinside": ("CACHE_WRITE", "inside"),
            "kvoutside": ("CACHE_WRITE", "outside"),
            "shrinkgemm": ("LORA_SHRINK", "in_base_gemm"),
            "expandgemm": ("LORA_EXPAND", "gemm"),
            # the B product's rank added term by term, pointwise: no reduction whose launch configuration
            # inductor picks by benchmarking at first run (lease 28: that pick varied between compilations)
            "unrollexpand": ("LORA_EXPAND", "unrolled"),
            # the same per fused part (only the part's own rank terms) over rank-major B (lease 30: the dense
            # unrolled kernel read B a row apart per thread and added the block-diagonal B's zeros)
            "partsexpand": ("LORA_EXPAND", "unrolled_parts"),
            # the B product, add and rounding as one hand-written Triton kernel with one fixed launch configuration
            # (lease 31: inductor's first-run picks for the expand reductions moved a step up to ~0.3 ms, nothing
            # changed)
            "tritonexpand": ("LORA_EXPAND", "triton"),
            # the cold start captures the largest row count first: inductor's first-run picks of launch
            # configurations (one for every row count) are made at 16 rows, not 4
            "tunelargest": ("AUTOTUNE_ROWS", "largest"),
            "sdpaeff": ("ATTENTION_BACKEND", "efficient"),
            "sdpacudnn": ("ATTENTION_BACKEND", "cudnn"),
            "flex": ("ATTENTION_BACKEND", "flex"),
            "fa3": ("ATTENTION_BACKEND", "fa3"),
            # decode attention as one hand-written Triton kernel a layer, split over the cache's columns and merged
            # by the last program (lease 39: FA3 6.6 us a layer + its 1.8 us plan, for under 0.5 us of k/v bytes)
            "tritonattn": ("ATTENTION_BACKEND", "triton"),
            # that kernel with the qkv epilogue's work inside it (q, the new k/v into the caches): one kernel a
            # layer fewer (lease 39: the qkv epilogue 2.6 us a call and its gap before attention)
            "tritonqkv": ("ATTENTION_BACKEND", "triton_qkv"),
            # with +tritonattn: that kernel's launch chosen by the cache's length (lease 41's bench: 128 columns an
            # iteration on 4 warps in one slice, 3 stages, under 256 columns; 1.4-1.7 us a call; the default's from
            # 256 columns since session 43)
            "attnlaunch": ("ATTENTION_LAUNCH", "by_columns"),
            # that, and the shared-prompt kernel over a cache of 256 columns or more at 128 columns an iteration,
            # 4 warps, one stage (lease 43's bench: 12.58 -> 11.13 us a call at 16 rows over 768 columns)
            "sharedlaunch": ("ATTENTION_LAUNCH", "by_columns_shared"),
            # with +fa3: FA3's scheduler metadata once per step for all 28 layers (lease 32: a 1.9 us
            # prepare_varlen_num_blocks kernel before each attention kernel)
            "fa3plan": ("ATTENTION_PLAN", "per_step"),
            "sharedprefill": ("PREFILL", "shared_prompts"),
            "prefillgraph": ("PREFILL_STEP", "compiled_graph"),
            "acrosslayers": ("STEP_PIECES", "across_layers"),
            "chunkedsampler": ("SAMPLER", "chunked"),
            # the sampler as one hand-written kernel reading the logits once (after +chunkedsampler in a name, it wins)
            "tritonsampler": ("SAMPLER", "triton"),
            # with +fa3 (cascade attention) or +tritonattn (one kernel): a block of n rows with one prompt reads
            # the prompt's k/v once
            "sharedprefix": ("DECODE_PREFIX", "shared"),
            # the same where the prompts take 256 columns or more (lease 43: nothing to gain at 128)
            "sharedlong": ("DECODE_PREFIX", "shared_long"),
            # step t+1 enqueued before step t's tokens are read: the GPU no longer waits for the host between steps
            "pipelined": ("READBACK", "pipelined"),
            # the step's work outside its layers (inputs, final norm, bookkeeping) as three compiled pieces
            "edges": ("STEP_EDGES", "compiled"),
            # each projection's decode GEMM as one Triton kernel that splits K to fill the SMs and adds the slices
            # itself in a fixed order (lease 32: cuBLAS's one kernel shape, ~6 us a GEMM, 17 blocks for o_proj)
            "skinnygemm": ("GEMM_KERNEL", "triton_skinny"),
            "skinnyodown": ("GEMM_KERNEL", "triton_skinny_o_down"),
            # persistent reductions (the LoRA expand's) launched with the largest XBLOCK inductor generated, not
            # its first-run benchmark's pick (leases 32-33: that pick moved one source's step by up to 2.8 ms)
            "fewest": ("REDUCTION_LAUNCH", "fewest_programs"),
            # the largest XBLOCK that still gives every SM a program at the first call (lease 34: the fewest
            # programs launched the qkv expand at 3 programs on 132 SMs, 4.7 us a call against a draw's 2.5)
            "fillsms": ("REDUCTION_LAUNCH", "fill_multiprocessors"),
            # the gate_up GEMM's float32 output to the SiLU product as one Triton kernel (lease 33: two inductor
            # kernels and their gaps, ~4 us a layer, between the two opaque GEMMs)
            "mlpepilogue": ("GATE_UP_EPILOGUE", "triton"),
            # the o GEMM's float32 output to the residual stream and its norm as one Triton kernel (lease 33: the o
            # expand and the residual + norm, two inductor kernels and their gaps, ~3.9 us a layer)
            "oepilogue": ("O_EPILOGUE", "triton"),
            # the down GEMM's float32 output to the residual stream and the next layer's input norm as that kernel
            # (lease 33: the down expand + residual and the next norm, two kernels and their gaps, ~3.7 us a layer)
            "downepilogue": ("DOWN_EPILOGUE", "triton"),
            # the o/down kernel over slices of each row, one program a slice, the row's last one writing its norm
            # (lease 38's bench: 4.65 us a call with the L2 flushed, each row's one program reading all of B)
            "rowslices": ("NORM_EPILOGUE_ROW", "slices"),
            # the qkv GEMM's float32 output to q and the k/v cache writes as one Triton kernel (lease 33: the qkv
            # expand, the q/k norms with rotary and the cache writes, four kernels and their gaps, ~9 us a layer)
            "qkvepilogue": ("QKV_EPILOGUE", "triton"),
            # while each layer's attention runs, a side stream asks the L2 for the o, gate_up and down weights and B the
            # layer reads next (session 44: ~0.7 ms a step of attention, epilogues and gaps with the memory idle, while
            # each small GEMM waits on the memory's latency); +prefetchnext: the next layer's qkv weight and B too
            "prefetch": ("WEIGHT_PREFETCH", "rest_of_layer"),
            "prefetchnext": ("WEIGHT_PREFETCH", "through_next_qkv"),
            # the o/down and gate_up epilogue kernels launched with PDL, their B loaded before they wait for the
            # GEMM (tools/lab/pdl_bench.py: the pair alone; lease 28's +pdl, inductor's, waited first and lost)
            "pdlepilogues": ("DEPENDENT_LAUNCH", "epilogues"),
            # lease 45: +pdlepilogues gained 0.07-0.09 ms at 16 rows and lost 0.023 at 4; the o/down kernels alone
            # (their trace time fell at both), and both kernels only in calls of 16 rows or more
            "pdlnorm": ("DEPENDENT_LAUNCH", "norm_epilogues"),
            "pdl16": ("DEPENDENT_LAUNCH", "epilogues_from_16_rows"),
            # session 49: from 16 rows PDL paid 0.05-0.07 ms over 83 pairs; the qkv GEMM -> epilogue pairs too (28)
            "pdlqkv16": ("DEPENDENT_LAUNCH", "epilogues_and_qkv_from_16_rows"),
            # the attention launched with PDL after the qkv epilogue, its k/v slice asked of the L2 before the wait
            # (a 4-row step over 768 columns reads 12.6 MB of k/v a layer: ~9.6 us a call, 2.6x its bytes' time)
            "pdlattn": ("ATTENTION_DEPENDENT_LAUNCH", "prefetch_kv"),
            # lease 46: without the prefetch's side stream PDL gained 0.071 ms at 4 rows (with it, +0.02): the
            # plan issued by `attend`'s kernel instead (no side stream where that kernel runs)
            "attnprefetch": ("WEIGHT_PREFETCH_BY", "attention"),
            # lease 46's traces: the prefetch kernel's 4 programs took 40 us a layer (0.8 TB/s); 8x the programs
            "prefetchwide": ("WEIGHT_PREFETCH_BY", "side_stream_wide"),
            # each projection's skinny GEMM over slices of K as one batched GEMM (more thread blocks than 17-98
            # output tiles on 132 SMs), the partial sums added in the next compiled kernel; "auto" per projection
            "splitk": ("GEMM_SPLIT_K", "auto"),
            "splitk2": ("GEMM_SPLIT_K", "2"),
            "splitk4": ("GEMM_SPLIT_K", "4"),
            "splitk8": ("GEMM_SPLIT_K", "8")}


def use_before(path):
    """Serve the graph path from an older copy of compact_qwen3.py (its engine takes no compile flag)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rollout_lib.backends.compact_qwen3_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    engine = module.CompactQwen3

    class Engine(engine):
        def __init__(self, *args, compile_step=False, **kwargs):
            super().__init__(*args, **kwargs)
            self.compiled = False

    import inspect

    if "compile_step" not in inspect.signature(engine.__init__).parameters:
        module.CompactQwen3 = Engine  # an engine from before the compile option: uncompiled
    import rollout_lib.backends.compact_qwen3 as current

    # today's backend syncs through these; an older engine gets today's (they read only its buffers)
    for name in ("lora_views", "identity_staging"):
        if not hasattr(module.CompactQwen3, name):
            setattr(module.CompactQwen3, name, getattr(current.CompactQwen3, name))
            setattr(module.CompactQwen3, f"_{name}", None)  # their cache, set in today's __init__
    if not hasattr(module.CompactQwen3, "served_lora"):  # an engine from before the stacked buffers:
        module.CompactQwen3.served_lora = module.CompactQwen3.lora_views  # its identity read its views
    if not hasattr(module.CompactQwen3, "head_mode"):  # from before the bf16-operand head
        module.CompactQwen3.head_mode = current.HEAD_FLOAT32

    sys.modules["rollout_lib.backends.compact_qwen3"] = module
    return current


def profile(backend, workload, cell_id, directory, label):
    """One torch.profiler trace of one generate call; returns the kernel count and GPU time per step."""
    import torch

    requests = workload.requests(workload.cell(cell_id))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        batch = backend.generate(requests)
    Path(directory).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(directory) / f"{label}-{cell_id}.json"))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    steps = max(batch.decode_steps, 1)
    top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
    return {"cuda_events": len(kernels), "cuda_events_per_step": len(kernels) / (steps + 1),
            "cuda_time_ms_per_step": sum(e.device_time for e in kernels) / 1000 / (steps + 1),
            "top_kernels": [{"name": e.key[:90], "count": e.count, "device_time_total_us": e.device_time_total}
                            for e in top]}


def measure(backend, workload, cell_ids, repetitions, reference=None):
    """Per cell: wall, tokens/s, ms per decode step and prefill (medians over `repetitions`, after one warm-up);
    for a greedy cell also how its tokens compare with `reference` (the probe's first variant's greedy tokens per
    request, collected into `reference` when it is empty), so a variant that computes something else (a broken
    kernel parting from the first step) shows beside its timings (`tools/lab/pick_engine.py` drops it)."""
    rows = {}
    for cell_id in cell_ids:
        requests = workload.requests(workload.cell(cell_id))
        backend.generate(requests)  # warmup, excluded
        walls, decode, prefill, steps, tokens = [], [], [], None, None
        for _ in range(repetitions):
            batch = backend.generate(requests)
            walls.append(batch.wall_s)
            decode.append(batch.phases["decode_s"].seconds)
            prefill.append(batch.phases["prefill_s"].seconds)
            steps, tokens = batch.decode_steps, batch.generated_tokens
        rows[cell_id] = {"median_wall_s": statistics.median(walls), "tokens_per_s": tokens / statistics.median(walls),
                         "ms_per_decode_step": 1000 * statistics.median(decode) / max(steps, 1),
                         "ms_prefill": 1000 * statistics.median(prefill),
                         "decode_steps": steps, "generated_tokens": tokens}
        if reference is not None and all(request.greedy for request in requests):
            got = {r.request_id: list(r.token_ids) for r in batch.results}
            if cell_id not in reference:
                reference[cell_id] = got
            rows[cell_id]["greedy_against_first_variant"] = greedy_agreement(reference[cell_id], got)
        print(cell_id, json.dumps(rows[cell_id]), flush=True)
    return rows


def greedy_agreement(reference: dict[str, list[int]], got: dict[str, list[int]]) -> dict[str, float | int]:
    """How one variant's greedy tokens follow the first variant's, request by request: rows identical, and the
    mean position of the first token that differs (a row's length where none does). bf16 variants part at
    near-ties, tens of tokens in; a variant computing something else parts at once."""
    firsts = []
    for request_id, want in reference.items():
        mine = got.get(request_id, [])
        shared = min(len(want), len(mine))  # the shorter row's length (a stop token ends a row early)
        firsts.append(next((i for i in range(shared) if want[i] != mine[i]), shared))
    identical = sum(1 for request_id, want in reference.items() if got.get(request_id) == want)
    return {"rows": len(reference), "identical_rows": identical,
            "mean_first_difference": statistics.mean(firsts) if firsts else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", default="params/rollout-runtime-v2.yaml")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cells", default="p128-r64-n1-greedy,p128-r64-n4-stochastic,p512-r256-n4-greedy")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--variants", default="off,inductor")
    parser.add_argument("--before", default=None, help="older compact_qwen3.py for the `before` variant")
    parser.add_argument("--profile", default=None, help="directory for one profiler trace per variant")
    parser.add_argument("--profile-cells", type=int, default=2,
                        help="how many of the cells, first first, --profile traces (default 2: 4 rows and 16 rows "
                             "with the default cells; 3 adds p512-r256-n4's long cache)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    study = load(args.params)
    workload = Workload(study)
    policy = policy_versions(workload.arch, study.actor.lora, study.actor.payload_digest, 1)[-1]
    cells = args.cells.split(",")
    report = {"cells": cells}
    greedy_reference: dict[str, dict[str, list[int]]] = {}  # the first measured variant's greedy tokens
    for variant in args.variants.split(","):
        # `X+suffix+...`: variant X with one engine setting changed per suffix (module attributes of
        # compact_qwen3 read when the engine is built, restored after the variant)
        base_variant, *suffixes = variant.split("+")
        options = ({"decode": "eager"} if base_variant == "eager" else
                   {"decode": "graphs", "step_compile": "auto" if base_variant == "before" else base_variant})
        options |= {"device": args.device} if args.device else {}
        unknown = [x for x in suffixes if x not in SUFFIXES]
        if unknown or (suffixes and base_variant not in ("off", "inductor")):
            raise SystemExit(f"variant {variant!r}: allowed suffixes: {', '.join('+' + x for x in SUFFIXES)}, "
                             "on off or inductor")
        import torch

        import rollout_lib.backends.compact_qwen3 as engine_module

        torch._dynamo.reset()
        patched = {}
        for suffix in suffixes:
            name, value = SUFFIXES[suffix]
            patched.setdefault(name, getattr(engine_module, name))
            current_value = getattr(engine_module, name)
            # option dicts (INDUCTOR_OPTIONS) merge, so `+cdt+det` sets both
            setattr(engine_module, name, {**current_value, **value} if isinstance(value, dict) else value)
        current = use_before(args.before) if base_variant == "before" else None
        backend = None
        caches = contextlib.ExitStack()
        try:
            inductor_cache = fresh_inductor_cache(caches)
            backend = create_backend("hf_cached", study, **options)
            if torch.cuda.is_available():  # each variant's own peak (graph pools, caches), the previous one torn down
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            cold = backend.cold_start()
            syncs = []
            for _ in range(3):
                sync_started = time.perf_counter()
                backend.sync_policy(policy)
                syncs.append(time.perf_counter() - sync_started)
            env = backend.environment()
            print(variant, "cold start", round(cold.seconds, 2), "capture", env.get("graph_capture_s"), "syncs", syncs,
                  flush=True)
            phases = [p.get("sync_phases_s") for p in (getattr(backend, "served_policies", None) or [])[-3:]]
            report[variant] = {"cold_start_s": cold.seconds, "policy_sync_s": syncs, "sync_phases_s": phases,
                               "environment": env, "inductor_cache": inductor_cache,
                               "capture_s_by_bucket": {f"{r}x{n}": b.capture_s
                                                       for (r, n), b in (backend.buckets.buckets.items()
                                                                         if backend.buckets else [])}}
            write(args.out, report)  # each step lands as it comes (a killed probe keeps what it measured)
            report[variant]["cells"] = measure(backend, workload, cells, args.repetitions, greedy_reference)
            shared = getattr(backend.buckets, "shared_prefix_buckets", None) or {}
            if shared:  # DECODE_PREFIX "shared": captured at a cell's first (warm-up) call
                report[variant]["capture_s_by_shared_prefix_bucket"] = {
                    f"{r}x{n}x{g}": b.capture_s for (r, n, g), b in shared.items()}
            if torch.cuda.is_available():
                report[variant]["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
                report[variant]["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            write(args.out, report)
            if args.profile:  # the first --profile-cells cells
                report[variant]["profile"] = {cell: profile(backend, workload, cell, args.profile, variant)
                                              for cell in cells[:args.profile_cells]}
                print(variant, "profile", json.dumps(report[variant]["profile"])[:400], flush=True)
            report[variant]["total_s"] = time.perf_counter() - started
            write(args.out, report)
            backend.teardown()
        except Exception as exc:  # one variant failing (a compile option, an OOM) must not cost the others
            import traceback

            traceback.print_exc()
            report[variant] = dict(report.get(variant, {}), error=f"{type(exc).__name__}: {exc}")
            write(args.out, report)
            if backend is not None:
                try:
                    backend.teardown()
                except Exception:  # already failed: the error above is the record
                    traceback.print_exc()
        finally:
            caches.close()
            for name, value in patched.items():
                setattr(engine_module, name, value)
            if current is not None:
                sys.modules["rollout_lib.backends.compact_qwen3"] = current
    return 0


def fresh_inductor_cache(stack: contextlib.ExitStack) -> str:
    """Enter an empty inductor cache (a temporary directory, in-memory caches cleared) for one variant;
    'fresh', or 'shared' where this torch has no such context manager."""
    import torch._inductor.utils as inductor_utils

    fresh = getattr(inductor_utils, "fresh_cache", None) or getattr(inductor_utils, "fresh_inductor_cache", None)
    if fresh is None:
        return "shared"
    stack.enter_context(fresh())
    return "fresh"


def write(path, report):
    Path(path).write_text(json.dumps(report, indent=1, sort_keys=True, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
