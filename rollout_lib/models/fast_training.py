"""The training half at the speed of its work (issue 41): the same NF4 + LoRA actor, trained through a
dense mirror of its base weights, in one batched pass, with per-token log-probabilities from a fused
linear cross-entropy kernel.

Why it is the same computation as `training.ActorTrainer` (the reference, kept as it is):
- bitsandbytes' NF4 matmul for more than one token dequantizes the weight to the compute dtype and calls
  a dense matmul; its backward multiplies by the same dequantized weight. The mirror holds exactly those
  dequantized values (`actor.dequantized_linear_weights`), computed once: the NF4 base never changes,
  only LoRA does.
- The LoRA parameters are *the actor's own* `nn.Parameter` objects, shared by the mirror's peft layers:
  the optimizer steps the source of truth directly, there is nothing to copy back and nothing to drift.
- Embedding and norms are the actor's tensors too; the LM head is the actor's float32 head (the
  preregistered float32 logits), applied by Liger Kernel's fused linear cross-entropy with float32
  inputs (`reduction="none"`: -log p of each target token, no [tokens, vocab] block kept for backward),
  or on a machine without Triton by the reference's chunked float32 head.
- Rows are right-padded as in the reference; under causal attention padding after a row's last token
  does not change its log-probabilities, so one batch of 16 rows scores what 8 batches of 2 scored.

What differs is the cost: one batched pass (micro-batches only above `max_tokens_per_micro_batch`
padded tokens), no NF4 dispatch per projection per pass, no gradient checkpointing unless asked, a few
head kernels instead of 32 checkpointed chunks. The price is memory: the mirror's dense projections
(0.88 GB in bf16 at Qwen3-0.6B shape) and, without checkpointing, every layer's activations of a
micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_lib.models.actor import dequantized_linear_weights, mm_float32
from rollout_lib.models.synthetic import load_causal_lm
from rollout_lib.models.training import lora_parameters, response_logprobs

if TYPE_CHECKING:
    import torch

    from rollout_lib.study.cycle import OptimizerSpec, TrainingSpec

LOGPROB_KERNELS = ("liger", "torch_chunked", "bf16_operands")
TORCH_CHUNK_TOKENS = 1024  # float32 [1024, 151936] logits = 0.62 GB per chunk (checkpointed under autograd)
BF16_OPERANDS_CHUNK_TOKENS = 512  # float32 [512, 151936] logits: 0.31 GB live per chunk, forward and backward

Rows = list[tuple[tuple[int, ...], tuple[int, ...]]]


def liger_unavailable_reason(device: Any) -> str | None:
    """None when Liger Kernel's fused linear cross-entropy can run on `device`, else why not."""
    if getattr(device, "type", str(device)) != "cuda":
        return "Liger Kernel's Triton kernels need a CUDA device"
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction  # noqa: F401
    except ImportError as exc:
        return f"liger_kernel is not importable: {exc}"
    return None


def resolve_logprob_kernel(requested: str, device: Any) -> str:
    """The kernel a run uses: `liger` where it can run, else refused by name (never a silent fallback
    on a GPU: a run's header names the kernel its numbers came from)."""
    if requested not in LOGPROB_KERNELS:
        raise ValueError(f"logprob_kernel {requested!r} is not allowed; allowed: {', '.join(LOGPROB_KERNELS)}")
    if requested == "liger":
        reason = liger_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"logprob_kernel liger: {reason} (use torch_chunked)")
    return requested


class _Bf16OperandsLogprobs:
    """log p(target | hidden) with float32 logits computed from bf16 operands (issue 41).

    The head is the float32 copy of the tied bf16 embedding and, in bf16 compute, the hidden states are
    bf16: every product of two bf16 numbers is exact in float32, so a bf16 GEMM that sums in float32 is
    the preregistered float32 head in another summation order, on tensor cores instead of SIMT float32
    (~16x the throughput on an H200). Liger's fused kernel computes logits in its inputs' dtype, so it
    would need float32 inputs and SIMT GEMMs (lease 21: ~0.3 s of a 1.0 s update at p512-r512).
    Backward: d log p / d hidden = (onehot - softmax) @ W, with the float32 factor split into two bf16
    terms (hi + lo: 16 significant bits) so its GEMMs run on bf16 operands too; the result is rounded to
    the hidden states' bf16 as the reference's float32 head's gradient is."""

    @staticmethod
    def function():
        import torch

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, hidden, weight, targets):
                out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
                lse = torch.empty_like(out)
                for start in range(0, hidden.shape[0], BF16_OPERANDS_CHUNK_TOKENS):
                    end = start + BF16_OPERANDS_CHUNK_TOKENS
                    logits = mm_float32(hidden[start:end], weight.t())
                    lse[start:end] = torch.logsumexp(logits, dim=-1)
                    out[start:end] = logits.gather(1, targets[start:end, None])[:, 0] - lse[start:end]
                ctx.save_for_backward(hidden, weight, targets, lse)
                return out

            @staticmethod
            def backward(ctx, grad):
                hidden, weight, targets, lse = ctx.saved_tensors
                grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
                for start in range(0, hidden.shape[0], BF16_OPERANDS_CHUNK_TOKENS):
                    end = start + BF16_OPERANDS_CHUNK_TOKENS
                    factor = mm_float32(hidden[start:end], weight.t())
                    factor.sub_(lse[start:end, None]).exp_().mul_(-grad[start:end, None])  # -g * softmax
                    factor.scatter_add_(1, targets[start:end, None], grad[start:end, None])  # + g * onehot
                    high = factor.to(torch.bfloat16)
                    low = factor.sub_(high.float()).to(torch.bfloat16)
                    grad_hidden[start:end] = mm_float32(high, weight) + mm_float32(low, weight)
                return grad_hidden.to(hidden.dtype), None, None

        return Function


