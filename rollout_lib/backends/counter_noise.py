"""Counter-based sampling noise: a pure function of (request seed, step, vocabulary index).

Per-row `torch.Generator`s cannot live inside a captured CUDA graph (DESIGN.md decision 10), so the
fast decode path draws its noise from an integer hash instead, computed on the device inside the
graph: reproducible, and independent of batch mates, padding, batch size and partition, because a
row's noise depends only on its own seed and step.

Hash: a 32-bit avalanche mixer (lowbias32 by C. Wellons, second multiplier replaced by an odd
constant below 2**31) applied to (seed, step, index) in turn. Every product stays below 2**63, so
int64 tensor arithmetic gives the same bits on CPU and CUDA (no signed overflow anywhere). The top
24 bits make a uniform u in (0, 1); the exponential race argmax(p / E) with E = -log(u) is an exact
sample from p (the same trick as the eager sampler and vLLM's), written as
argmax(log p - log E) to stay in log space.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

MASK32 = 0xFFFFFFFF
MULT_1 = 0x7FEB352D  # < 2**31: (2**32 - 1) * MULT < 2**63
MULT_2 = 0x6CA68B4D
STREAM_SALT = 0x2545F491  # separates this stream from any other use of the same seeds


def mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit avalanche on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * MULT_1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MULT_2) & MASK32
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, step: torch.Tensor | int, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1): u(seed_b, step, v). `seeds` [B] int64, `step` a 0-d tensor or int."""
    import torch

    seed = seeds.to(torch.int64) & MASK32
    h = mix32(seed ^ STREAM_SALT)
    h = mix32(h ^ (torch.as_tensor(step, dtype=torch.int64, device=seeds.device) & MASK32))
    index = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    h = mix32(h[:, None] ^ index[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor | int, inv_temperature: torch.Tensor,
           greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> (tokens [B] int64, log-probabilities [B] float32 of the chosen tokens
    under softmax(logits * inv_temperature)). Greedy rows take the argmax of the logits and must
    carry inv_temperature 1.0 (their log-probability is then that of softmax(logits))."""
    import torch

    logp = torch.log_softmax(logits * inv_temperature[:, None], dim=-1)
    race = logp - torch.log(-torch.log(uniform(seeds, step, logits.shape[-1])))
    tokens = torch.where(greedy, logits.argmax(dim=-1), race.argmax(dim=-1))
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def vocabulary_chunks(vocab_size: int, most: int = 128) -> int:
    """The largest divisor of `vocab_size` up to `most`: how many chunks `sample_chunked` splits a row into
    (151,936 = 128 x 1,187; a prime vocabulary gets 1, which is `sample`'s one pass per row)."""
    return max(d for d in range(1, most + 1) if vocab_size % d == 0)


def sample_chunked(logits: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor | int,
                   inv_temperature: torch.Tensor, greedy: torch.Tensor, chunks: int,
                   in_chunks: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` with every reduction over the vocabulary split into `chunks` pieces, then combined, so a
    compiled step runs B x chunks reduction programs instead of B (one per row: 4-16 of the GPU's 132 SMs,
    ~85 us per step on the H200 for what is ~10 MB of logits). The same noise and the same formulas:
    log p = (z - max) - log(sum exp(z - max)), the race argmax(log p - log E), the first maximum on ties; only
    the order of the sum differs (float32 rounding of log p).
    The [rows, vocabulary] logits are viewed as [rows, chunks, width] here, outside `in_chunks` (the compiled
    `sample_in_chunks`, by default uncompiled): inside a dynamic-shape compilation that view left inductor a
    split it could not prove (lease 30: `CantSplit: s24 not divisible by s24*((s50//s24))`); a view is free in
    eager code and in a captured graph."""
    rows, vocab = logits.shape
    return (in_chunks or sample_in_chunks)(logits.view(rows, chunks, vocab // chunks), seeds, step,
                                           inv_temperature, greedy)


def sample_in_chunks(logits: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor | int,
                     inv_temperature: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_chunked` on logits [rows, chunks, width] (vocabulary index = chunk x width + column): no reshape
    of the vocabulary inside, so a compilation with every size symbolic has nothing to split."""
    import torch

    rows, chunks, width = logits.shape
    z = logits * inv_temperature[:, None, None]
    top = z.amax(dim=-1).amax(dim=-1)  # [B]: the row's max, from per-chunk maxima
    shifted = z - top[:, None, None]
    log_sum = torch.log(torch.exp(shifted).sum(dim=-1).sum(dim=-1))  # [B]
    logp = shifted - log_sum[:, None, None]
    race = logp - torch.log(-torch.log(_uniform_in_chunks(seeds, step, chunks, width)))

    def argmax_of(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, S, W] -> chunk, column [B, 1]
        best, at = values.max(dim=-1)
        chunk = best.argmax(dim=-1, keepdim=True)
        return chunk, at.gather(-1, chunk)

    (greedy_chunk, greedy_at), (race_chunk, race_at) = argmax_of(logits), argmax_of(race)
    chunk = torch.where(greedy[:, None], greedy_chunk, race_chunk)
    at = torch.where(greedy[:, None], greedy_at, race_at)
    chosen = logp.gather(1, chunk[:, :, None].expand(rows, 1, width)).gather(-1, at[:, :, None])
    return (chunk * width + at)[:, 0], chosen[:, 0, 0]


def _uniform_in_chunks(seeds: torch.Tensor, step: torch.Tensor | int, chunks: int, width: int) -> torch.Tensor:
    """[B, chunks, width] float32: `uniform(seeds, step, chunks * width)` viewed as [B, chunks, width], the same
    bits (the index built as chunk x width + column instead of viewed; `uniform` itself is h200-v2's measured
    code and stays as it is)."""
    import torch

    seed = seeds.to(torch.int64) & MASK32
    h = mix32(seed ^ STREAM_SALT)
    h = mix32(h ^ (torch.as_tensor(step, dtype=torch.int64, device=seeds.device) & MASK32))
    index = (torch.arange(chunks, dtype=torch.int64, device=seeds.device)[:, None] * width
             + torch.arange(width, dtype=torch.int64, device=seeds.device)[None, :])
    h = mix32(h[:, None, None] ^ index[None])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
