"""REDUCTION_LAUNCH (issue 43 candidate): how inductor picks the launch configuration of a persistent reduction
that one of this engine's compiled pieces runs for the first time.

Why (leases 28-33, `tools/lab/probe_table.py <folder> --launches`): inductor compiles a persistent reduction (a
reduction whose whole extent fits one program: the LoRA expand's sum over the rank, 16) with up to four launch
configurations, XBLOCK 1, 8, 32 and 128 (elements of the kept dimension per program), benchmarks them when the
kernel first runs and keeps the fastest for every later call, whatever its row count. The same source drew
differently in each compilation: one LoRA expand reduction took 1.5 us at XBLOCK 32 and 40 us at XBLOCK 1 (65,536
programs of 64 threads) at 16 rows, and the picked engine's step read 1.96 to 2.63 ms (4 rows) and 2.27 to 5.02 ms
(16 rows) over three compilations of one source (lease 32, H100). The fewest, fattest programs were the fastest
or within 0.3 us of it in every trace read (perf-notes, "Decode step").

"benchmarked" (the default): inductor's own pick. "fewest_programs": the largest XBLOCK among the configurations
inductor generated (so within its limit of 4,096 elements per program), without benchmarking: the same pick in
every compilation, at any row count. "fill_multiprocessors": the largest XBLOCK whose grid at the first call (its
xnumel, the kept dimension's size) still has a program for every multiprocessor, else the smallest XBLOCK: lease
34 (H100) found "fewest_programs" launching the qkv expand reduction at 3 programs on 132 SMs at 4 rows, 4.7 us a
call where a benchmarked draw of 192 programs took 2.5. Also the same pick in every compilation, for the first
call's row count (the capture order, AUTOTUNE_ROWS, decides which that is); a kernel whose arguments name no
xnumel (a static shape) is judged by inductor's size hint for it. Only persistent reductions with one XBLOCK;
pointwise kernels, looped reductions (the sampler's, the norms') and combo kernels with a block per sub-kernel keep
inductor's choice. A configuration's warps may add a row's terms in another order than another's (float32 sums of
the same exact products: the LoRA contract), so a benchmarked pick can also move the last bit of a sum from one
compilation to the next; a rule's order is the same in every compilation.

The rule applies while one of the engine's compiled pieces runs (`with_rule` wraps each): inductor benchmarks a
kernel on its first call, inside that call. The engine's compilations also switch off inductor's autotune cache
(`compile_options`), so a pick another engine benchmarked and saved for the same kernel is not read back, and
this rule's pick is not saved for another. The hook replaces `CachingAutotuner.autotune_to_one_config` of torch's
inductor runtime (torch 2.11 and later) once per process; without that method the setting is refused by name."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

REDUCTION_LAUNCH_ALLOWED = ("benchmarked", "fewest_programs", "fill_multiprocessors")

_RULE: contextvars.ContextVar[str] = contextvars.ContextVar("reduction_launch", default="benchmarked")
_INSTALLED_MARK = "_rollout_reduction_launch"
# the picks this process made under a rule: kernel name -> (XBLOCK picked, the XBLOCKs it was picked from, the first
# call's xnumel or None where the kernel names none)
PICKS: dict[str, tuple[int, tuple[int, ...], int | None]] = {}


def _xblock(config: Any) -> int:
    return config.kwargs.get("XBLOCK", 1)


def fewest_programs(configs: list[Any]) -> Any:
    """The configuration with the largest XBLOCK (the fewest programs); among equal XBLOCKs, the first."""
    return max(configs, key=_xblock)


def fill_multiprocessors(configs: list[Any], xnumel: int, multiprocessors: int) -> Any:
    """The configuration with the largest XBLOCK whose grid over `xnumel` elements has at least `multiprocessors`
    programs; where none has, the smallest XBLOCK (the most programs). Among equal XBLOCKs, the first."""
    filling = [config for config in configs if -(-xnumel // _xblock(config)) >= multiprocessors]
    return max(filling, key=_xblock) if filling else min(configs, key=_xblock)


def _multiprocessors() -> int:
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def install(rule: str = "fewest_programs") -> None:
    """Hook inductor's first-run pick once per process (idempotent); a torch without the hooked method refuses
    the setting (`rule`, for the message) in one line."""
    try:
        from torch._inductor.runtime.hints import HeuristicType
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError as error:
        raise ValueError(f"REDUCTION_LAUNCH {rule} needs torch's inductor runtime ({error}); "
                         f"allowed here: benchmarked") from error
    benchmark = getattr(CachingAutotuner, "autotune_to_one_config", None)
    if benchmark is None:
        raise ValueError(f"REDUCTION_LAUNCH {rule} needs CachingAutotuner.autotune_to_one_config (torch "
                         f">= 2.11); allowed here: benchmarked")
    if getattr(benchmark, _INSTALLED_MARK, False):
        return

    @functools.wraps(benchmark)
    def autotune_to_one_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        configs = [launcher.config for launcher in self.launchers]
        # a combo kernel's configurations name a block per sub-kernel (XBLOCK_0, ...), not one XBLOCK: benchmarked
        rule = _RULE.get()
        if (rule != "benchmarked" and self.heuristic_type == HeuristicType.PERSISTENT_REDUCTION
                and all("XBLOCK" in config.kwargs for config in configs)):
            named = dict(zip(getattr(self.fn, "arg_names", ())[:len(args)], args, strict=False))
            xnumel = named.get("xnumel", (getattr(self, "size_hints", None) or {}).get("x"))
            xnumel = xnumel if isinstance(xnumel, int) else None
            if rule == "fill_multiprocessors" and xnumel is not None:
                picked = fill_multiprocessors(configs, xnumel, _multiprocessors())
            else:  # "fewest_programs", or a kernel with neither an xnumel nor a size hint (then the fewest too)
                picked = fewest_programs(configs)
            self.launchers = [launcher for launcher in self.launchers if launcher.config is picked][:1]
            PICKS[getattr(self.fn, "__name__", "?")] = (_xblock(picked), tuple(_xblock(config) for config in configs),
                                                       xnumel)
            return None
        return benchmark(self, *args, **kwargs)

    setattr(autotune_to_one_config, _INSTALLED_MARK, True)
    CachingAutotuner.autotune_to_one_config = autotune_to_one_config


def compile_options(rule: str) -> dict[str, bool]:
    """Inductor options a compilation under `rule` adds: no autotune cache read or written (see the module)."""
    if rule not in REDUCTION_LAUNCH_ALLOWED:
        raise ValueError(f"REDUCTION_LAUNCH {rule!r} is not allowed; allowed: {', '.join(REDUCTION_LAUNCH_ALLOWED)}")
    return {} if rule == "benchmarked" else {"autotune_local_cache": False, "autotune_remote_cache": False}


def with_rule(compiled: Callable[..., Any], rule: str) -> Callable[..., Any]:
    """`compiled` (a compiled piece), calling it under `rule`; "benchmarked" returns it unchanged."""
    compile_options(rule)  # refuses an unknown rule
    if rule == "benchmarked":
        return compiled
    install(rule)

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        token = _RULE.set(rule)
        try:
            return compiled(*args, **kwargs)
        finally:
            _RULE.reset(token)

    return call