_BF16_OPERANDS = None


@dataclass(frozen=True, eq=False)
class Head:
    """A model's LM head for the fused log-probabilities: the float32 weight, and for the bf16_operands
    kernel the bf16 tensor whose exact upcast it is (the tied embedding itself where it is: no copy).
    A model with the bf16-operand head (`actor.use_bf16_operand_head`) has no float32 weight: None."""

    weight: torch.Tensor | None
    operands: torch.Tensor | None = None


_HEADS: dict[int, Head] = {}


def model_head(model: Any, kernel: str) -> Head:
    """The head of `model` for `kernel` (checked once per head weight and kept: the check reads the whole
    head)."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.get_output_embeddings(), "is_bf16_operand_head", False):
        if kernel != "bf16_operands":
            raise ValueError(f"logprob_kernel {kernel}: the model's head is the bf16-operand head (no float32 "
                             "copy); allowed: bf16_operands")
        return Head(None, base.get_output_embeddings().weight.detach())
    weight = head_weight(model)
    if kernel != "bf16_operands":
        return Head(weight)
    cached = _HEADS.get(id(weight))
    if cached is not None and cached.weight is weight:
        return cached
    embed = base.get_input_embeddings().weight
    candidate = embed if embed.dtype == torch.bfloat16 and embed.shape == weight.shape else weight.to(torch.bfloat16)
    for start in range(0, weight.shape[0], 16384):
        if not torch.equal(candidate[start:start + 16384].float(), weight[start:start + 16384]):
            raise ValueError("logprob_kernel bf16_operands: the float32 head holds values bf16 cannot represent "
                             "(use liger or torch_chunked)")
    head = Head(weight, candidate.detach())
    _HEADS[id(weight)] = head
    return head


def head_weight(model: Any) -> torch.Tensor:
    """The float32 LM-head weight of a model with `use_float32_lm_head` applied (peft or plain)."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if not getattr(head, "is_float32_lm_head", False) or head.weight.dtype != torch.float32:
        raise ValueError("the model's LM head is not the float32 head (models.actor.use_float32_lm_head)")
    return head.weight


def fused_logprobs(hidden: torch.Tensor, head: Head, targets: torch.Tensor, kernel: str) -> torch.Tensor:
    """log p(targets[i] | hidden[i]) in float32 for hidden [N, H], the float32 head [V, H], targets [N]."""
    import torch

    weight = head.weight
    if kernel == "bf16_operands":
        global _BF16_OPERANDS
        if hidden.dtype != torch.bfloat16 or head.operands is None:
            raise ValueError(f"logprob_kernel bf16_operands: hidden states are {hidden.dtype}, not bfloat16 "
                             "(float32 compute: use liger or torch_chunked)")
        _BF16_OPERANDS = _BF16_OPERANDS or _Bf16OperandsLogprobs.function()
        return _BF16_OPERANDS.apply(hidden, head.operands, targets)
    x = hidden.to(torch.float32)
    if kernel == "liger":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        nll = LigerFusedLinearCrossEntropyFunction.apply(x, weight, targets, None, None, -100, 0.0, 0.0, "none")[0]
        return -nll

    def head(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, weight)

    return response_logprobs(head, x, targets, TORCH_CHUNK_TOKENS, checkpointed=x.requires_grad)


def micro_batches(rows: Rows, max_tokens: int) -> list[list[int]]:
    """Consecutive groups of row indices whose padded size (rows x longest row) stays <= max_tokens;
    a single row longer than the budget is a group of its own."""
    groups: list[list[int]] = []
    current: list[int] = []
    width = 0
    for index, (prompt, response) in enumerate(rows):
        length = len(prompt) + len(response)
        if current and (len(current) + 1) * max(width, length) > max_tokens:
            groups.append(current)
            current, width = [], 0
        current.append(index)
        width = max(width, length)
    if current:
        groups.append(current)
    return groups


