"""Per-request seeded token selection shared by the HF paths.

Each stochastic request owns one `torch.Generator` seeded with its preregistered sample seed; at
every step it draws one vector of Exp(1) noise over the vocabulary and picks
argmax(p / noise) (the exponential race, an exact sample from p; vLLM's sampler uses the same
trick). A request's draws therefore depend only on its own seed and step, never on its batch
mates, batch size or position in the batch. Greedy rows take the argmax. The returned
log-probability is log_softmax(logits / T) at the chosen token, computed in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rollout_lib.study.workload import GenerationRequest


def make_generators(requests: list[GenerationRequest], device: torch.device) -> list[torch.Generator | None]:
    import torch

    generators: list[torch.Generator | None] = []
    for request in requests:
        if request.greedy:
            generators.append(None)
            continue
        if request.seed is None:
            raise ValueError(f"{request.request_id}: stochastic request without a seed (workload.sample_seeds)")
        generator = torch.Generator(device=device)
        generator.manual_seed(request.seed)
        generators.append(generator)
    return generators


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    import torch

    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the first token past p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def select_tokens(logits: torch.Tensor, requests: list[GenerationRequest],
                  generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype) -> (tokens [B] long, logprobs [B] float32)."""
    import torch

    logits = logits.float()
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    logprobs = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    greedy_rows = [i for i, r in enumerate(requests) if r.greedy]
    if greedy_rows:
        index = torch.tensor(greedy_rows, device=logits.device)
        rows = logits.index_select(0, index)
        chosen = rows.argmax(dim=-1)
        tokens[index] = chosen
        logprobs[index] = torch.log_softmax(rows, dim=-1).gather(-1, chosen[:, None])[:, 0]
    for i, request in enumerate(requests):
        if request.greedy:
            continue
        scaled = logits[i] / request.temperature
        filtered = _filter_top_k_top_p(scaled, request.top_k, request.top_p)
        probs = torch.softmax(filtered, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generators[i])
        token = torch.argmax(probs / noise)
        tokens[i] = token
        logprobs[i] = torch.log_softmax(scaled, dim=-1)[token]
    return tokens, logprobs
