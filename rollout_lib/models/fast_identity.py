"""The policy identity of `policy.policy_identity`, streamed from the device: the same framing byte
for byte (tests hold the two equal), with the device-to-host transfer overlapped with the hashing
and no extra host copy (`tobytes()`).

Why a second implementation: a policy sync re-derives the identity from the buffers it just wrote,
so hashing ~10 M float32 parameters (40 MB) sits on the sync's critical path, and the original
reads every tensor back separately and copies it once more before hashing. (The original lives in
files that are part of the frozen oracle's measurement code until campaign h200-v2's oracle cells
are complete.)
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _header(name: str, tensor: torch.Tensor) -> bytes:
    from rollout_lib.models.synthetic import _dtype_name

    return json.dumps({"name": name, "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)},
                      sort_keys=True, separators=(",", ":")).encode()


def policy_identity_streamed(base_digest: str, tensors: dict[str, torch.Tensor], staging: torch.Tensor | None = None,
                             timings: dict[str, float] | None = None, chunk_bytes: int = 4 << 20) -> str:
    """Equal to `policy.policy_identity(base_digest, tensors)` for tensors of one dtype on one device,
    with the device-to-host transfer overlapped with the hashing: the tensors are gathered in hashing
    order into one device buffer, copied to `staging` (page-locked host memory on CUDA; allocated here
    if None or too small) in chunks of `chunk_bytes`, and each tensor is hashed as soon as the chunk
    holding its end has arrived. SHA-256 is one sequential stream, so hashing ~40 MB is the floor.
    `timings`, if given, receives gather_s, wait_s (blocked on the transfer) and hash_s."""
    import torch

    names = sorted(tensors)
    started = time.perf_counter()
    dtypes = {tensors[n].dtype for n in names}
    devices = {tensors[n].device for n in names}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(f"streamed identity needs one dtype and one device, got {sorted(map(str, dtypes))} "
                         f"on {sorted(map(str, devices))}")
    (dtype,), (device,) = dtypes, devices
    flat = torch.cat([tensors[n].detach().reshape(-1) for n in names])
    cuda = device.type == "cuda"
    if staging is None or staging.numel() < flat.numel() or staging.dtype != dtype:
        staging = torch.empty(flat.numel(), dtype=dtype, pin_memory=cuda)
    host = staging[:flat.numel()]
    step = max(1, chunk_bytes // flat.element_size())
    arrivals = []  # (end offset, event or None): chunks in order
    for begin in range(0, flat.numel(), step):
        host[begin:begin + step].copy_(flat[begin:begin + step], non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        arrivals.append((min(begin + step, flat.numel()), event))
    gathered = time.perf_counter()
    digest = hashlib.sha256(b"rollout-runtime-v2/policy/v1\n")
    digest.update(base_digest.encode())
    raw_bytes = host.view(torch.uint8).numpy() if flat.numel() else b""
    width = flat.element_size()
    offset, arrived, chunk, wait_s = 0, 0, 0, 0.0
    for name in names:
        end = offset + tensors[name].numel()
        while arrived < end:
            end_offset, event = arrivals[chunk]
            if event is not None:
                waiting = time.perf_counter()
                event.synchronize()
                wait_s += time.perf_counter() - waiting
            arrived, chunk = end_offset, chunk + 1
        header = _header(name, tensors[name])
        digest.update(len(header).to_bytes(8, "little"))
        digest.update(header)
        digest.update(((end - offset) * width).to_bytes(8, "little"))
        digest.update(raw_bytes[offset * width:end * width])
        offset = end
    if timings is not None:
        timings.update({"gather_s": gathered - started, "wait_s": wait_s,
                        "hash_s": time.perf_counter() - gathered - wait_s})
    return digest.hexdigest()
