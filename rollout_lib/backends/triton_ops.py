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
              mutates: tuple[str, ...] = ()) -> Any:
    """The custom op `name` (register it once per process) calling `run`, with `shape_only` as its fake: a compiled
    piece calls it as it calls a cuBLAS GEMM (its launch recorded in the piece's CUDA graph) and inductor chooses
    nothing for it. `arguments`: each argument's type, in order (the op's schema is read from them; it returns one
    tensor); `mutates`: the arguments it writes in place (none by default)."""
    import inspect

    import torch

    signature = inspect.Signature([inspect.Parameter(argument, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                     annotation=kind) for argument, kind in arguments.items()],
                                  return_annotation=torch.Tensor)

    def call(*args):
        return run(*args)

    def fake(*args):
        return shape_only(*args)

    for function in (call, fake):
        function.__signature__ = signature
        function.__annotations__ = {**arguments, "return": torch.Tensor}
    op = torch.library.custom_op(name, mutates_args=mutates)(call)
    op.register_fake(fake)
    return op
