"""SAMPLER "triton" (issue 43 candidate): the decode step's sampler as one hand-written Triton kernel, the logits read
once.

Why (lease 46's traces of the picked engine U, SAMPLER "chunked", on an H100): the sampler runs as four to five
inductor kernels a step, each reducing the vocabulary again (the max, the sum of exponentials, the noise's race and
the combine): ~21 us a step at 4 rows and ~64 us at 16, for 2.4 / 9.7 MB of float32 logits (0.7 / 2.9 us at 3.35
TB/s). The step's last kernels, on its critical path.

The kernel, one program per (row, chunk of BLOCK vocabulary entries), reads its logits z0 once and keeps:
    z = z0 x inv_temperature; m = max z; s = sum exp(z - m)          (the chunk's part of the row's log-sum-exp)
    key = z0 where the row is greedy, else z - log(-log u)           (u: `counter_noise.uniform`'s bits, its hash in
                                                                      uint32 arithmetic, which wraps as its int64
                                                                      arithmetic is masked)
    the key's maximum and its first index
The row's last program to arrive (an int32 counter a row: the barrier, then an acq_rel add at GPU scope, as
`norm_epilogue`'s slices kernel) combines the chunks: top = max m, log_sum = log(sum s exp(m - top)), the token =
the key's first maximum over the row, log p = (z_token - top) - log_sum; then zeroes the row's counter again (a
CUDA graph replays the launch).

Against `counter_noise.sample` (and `sample_chunked`): the same noise and the same exponential race, whose argmax is
taken of z - log E instead of log p - log E (log p = z - (top + log_sum): a constant a row apart from its float32
rounding). So a stochastic row's token is the same unless two entries' race values lie within a float32 rounding
of each other; a greedy row's is the first maximum of its logits, exactly as there; log p within a float32 rounding
(its sum in another order). Its launch configuration is fixed, nothing drawn. CUDA, or a CPU in Triton's interpreter
(tests).

Measured (lease 48, H100, on U): -0.011 / -0.045 / -0.014 / -0.046 ms a step (p128 x 4, p128 x 16, p512 x 4, p512
x 16), the kernel 8.0 / 15.2 us a call at 4 / 16 rows; off by default: the picker's 0.02 ms bar is not met at 4 rows
(docs/perf-notes.md, "Decode step")."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from rollout_lib.backends import counter_noise
from rollout_lib.backends.triton_ops import device_key, opaque_op, zeroed_counters

if TYPE_CHECKING:
    import torch

BLOCK = 2048  # vocabulary entries a program: 151,936 -> 75 chunks, 300 programs at 4 rows, 1,200 at 16
WARPS = 4  # 16 entries a thread at BLOCK 2048
MAX_ROWS = 65536  # rows a launch may have: one int32 counter each, made by prepare()

_LOCKS: dict[str, Any] = {}  # device -> int32 counters [MAX_ROWS], zeroed before any capture (prepare)
_OP = None  # the op, read by the compiled step as a global

mix32 = None  # the hash's avalanche, a Triton function (triton_jit.mix32) set by _kernel()


@functools.cache
def _kernel():
    """The Triton kernel, defined once per process."""
    import triton
    import triton.language as tl

    from rollout_lib.backends import triton_jit

    global mix32  # a global: Triton's interpreter reads a kernel's globals, not its closure
    mix32 = triton_jit.mix32

    @triton.jit  # vocab and the row's stride specialized: divisible by 16 (151,936), the loads are 16 bytes wide
    def counter_sample_kernel(logits_ptr, seeds_ptr, step_ptr, inv_t_ptr, greedy_ptr, m_ptr, s_ptr, key_ptr, at_ptr,
                              lock_ptr, tokens_ptr, logp_ptr, vocab, logits_row, CHUNKS: tl.constexpr,
                              CHUNKS_BLOCK: tl.constexpr, BLOCK: tl.constexpr, SALT: tl.constexpr,
                              MULT_1: tl.constexpr, MULT_2: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row x logits_row past 2**31 at many rows
        chunk = tl.program_id(1)
        index = chunk * BLOCK + tl.arange(0, BLOCK)
        keep = index < vocab
        raw = tl.load(logits_ptr + row * logits_row + index, mask=keep, other=float("-inf"))
        inv_t = tl.load(inv_t_ptr + row)
        greedy = tl.load(greedy_ptr + row) != 0
        z = raw * inv_t
        m = tl.max(z, axis=0)
        safe_m = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf logits adds nothing to the sum
        s = tl.sum(tl.where(keep, tl.exp(z - safe_m), 0.0), axis=0)
        # u(seed, step, index): counter_noise.uniform's hash, (seed ^ SALT), then the step, then the index
        h = mix32(tl.load(seeds_ptr + row).to(tl.uint32) ^ SALT, MULT_1, MULT_2)
        h = mix32(h ^ tl.load(step_ptr).to(tl.uint32), MULT_1, MULT_2)
        bits = mix32(h ^ index.to(tl.uint32), MULT_1, MULT_2)
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        race = z - tl.log(-tl.log(u))
        key = tl.where(keep, tl.where(greedy, raw, race), float("-inf"))
        best = tl.max(key, axis=0)
        at = tl.min(tl.where(key == best, index, vocab), axis=0)  # the first maximum
        part = row * CHUNKS + chunk
        tl.store(m_ptr + part, m)
        tl.store(s_ptr + part, s)
        tl.store(key_ptr + part, best)
        tl.store(at_ptr + part, at)
        # the chunk's partials stored by every thread before the count; the row's last program acquires them
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == CHUNKS - 1:
            chunks = tl.arange(0, CHUNKS_BLOCK)
            has = chunks < CHUNKS
            ms = tl.load(m_ptr + row * CHUNKS + chunks, mask=has, other=float("-inf"), cache_modifier=".cg")
            ss = tl.load(s_ptr + row * CHUNKS + chunks, mask=has, other=0.0, cache_modifier=".cg")
            keys = tl.load(key_ptr + row * CHUNKS + chunks, mask=has, other=float("-inf"), cache_modifier=".cg")
            ats = tl.load(at_ptr + row * CHUNKS + chunks, mask=has, other=0, cache_modifier=".cg")
            top = tl.max(ms, axis=0)
            safe_top = tl.where(top == float("-inf"), 0.0, top)
            log_sum = tl.log(tl.sum(tl.where(has, ss * tl.exp(ms - safe_top), 0.0), axis=0))
            winner = tl.max(keys, axis=0)
            token = tl.min(tl.where(has & (keys == winner), ats, vocab), axis=0)  # chunks in order: the first
            token = tl.minimum(token, vocab - 1)  # NaN logits match no maximum: a token inside the row all the same
            z_token = tl.load(logits_ptr + row * logits_row + token) * inv_t
            tl.store(tokens_ptr + row, token.to(tl.int64))
            tl.store(logp_ptr + row, (z_token - safe_top) - log_sum)
            tl.atomic_xchg(lock_ptr + row, 0)  # zero again for the next launch (or graph replay)

    return counter_sample_kernel


def launch(logits: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor, inv_temperature: torch.Tensor,
           greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on float32 logits [B, V] (the last dimension contiguous), seeds [B] int64, the step (a one-element
    int64 tensor), inv_temperature [B] float32 and greedy [B] bool: (tokens [B] int64, log p [B] float32), as
    `counter_noise.sample` returns them. `prepare(device)` first."""
    import torch
    import triton

    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"SAMPLER triton: logits {logits.dtype} with strides {tuple(logits.stride())}; allowed: "
                         "float32 with the vocabulary contiguous")
    if not 0 < vocab < 2 ** 31 or rows > MAX_ROWS:
        raise ValueError(f"SAMPLER triton: logits of {rows} rows x {vocab} entries; allowed: up to {MAX_ROWS} rows "
                         f"of 1 to {2 ** 31 - 1} entries")
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logp
    key = device_key(logits.device)
    if key not in _LOCKS:
        raise RuntimeError(f"SAMPLER triton: triton_sampler.prepare({logits.device}) was not called before use")
    chunks = triton.cdiv(vocab, BLOCK)
    m, s, best = (torch.empty((rows, chunks), dtype=torch.float32, device=logits.device) for _ in range(3))
    at = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    flags = greedy.view(torch.uint8) if greedy.dtype == torch.bool else (greedy != 0).to(torch.uint8)  # a view
    _kernel()[(rows, chunks)](
        logits, seeds.to(torch.int64), step.to(torch.int64).reshape(1), inv_temperature.to(torch.float32), flags,
        m, s, best, at, _LOCKS[key], tokens, logp, vocab, logits.stride(0), CHUNKS=chunks,
        CHUNKS_BLOCK=triton.next_power_of_2(chunks), BLOCK=BLOCK, SALT=counter_noise.STREAM_SALT,
        MULT_1=counter_noise.MULT_1, MULT_2=counter_noise.MULT_2, num_warps=WARPS)
    return tokens, logp


