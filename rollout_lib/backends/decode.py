"""The decode loops of the HF paths, and teacher-forced scoring.

- `generate_kv_cache`: batched incremental decoding. Prompts are left-padded; the attention mask
  hides padding and position ids count only real tokens, so a row's math does not depend on how
  much padding its batch mates force on it. One prefill pass, then one token per step for all rows;
  a row that stopped keeps a slot (its tokens are discarded) until every row is done.
- `generate_full_recompute`: the legacy greedy path: one padded batch, and every step runs the
  model over the full prefix (no KV cache).
- `teacher_forced`: logits of a model at every response position of given sequences.

Timing boundaries synchronize the device (prefill = prompt pass + first token selection = TTFT).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_lib.backends.sampling import make_generators, select_tokens

if TYPE_CHECKING:
    import torch

    from rollout_lib.study.workload import GenerationRequest


def synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodeOutput:
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    stop_reasons: list[str]
    prefill_s: float
    decode_s: float
    decode_steps: int


def left_pad(prompts: list[tuple[int, ...]], pad_id: int, device: torch.device):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


class _StopTracker:
    def __init__(self, requests: list[GenerationRequest]):
        self.requests = requests
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.logprobs: list[list[float]] = [[] for _ in requests]
        self.reasons: list[str | None] = [None] * len(requests)

    def add(self, tokens: list[int], logprobs: list[float]) -> None:
        for row, request in enumerate(self.requests):
            if self.reasons[row] is not None:
                continue
            self.tokens[row].append(tokens[row])
            self.logprobs[row].append(logprobs[row])
            if tokens[row] in request.eos_token_ids:
                self.reasons[row] = "eos"
            elif len(self.tokens[row]) >= request.max_new_tokens:
                self.reasons[row] = "length"

    @property
    def done(self) -> bool:
        return all(reason is not None for reason in self.reasons)


def generate_kv_cache(model, requests: list[GenerationRequest], device: torch.device, pad_id: int) -> DecodeOutput:
    import torch
    from transformers import DynamicCache

    generators = make_generators(requests, device)
    ids, mask = left_pad([r.prompt_token_ids for r in requests], pad_id, device)
    tracker = _StopTracker(requests)
    cache = DynamicCache()
    steps = 0
    with torch.inference_mode():
        synchronize(device)
        start = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        tokens, logprobs = select_tokens(out.logits[:, -1, :], requests, generators)
        tracker.add(tokens.tolist(), logprobs.tolist())  # .tolist() synchronizes
        prefill_end = time.perf_counter()
        positions = _positions(mask)[:, -1:]
        while not tracker.done:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
            positions = positions + 1
            out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True)
            tokens, logprobs = select_tokens(out.logits[:, -1, :], requests, generators)
            tracker.add(tokens.tolist(), logprobs.tolist())
            steps += 1
        synchronize(device)
        end = time.perf_counter()
    return DecodeOutput(tracker.tokens, tracker.logprobs, list(tracker.reasons), prefill_end - start,
                        end - prefill_end, steps)


def generate_full_recompute(model, requests: list[GenerationRequest], device: torch.device,
                            pad_id: int) -> DecodeOutput:
    """Legacy greedy: every step recomputes the whole (growing) prefix; no cache at all."""
    import torch

    if not all(r.greedy for r in requests):
        raise ValueError("the full-recompute path is the legacy *greedy* path; stochastic requests run sequentially")
    ids, mask = left_pad([r.prompt_token_ids for r in requests], pad_id, device)
    tracker = _StopTracker(requests)
    steps = 0
    with torch.inference_mode():
        synchronize(device)
        start = time.perf_counter()
        while not tracker.done:
            out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=False,
                        logits_to_keep=1)
            tokens, logprobs = select_tokens(out.logits[:, -1, :], requests, [None] * len(requests))
            tracker.add(tokens.tolist(), logprobs.tolist())
            ids = torch.cat([ids, tokens[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
            steps += 1
        synchronize(device)
        end = time.perf_counter()
    return DecodeOutput(tracker.tokens, tracker.logprobs, list(tracker.reasons), 0.0, end - start, steps)


@dataclass
class TeacherForced:
    logprobs: list[float]  # log p(token_t | prefix) at each response position
    argmax: list[int]
    top1_minus_top2: list[float]  # logit margin of the model's own top-1 over its top-2


def teacher_forced(model, prompt: tuple[int, ...], response: list[int], device: torch.device) -> TeacherForced:
    """Score `response` after `prompt` in one forward pass (one row: no padding involved)."""
    import torch

    if not response:
        return TeacherForced([], [], [])
    ids = torch.tensor([list(prompt) + list(response[:-1])], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(response)).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(response, dtype=torch.long, device=device)
        chosen = logp.gather(-1, target[:, None])[:, 0]
        top2 = torch.topk(logits, 2, dim=-1).values
    return TeacherForced(chosen.tolist(), logits.argmax(-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist())
