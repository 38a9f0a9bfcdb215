"""The training half of an RL cycle (issue 15): teacher-forced scoring, the two preregistered losses,
one optimizer step on the NF4 + LoRA actor, and the trained policy that a backend then serves.

Scoring is teacher-forced and batched in micro-batches of rows; only the response positions go
through the LM head, `LOGPROB_CHUNK_TOKENS` positions at a time (a [chunk, vocab] float32 block,
never [rows, length, vocab]; under autograd each chunk is checkpointed, so no [tokens, vocab] block
is kept for the backward pass), and the actor's decoder layers are checkpointed while it trains
(`GRADIENT_CHECKPOINTING`: only each layer's input is kept, the layer is recomputed in the backward
pass). Lease 11 (H200): without both, one micro-batch of two 1,024-token rows held > 4.6 GiB of
activations and logits, and the hf_cached p512-r512 cycle died of CUDA OOM under the 16 GiB budget.
Rows are right-padded: under causal attention the padding after a row's last token cannot change
its log-probabilities.

Losses (per token, averaged over every response token of the batch; micro-batch gradients add up to
the gradient of that mean):
- direct GKD, reverse KL to the teacher on the sampled tokens, in policy-gradient form:
  loss = mean_t  sg(log pi(y_t) - log p_T(y_t)) * log pi(y_t)
  (grad E_pi[log pi - log p_T] = E_pi[(log pi - log p_T) grad log pi]).
- PG-k1: loss = -mean_t A_i log pi(y_t) + beta * mean_t (log pi(y_t) - log pi_rollout(y_t)), with
  A_i = R_i - mean(R) and R_i the mean of a fixed synthetic score of the sequence's tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rollout_lib.models.policy import policy_identity
from rollout_lib.study.arch import Qwen3Arch
from rollout_lib.study.seeds import tensor_stream

if TYPE_CHECKING:
    import torch

    from rollout_lib.study.cycle import OptimizerSpec
    from rollout_lib.study.prereg import LoraSpec


# How the training half keeps its memory bounded (recorded in each cycle run's header). Chunking
# the positions does not change a log-probability (each position's softmax is its own); the chunk is
# small enough that its [chunk, vocab] float32 blocks (logits, log-softmax, gradient) stay < 0.3 GiB.
LOGPROB_CHUNK_TOKENS = 128
GRADIENT_CHECKPOINTING = True


def training_memory_strategy() -> dict[str, Any]:
    return {"logprob_chunk_tokens": LOGPROB_CHUNK_TOKENS, "gradient_checkpointing": GRADIENT_CHECKPOINTING,
            "checkpointing": "torch.utils.checkpoint, non-reentrant: the actor's decoder layers (transformers "
                             "gradient_checkpointing_enable) and each LM-head chunk"}


def _lm_parts(model: Any) -> tuple[Any, Any]:
    """(the decoder that returns hidden states, the LM head) of a transformers or peft causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model, base.get_output_embeddings()


def token_logprobs(model: Any, rows: list[tuple[tuple[int, ...], tuple[int, ...]]], device: Any, pad_id: int,
                   micro_batch_rows: int, grad: bool = False, on_micro_batch: Any = None,
                   chunk_tokens: int = LOGPROB_CHUNK_TOKENS, checkpoint_head: bool = True) -> list[torch.Tensor]:
    """Per-token log-probabilities (float32, one tensor per row) of each (prompt, response) row,
    teacher-forced. With `grad`, `on_micro_batch(indices, logprobs)` is called per micro-batch (it
    returns the loss to backpropagate then and there, so activations of one micro-batch are live at
    a time) and the returned tensors are detached; `checkpoint_head` then recomputes each LM-head
    chunk in the backward pass instead of keeping its logits."""
    import contextlib

    import torch

    decoder, head = _lm_parts(model)
    out: list[torch.Tensor | None] = [None] * len(rows)
    for start in range(0, len(rows), micro_batch_rows):
        indices = list(range(start, min(start + micro_batch_rows, len(rows))))
        width = max(len(rows[i][0]) + len(rows[i][1]) for i in indices)
        ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
        for k, i in enumerate(indices):
            sequence = list(rows[i][0]) + list(rows[i][1])
            ids[k, :len(sequence)] = torch.tensor(sequence)
        context = contextlib.nullcontext() if grad else torch.inference_mode()
        with context:
            hidden = decoder(input_ids=ids.to(device), use_cache=False).last_hidden_state
            batch = []
            for k, i in enumerate(indices):
                prompt, response = rows[i]
                if not response:
                    batch.append(torch.zeros(0, device=device))
                    continue
                positions = hidden[k, len(prompt) - 1: len(prompt) - 1 + len(response)]
                target = torch.tensor(response, dtype=torch.long, device=device)
                batch.append(response_logprobs(head, positions, target, chunk_tokens,
                                               checkpointed=grad and checkpoint_head))
            if grad and on_micro_batch is not None:
                loss = on_micro_batch(indices, batch)
                loss.backward()
        for k, i in enumerate(indices):
            out[i] = batch[k].detach().float().cpu()
    return out  # type: ignore[return-value]


