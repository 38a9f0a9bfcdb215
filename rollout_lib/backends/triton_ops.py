"""What the hand-written Triton kernels' settings share (LORA_EXPAND "triton", GEMM_KERNEL "triton_skinny", the
four epilogues): the check that Triton can run a kernel here, and the opaque op a kernel runs behind (the Triton
functions they share: `triton_jit`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def device_key(device) -> str:
    """A device as its tensors name it ("cuda:0", not "cuda"): the key of a kernel's per-device counters
    (`skinny_gemm`, `norm_epilogue`'s "slices")."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def zeroed_counters(device, slots: int) -> tuple[Any, int]:
    """(int32 counters zeroed now, the device's SM count: 132 for a CPU in Triton's interpreter) for a kernel whose
    last program to arrive finishes a tile (`skinny_gemm`, `decode_attention`, `norm_epilogue`'s slices): made
    before any CUDA graph capture, since a buffer first allocated inside one is zeroed only when the graph first
    replays."""
    import torch

    device = torch.device(device)
    multiprocessors = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                       else 132)
    return torch.zeros(slots, dtype=torch.int32, device=device), multiprocessors


def check_launch(tiles: dict[str, int], warps: int, stages: int, splits: int | None, max_splits: int) -> None:
    """A hand-written kernel's launch configuration (`skinny_gemm.Launch`, `decode_attention.Launch`): each tile
    size of `tiles` (name -> value) a power of two >= 16 (tl.dot's smallest), warps 1, 2, 4 or 8, stages 1-8, and
    slices 1-`max_splits` or None (the module's own choice); refused in one line naming the field."""
    for name, value in tiles.items():
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} {value} is not allowed; allowed: a power of two >= 16 (tl.dot's tiles)")
    if warps not in (1, 2, 4, 8) or not 1 <= stages <= 8:
        raise ValueError(f"warps/stages {warps}/{stages} is not allowed; allowed: warps 1, 2, 4 or 8, stages 1-8")
    if splits is not None and not 1 <= splits <= max_splits:
        raise ValueError(f"splits {splits} is not allowed; allowed: 1-{max_splits} or None (splits_for)")


def check_triton_runs_here(device, setting: str) -> None:
    """A setting whose kernel is hand-written Triton (`setting`: its name and value, e.g. "GEMM_KERNEL
    triton_skinny", "LORA_EXPAND triton") runs on a CUDA GPU with Triton installed (or, for tests, on a CPU in
    Triton's interpreter: TRITON_INTERPRET=1); refused elsewhere, by name."""
    import importlib.util
    import os

    import torch

    device = torch.device(device)
    triton = importlib.util.find_spec("triton") is not None
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if not triton or (device.type != "cuda" and not interpreted):
        raise ValueError(f"{setting} needs a CUDA GPU and Triton; this engine: {device}, Triton "
                         f"{'installed' if triton else 'not installed'}")


def opaque_op(name: str, run: Callable[..., Any], shape_only: Callable[..., Any], arguments: dict[str, type],
              mutates: tuple[str, ...] = (), returns: Any = None) -> Any:
    """The custom op `name` (register it once per process) calling `run`, with `shape_only` as its fake: a compiled
    piece calls it as it calls a cuBLAS GEMM (its launch recorded in the piece's CUDA graph) and inductor chooses
    nothing for it. `arguments`: each argument's type, in order (the op's schema is read from them and `returns`:
    one tensor by default, or e.g. `tuple[torch.Tensor, torch.Tensor]`); `mutates`: the arguments it writes in
    place (none by default)."""
    import inspect

    import torch

    returns = torch.Tensor if returns is None else returns
    signature = inspect.Signature([inspect.Parameter(argument, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                     annotation=kind) for argument, kind in arguments.items()],
                                  return_annotation=returns)

    def call(*args):
        return run(*args)

    def fake(*args):
        return shape_only(*args)

    for function in (call, fake):
        function.__signature__ = signature
        function.__annotations__ = {**arguments, "return": returns}
    op = torch.library.custom_op(name, mutates_args=mutates)(call)
    op.register_fake(fake)
    return op


def check_sm90(device: Any, setting: str, why: str) -> None:
    """A CUDA device of compute capability 9.0 or later, with Triton; refused otherwise by `setting`'s name,
    saying what needs it (`why`: e.g. "programmatic dependent launch")."""
    import importlib.util

    import torch

    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < (9, 0) or importlib.util.find_spec("triton") is None:
        raise ValueError(f"{setting} needs a CUDA GPU of compute capability 9.0 or later ({why}) and Triton; this "
                         f"engine: {device}" + (f" (capability {capability[0]}.{capability[1]})" if capability else ""))


def pdl_for_rows(pdl_from_rows: int, rows: int) -> bool:
    """DEPENDENT_LAUNCH's rule for one epilogue call: launched with PDL when the engine's fewest rows for it
    (`pdl_from_rows`, 0 never) are at most the call's `rows` (each graph bucket's call decides for itself)."""
    return 0 < pdl_from_rows <= rows