def _op():
    """The custom op `rollout::counter_sample`, registered once per process: the kernel behind an opaque op with a
    shape-only fake, so the compiled step calls it as it calls a cuBLAS GEMM and inductor chooses nothing."""
    global _OP
    if _OP is None:
        import torch

        _OP = opaque_op("rollout::counter_sample", launch,
                        lambda logits, seeds, step, inv_temperature, greedy: (
                            logits.new_empty((logits.shape[0],), dtype=torch.int64),
                            logits.new_empty((logits.shape[0],), dtype=torch.float32)),
                        dict.fromkeys(("logits", "seeds", "step", "inv_temperature", "greedy"), torch.Tensor),
                        returns=tuple[torch.Tensor, torch.Tensor])
    return _OP


def prepare(device: Any) -> None:
    """The op registered, the kernel defined and the device's row counters made (zeroed) now, outside any compiled
    trace or capture (engine construction): a buffer first allocated inside a capture would be zeroed only when
    the graph first replays."""
    _op()
    _kernel()
    key = device_key(device)
    if key not in _LOCKS:
        _LOCKS[key] = zeroed_counters(device, MAX_ROWS)[0]


def sample(logits: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor | int, inv_temperature: torch.Tensor,
           greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`counter_noise.sample`'s signature and outputs (see the module for how they may part), through the op."""
    import torch

    if not isinstance(step, torch.Tensor):
        step = torch.tensor(step, dtype=torch.int64, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return (_OP or _op())(logits, seeds, step, inv_temperature, greedy)