def _pack(rows: Rows, indices: list[int], pad_id: int, device: Any):
    """(input ids [B, W], flat positions of the response-predicting states [N], targets [N], lengths)."""
    import torch

    width = max(len(rows[i][0]) + len(rows[i][1]) for i in indices)
    ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    positions, targets, lengths = [], [], []
    for k, i in enumerate(indices):
        prompt, response = rows[i]
        sequence = list(prompt) + list(response)
        ids[k, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        start = k * width + len(prompt) - 1
        positions.extend(range(start, start + len(response)))
        targets.extend(response)
        lengths.append(len(response))
    as_long = {"dtype": torch.long, "device": device}
    return ids.to(device), torch.tensor(positions, **as_long), torch.tensor(targets, **as_long), lengths


def batched_logprobs(decoder: Any, head: Head, rows: Rows, indices: list[int], pad_id: int, device: Any,
                     kernel: str) -> list[torch.Tensor]:
    """Per-row float32 log-probabilities of the response tokens of rows[indices], one decoder pass.
    Differentiable when called under autograd (the caller decides: inference_mode or not)."""
    import torch

    ids, positions, targets, lengths = _pack(rows, indices, pad_id, device)
    hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
    if flat.shape[0] == 0:
        return [flat.new_zeros(0, dtype=torch.float32) for _ in indices]
    return list(fused_logprobs(flat, head, targets, kernel).split(lengths))


def score_rows(model: Any, rows: Rows, device: Any, pad_id: int, max_tokens: int, kernel: str,
               decoder: Any = None) -> list[torch.Tensor]:
    """Teacher-forced log-probabilities (float32, CPU, one tensor per row) on the fast path: batched
    decoder passes of at most `max_tokens` padded tokens and the fused head. `decoder` overrides the
    model's own (the actor is scored through its mirror)."""
    import torch

    if decoder is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder = base.model
    head = model_head(model, kernel)
    out: list[torch.Tensor | None] = [None] * len(rows)
    with torch.inference_mode():
        for group in micro_batches(rows, max_tokens):
            for i, values in zip(group, batched_logprobs(decoder, head, rows, group, pad_id, device, kernel),
                                 strict=True):
                out[i] = values.float().cpu()
    return out  # type: ignore[return-value]


def build_training_mirror(actor: Any, snapshot_dir: str, compute_dtype: torch.dtype, device: Any) -> Any:
    """A plain (unquantized) copy of the actor's decoder whose projections hold the exact dequantized NF4
    weights, whose embedding and norms are the actor's tensors, and whose peft LoRA parameters are the
    actor's own Parameter objects. Returns the mirror's decoder (a transformers Qwen3Model)."""
    import torch

    from rollout_lib.models.actor import add_lora

    dense = load_causal_lm(snapshot_dir, compute_dtype, str(device))
    weights = dequantized_linear_weights(actor)
    actor_base = actor.get_base_model()
    modules = dict(dense.named_modules())
    with torch.no_grad():
        for name, weight in weights.items():
            target_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            target = modules[target_name].weight
            if tuple(target.shape) != tuple(weight.shape):
                raise RuntimeError(f"{target_name}: mirror shape {tuple(target.shape)} != NF4 {tuple(weight.shape)}")
            target.copy_(weight.to(device=target.device, dtype=compute_dtype))
    # the head is applied by the fused kernel with the actor's float32 weight: the mirror keeps none
    dense.config.tie_word_embeddings = False
    dense.lm_head = torch.nn.Identity()
    _share_frozen(dense.model, actor_base.model)
    mirror = add_lora(dense, _lora_spec_of(actor))
    _share_lora(mirror, actor)
    return mirror


class _LoraOf:
    def __init__(self, config: Any):
        self.rank, self.alpha, self.dropout = config.r, config.lora_alpha, config.lora_dropout
        self.target_modules = tuple(sorted(config.target_modules))


def _lora_spec_of(actor: Any) -> _LoraOf:
    return _LoraOf(actor.peft_config["default"])


def _share_frozen(dense_decoder: Any, actor_decoder: Any) -> None:
    """Embedding and norms: the actor's tensors (same values, loaded from the same snapshot in the same
    dtype), so the mirror adds only its dense projections."""
    import torch

    actor_params = dict(actor_decoder.named_parameters())
    for module_name, module in dense_decoder.named_modules():
        for name, param in list(module._parameters.items()):
            full = f"{module_name}.{name}" if module_name else name
            if full.endswith("proj.weight") or param is None:
                continue  # the dequantized projections are the mirror's own
            source = actor_params.get(full)
            if source is None or source.shape != param.shape or source.dtype != param.dtype:
                raise RuntimeError(f"mirror parameter {full}: no matching actor tensor to share")
            if not torch.equal(source.detach(), param.detach()):
                raise RuntimeError(f"mirror parameter {full}: the actor's tensor holds other values")
            module._parameters[name] = source


def _share_lora(mirror: Any, actor: Any) -> None:
    actor_params = {name: p for name, p in actor.named_parameters() if "lora_" in name}
    shared = 0
    for module_name, module in mirror.named_modules():
        for name, param in list(module._parameters.items()):
            full = f"{module_name}.{name}"
            if "lora_" not in full or param is None:
                continue
            if full not in actor_params:
                raise RuntimeError(f"mirror LoRA parameter {full} has no counterpart in the actor")
            module._parameters[name] = actor_params[full]
            shared += 1
    if shared != len(actor_params):
        raise RuntimeError(f"shared {shared} LoRA parameters of the actor's {len(actor_params)}")


class FastActorTrainer:
    """`training.ActorTrainer`'s contract (step, optimizer_state_bytes, .actor) on the fast path.

    AdamW steps the actor's live float32 LoRA tensors (shared with the mirror); the NF4 base stays the
    frozen source of truth. `score` gives the actor's teacher-forced log-probabilities the same way."""

    def __init__(self, actor: Any, spec: OptimizerSpec, snapshot_dir: str, training: TrainingSpec,
                 compute_dtype: torch.dtype, device: Any):
        import torch

        self.actor, self.spec, self.training = actor, spec, training
        self.device = torch.device(device)
        self.kernel = resolve_logprob_kernel(training.logprob_kernel, self.device)
        if self.kernel == "bf16_operands" and compute_dtype != torch.bfloat16:  # refused before the mirror is built
            raise ValueError(f"logprob_kernel bf16_operands: compute dtype is {compute_dtype}, not bfloat16 "
                             "(use liger or torch_chunked)")
        self.mirror = build_training_mirror(actor, snapshot_dir, compute_dtype, self.device)
        self.decoder = self.mirror.get_base_model().model
        if training.gradient_checkpointing:
            self.mirror.get_base_model().gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.mirror.eval()
        self.head = model_head(actor, self.kernel)
        self.params = lora_parameters(actor)
        for param in self.params:
            param.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.params, lr=spec.learning_rate, betas=(spec.beta1, spec.beta2),
                                           eps=spec.eps, weight_decay=spec.weight_decay, foreach=True)
        self.steps = 0

    def strategy(self) -> dict[str, Any]:
        """What a cycle run's header records of how the training half ran."""
        return {"path": "fused_mirror", "logprob_kernel": self.kernel,
                "max_tokens_per_micro_batch": self.training.max_tokens_per_micro_batch,
                "gradient_checkpointing": self.training.gradient_checkpointing,
                "mirror": "dense copy of the dequantized NF4 projections; embedding, norms, float32 head and "
                          "LoRA parameters shared with the actor",
                **({} if self.training.float32_head_copies else
                   {"heads": "the tied bf16 embeddings (float32 sums of exact bf16 products), no float32 copies"})}

    def score(self, rows: Rows, device: Any, pad_id: int) -> list[torch.Tensor]:
        return score_rows(self.actor, rows, device, pad_id, self.training.max_tokens_per_micro_batch, self.kernel,
                          decoder=self.decoder)

    def step(self, loss_for_micro_batch: Any, rows: Rows, device: Any, pad_id: int) -> dict[str, Any]:
        """One optimizer step over every row (micro-batches only above the token budget); same return as
        the reference: summed loss, gradient norm before clipping, the actor's log-probabilities."""
        import torch

        self.mirror.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[float] = []
        out: list[torch.Tensor | None] = [None] * len(rows)
        try:
            for group in micro_batches(rows, self.training.max_tokens_per_micro_batch):
                logprobs = batched_logprobs(self.decoder, self.head, rows, group, pad_id, device, self.kernel)
                loss = loss_for_micro_batch(group, logprobs)
                loss.backward()
                losses.append(loss.detach())
                for i, values in zip(group, logprobs, strict=True):
                    out[i] = values.detach().float().cpu()
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.spec.max_grad_norm or math.inf)
            self.optimizer.step()
        finally:
            self.mirror.eval()
        self.steps += 1
        return {"loss": float(sum(float(v) for v in losses)), "grad_norm": float(norm), "logprobs": out,
                "trainable_parameters": sum(p.numel() for p in self.params)}

    def optimizer_state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if hasattr(t, "numel"))