def _chunk_logprobs(head: Any, positions: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    import torch

    logits = head(positions).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, target[:, None])[:, 0]


def response_logprobs(head: Any, positions: torch.Tensor, target: torch.Tensor, chunk_tokens: int,
                      checkpointed: bool = False) -> torch.Tensor:
    """log p(target_t | position_t) through the LM head, `chunk_tokens` positions at a time; with
    `checkpointed` each chunk is recomputed in the backward pass instead of keeping its logits."""
    import torch
    from torch.utils.checkpoint import checkpoint

    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, not {chunk_tokens}")
    parts = []
    for start in range(0, len(target), chunk_tokens):
        chunk = (positions[start:start + chunk_tokens], target[start:start + chunk_tokens])
        parts.append(checkpoint(_chunk_logprobs, head, *chunk, use_reentrant=False) if checkpointed
                     else _chunk_logprobs(head, *chunk))
    return torch.cat(parts) if parts else positions.new_zeros(0, dtype=torch.float32)


def token_scores(seed: int, vocab_size: int) -> list[float]:
    """The fixed synthetic per-token score of PG-k1's reward (uniform in [0, 1), from the seed)."""
    return tensor_stream(seed, "cycle/reward/token-scores").random(vocab_size).tolist()


def sequence_rewards(responses: list[tuple[int, ...]], scores: list[float]) -> list[float]:
    return [sum(scores[t] for t in r) / len(r) if r else 0.0 for r in responses]


def gkd_loss(actor: list[torch.Tensor], teacher: list[torch.Tensor], total_tokens: int) -> torch.Tensor:
    """Reverse KL to the teacher on the sampled tokens (policy-gradient form), summed / total tokens."""
    terms = [((a.detach() - t.to(a.device)) * a).sum() for a, t in zip(actor, teacher, strict=True)]
    return sum(terms) / total_tokens


def pg_k1_loss(actor: list[torch.Tensor], rollout: list[torch.Tensor], advantages: list[float],
               kl_coefficient: float, total_tokens: int) -> torch.Tensor:
    """-A_i log pi(y_t) + beta (log pi(y_t) - log pi_rollout(y_t)), summed / total tokens."""
    terms = [(-advantage * a + kl_coefficient * (a - r.to(a.device))).sum()
             for a, r, advantage in zip(actor, rollout, advantages, strict=True)]
    return sum(terms) / total_tokens


def lora_parameters(model: Any) -> list[torch.nn.Parameter]:
    params = [p for name, p in model.named_parameters() if "lora_" in name]
    if not params:
        raise ValueError("the actor has no LoRA parameters to train")
    return params


class ActorTrainer:
    """AdamW over the actor's live float32 LoRA tensors (the NF4 base stays frozen)."""

    def __init__(self, actor: Any, spec: OptimizerSpec):
        import torch

        self.actor, self.spec = actor, spec
        if GRADIENT_CHECKPOINTING:  # active in train() only: scoring and generation are unaffected
            actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.params = lora_parameters(actor)
        for param in self.params:
            param.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.params, lr=spec.learning_rate, betas=(spec.beta1, spec.beta2),
                                           eps=spec.eps, weight_decay=spec.weight_decay)
        self.steps = 0

    def step(self, loss_for_micro_batch: Any, rows: list[tuple[tuple[int, ...], tuple[int, ...]]], device: Any,
             pad_id: int) -> dict[str, Any]:
        """One optimizer step: forward + backward per micro-batch, clip, step. Returns the summed loss,
        the gradient norm before clipping and the actor's log-probabilities (detached) as computed."""
        import torch

        self.actor.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[float] = []

        def on_micro_batch(indices, logprobs):
            loss = loss_for_micro_batch(indices, logprobs)
            losses.append(float(loss.detach()))
            return loss

        try:
            logprobs = token_logprobs(self.actor, rows, device, pad_id, self.spec.micro_batch_rows, grad=True,
                                      on_micro_batch=on_micro_batch)
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.spec.max_grad_norm or math.inf)
            self.optimizer.step()
        finally:
            self.actor.eval()
        self.steps += 1
        return {"loss": sum(losses), "grad_norm": float(norm), "logprobs": logprobs,
                "trainable_parameters": sum(p.numel() for p in self.params)}

    def optimizer_state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if hasattr(t, "numel"))


@dataclass(frozen=True, eq=False)
class TrainedPolicy:
    """A policy version produced by training: the actor's live LoRA tensors after an optimizer step,
    copied at that moment (float32, CPU, canonical names). Served like a PolicyVersion."""

    version: int
    base_digest: str
    arch: Qwen3Arch
    lora: LoraSpec
    live: dict

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.live

    @cached_property
    def identity(self) -> str:
        return policy_identity(self.base_digest, self.live)

    @property
    def scaling(self) -> float:
        return self.lora.alpha / self.lora.rank
