"""A trained stand-in: a Qwen3-shape model trained briefly on real text, so it predicts like a trained model.

Issue 42 / DESIGN decision 13: a random network with a logit scale amplifies every bf16 rounding
difference, so the exactness gates measured the stand-in, not the backends. This module trains the
study's architecture from its seeded synthetic initialisation (`synthetic.synthetic_state_dict`,
logit scale 1: no calibration factor at all) on the corpus's train split (`study/corpus.py`),
tokenized by the corpus's BPE (`study/bpe_tokenizer.py`), and writes a normal HF snapshot.

Deterministic by construction where the hardware allows:
- fixed seeds: the init is the synthetic one (bit-identical everywhere); the data order is a
  permutation per epoch from `tensor_stream(seed, "standin-data-order-epoch-E")`;
- fixed data: sequences are consecutive, non-overlapping windows of the concatenated train-split ids;
- `torch.use_deterministic_algorithms(True, warn_only=True)` with `CUBLAS_WORKSPACE_CONFIG=:4096:8`,
  TF32 off, one intra-op thread on CPU (a reduction's order can follow the thread count), and eager
  attention (plain matmul + softmax; no fused attention backward with atomics); any
  warning about a nondeterministic op is recorded in the result, never hidden.
- the step's kernels are a choice (`TrainKernels`, recorded): the reference above, or faster ones that
  stay deterministic: FlashAttention-2 through SDPA (PyTorch passes `deterministic=True` to its backward
  only when deterministic algorithms are on *without* warn_only, so that choice turns warn_only off: a
  nondeterministic op then raises instead of warning), the head and cross-entropy per chunk of tokens
  (recomputed in backward, no [tokens, 151936] float32 block), the fused AdamW, and no NaN fill of fresh
  allocations (`torch.utils.deterministic.fill_uninitialized_memory`: a debugging aid that costs a write
  of each new buffer and changes no result unless a kernel reads memory it did not write).
Bit-exact reproduction on a *second* GPU machine is not known (different GPUs or drivers may pick
other cuBLAS kernels), so besides the payload digest the record carries a tolerance-checked
fingerprint: the held-out loss (to `FINGERPRINT_LOSS_TOL`) and the top-8 logits at 64 fixed held-out
positions (to `FINGERPRINT_LOGIT_TOL`), compared by `fingerprint_mismatches`.

Measured and recorded (`rollout_trained.json` in the snapshot): the held-out loss curve, next-token
entropy on held-out text with no logit scale, the top-1 probability histogram, the same metrics for
the untrained initialisation, tokens seen, wall time and tokens/s.

CLI: `rollout models train --arch qwen3-0.6b --out DIR --device cuda` (rollout_lib/cli.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rollout_lib.core import canonical_json_bytes, sha256_bytes
from rollout_lib.models.synthetic import build_snapshot, payload_digest_of_tensors
from rollout_lib.study.arch import Qwen3Arch, get_architecture
from rollout_lib.study.bpe_tokenizer import (
    check_bpe_vocab,
    default_bpe_vocab,
    encode_split,
    padded_tokenizer_json,
    tokenizer_config,
)
from rollout_lib.study.corpus import Manifest, load_manifest, verify_corpus
from rollout_lib.study.seeds import tensor_stream

DEFAULT_CORPUS = "params/corpora/transformers-5.17.0.json"
TINY_CORPUS = "params/corpora/transformers-5.17.0-generation.json"
RECORD_NAME = "rollout_trained.json"
RECORD_SCHEMA = "rollout-trained-standin/v1"
FINGERPRINT_POSITIONS = 64
FINGERPRINT_TOP_K = 8
FINGERPRINT_LOSS_TOL = 1e-3
FINGERPRINT_LOGIT_TOL = 0.05
TOP1_HISTOGRAM_BINS = 20

# init seeds: the synthetic seeds of the frozen studies (v2 actor 6061, teacher 1717; smoke 7 and 8)
INIT_SEEDS = {("qwen3-0.6b", "actor"): 6061, ("qwen3-1.7b", "teacher"): 1717, ("qwen3-1.7b", "actor"): 1717,
              ("qwen3-0.6b", "teacher"): 6061, ("tiny", "actor"): 7, ("tiny", "teacher"): 8}


@dataclass(frozen=True)
class TrainRecipe:
    """How one architecture is trained. The H200 budget (issue 42): <= 5 GPU-minutes for both models.
    Issue 42's first trial ran 5.4M tokens through the 0.6B shape in 2 minutes (32k vocabulary). The
    full 151,936-row head adds ~25% per token to the 0.6B and the 1.7B costs ~3x per token, so the
    recipes below plan 4.19M tokens for the actor (~2 min) and 2.10M for the teacher (~2.5-3 min);
    the record states the measured wall time, which decides whether the steps must move."""

    steps: int
    batch_sequences: int
    sequence_tokens: int
    peak_lr: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    eval_every_steps: int
    eval_sequences: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch_sequences * self.sequence_tokens

    @property
    def planned_tokens(self) -> int:
        return self.steps * self.tokens_per_step


RECIPES: dict[str, TrainRecipe] = {
    "qwen3-0.6b": TrainRecipe(steps=512, batch_sequences=8, sequence_tokens=1024, peak_lr=6e-4, warmup_steps=32,
                              min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0, eval_every_steps=64,
                              eval_sequences=16),
    "qwen3-1.7b": TrainRecipe(steps=256, batch_sequences=8, sequence_tokens=1024, peak_lr=4e-4, warmup_steps=16,
                              min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0, eval_every_steps=32,
                              eval_sequences=16),
    # CPU tests: seconds on two cores
    "tiny": TrainRecipe(steps=240, batch_sequences=8, sequence_tokens=64, peak_lr=1e-2, warmup_steps=12,
                        min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0, eval_every_steps=40, eval_sequences=16),
}


class TrainError(ValueError):
    """Bad training input (named field); raised before any work is done or file written."""


LOSS_CHUNK_TOKENS = 1024  # float32 logits of one chunk at vocabulary 151,936: 0.62 GB


@dataclass(frozen=True)
class TrainKernels:
    """How a training step is computed; the recipe (data, steps, learning rate) is the same whichever is
    chosen, the weights differ in rounding only. The defaults are the reference kernels of lease 22's
    stand-ins (issue 42); `tools/profile_standin_training.py` measures each choice against them."""

    attention: str = "eager"  # eager | sdpa (FlashAttention-2, its deterministic backward)
    loss: str = "full"  # full | chunked (head + cross-entropy per LOSS_CHUNK_TOKENS, recomputed in backward)
    optimizer: str = "foreach"  # foreach | fused (torch's fused AdamW: one kernel per step)
    fill_uninitialized: bool = True  # torch fills fresh allocations with NaN under deterministic algorithms
    step: str = "eager"  # eager | graph (the whole step captured as one CUDA graph; CUDA and sdpa only)

    @property
    def autocast_cache(self) -> bool:
        """Inside a CUDA-graph capture autocast keeps no cache of cast weights (as torch asks of captured autocast
        regions); a cast weight is used once per forward anyway."""
        return self.step != "graph"

    @property
    def strict_determinism(self) -> bool:
        """Deterministic algorithms without warn_only: FlashAttention-2's backward is deterministic only then."""
        return self.attention == "sdpa"

    def describe(self) -> dict[str, Any]:
        return asdict(self) | {"sdpa_backend": "flash_attention" if self.attention == "sdpa" else None,
                               "loss_chunk_tokens": LOSS_CHUNK_TOKENS if self.loss == "chunked" else None,
                               "graph_warmup_steps": GraphStep.WARMUP_STEPS if self.step == "graph" else None}


# Named kernel sets (`rollout models train --kernels NAME`): "reference" trained lease 22's stand-ins (and
# reproduced them bit for bit on a second machine, lease 26); "fast" is the fastest deterministic set of
# lease 26's profile on one H200 (actor x1.55 per step: docs/perf-notes.md, "Stand-in training").
KERNEL_PRESETS: dict[str, TrainKernels] = {
    "reference": TrainKernels(),
    "fast": TrainKernels(attention="sdpa", optimizer="fused", fill_uninitialized=False),
}

KERNEL_CHOICES = {"attention": ("eager", "sdpa"), "loss": ("full", "chunked"), "optimizer": ("foreach", "fused"),
                  "fill_uninitialized": (True, False), "step": ("eager", "graph")}


def check_kernels(kernels: TrainKernels, device: str = "cpu") -> None:
    for field, allowed in KERNEL_CHOICES.items():
        value = getattr(kernels, field)
        if value not in allowed:
            raise TrainError(f"{field}: {value!r}; allowed: {', '.join(str(a).lower() for a in allowed)}")
    if kernels.step == "graph" and not device.startswith("cuda"):
        raise TrainError(f"step: 'graph' captures a CUDA graph, not on device {device!r}; allowed there: eager "
                         "(or device cuda, cuda:N)")
    if kernels.step == "graph" and kernels.attention != "sdpa":
        raise TrainError("step: 'graph' needs attention sdpa (eager attention builds a 4D mask inside every "
                         "captured forward); allowed: --attention sdpa, or step eager")


def lr_at(recipe: TrainRecipe, step: int) -> float:
    """Linear warmup to peak_lr, then cosine down to min_lr_ratio * peak_lr at the last step."""
    if step < recipe.warmup_steps:
        return recipe.peak_lr * (step + 1) / recipe.warmup_steps
    span = max(1, recipe.steps - 1 - recipe.warmup_steps)
    progress = min(1.0, (step - recipe.warmup_steps) / span)
    floor = recipe.min_lr_ratio * recipe.peak_lr
    return floor + (recipe.peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def token_stream(manifest: Manifest, bpe_vocab_size: int, split: str) -> np.ndarray:
    ids = [i for _, file_ids in encode_split(manifest, bpe_vocab_size, split) for i in file_ids]
    return np.asarray(ids, dtype=np.int64)


def windows(stream: np.ndarray, sequence_tokens: int) -> np.ndarray:
    """Non-overlapping windows of sequence_tokens + 1 ids (inputs and shifted targets)."""
    count = (len(stream) - 1) // sequence_tokens
    if count < 1:
        raise TrainError(f"sequence_tokens: {sequence_tokens} is longer than the split ({len(stream)} tokens)")
    starts = np.arange(count) * sequence_tokens
    return np.stack([stream[s:s + sequence_tokens + 1] for s in starts])


def batch_indices(seed: int, windows_count: int, step: int, batch: int) -> np.ndarray:
    """The window indices of one step: a fixed permutation per epoch, consumed in order."""
    out = []
    for sample in range(step * batch, (step + 1) * batch):
        epoch, within = divmod(sample, windows_count)
        out.append(_epoch_order(seed, windows_count, epoch)[within])
    return np.asarray(out, dtype=np.int64)


_ORDERS: dict[tuple[int, int, int], np.ndarray] = {}


def _epoch_order(seed: int, count: int, epoch: int) -> np.ndarray:
    key = (seed, count, epoch)
    if key not in _ORDERS:
        _ORDERS[key] = tensor_stream(seed, f"standin-data-order-epoch-{epoch}").permutation(count)
    return _ORDERS[key]


def eval_windows(heldout: np.ndarray, recipe: TrainRecipe) -> np.ndarray:
    """A fixed set of held-out windows, spread evenly over the held-out split."""
    all_windows = windows(heldout, recipe.sequence_tokens)
    picks = np.linspace(0, len(all_windows) - 1, num=min(recipe.eval_sequences, len(all_windows))).round()
    return all_windows[picks.astype(np.int64)]


def fingerprint_positions(eval_set: np.ndarray) -> list[tuple[int, int]]:
    """FINGERPRINT_POSITIONS fixed (window, position) pairs of the evaluation set."""
    rows, length = eval_set.shape[0], eval_set.shape[1] - 1
    return [(k % rows, (k * 7919) % length) for k in range(FINGERPRINT_POSITIONS)]


def heldout_metrics(model: Any, eval_set: np.ndarray, device: str, *, with_fingerprint: bool) -> dict[str, Any]:
    """Loss, next-token entropy (no logit scale), top-1 probability histogram and accuracy on the held-out
    windows, in float32 compute; optionally the fingerprint logits."""
    import torch

    losses, entropies, top1 = [], [], []
    correct = 0
    fingerprint = []
    wanted = fingerprint_positions(eval_set) if with_fingerprint else []
    with torch.no_grad():
        for row, window in enumerate(eval_set):
            ids = torch.as_tensor(window, device=device).unsqueeze(0)
            logits = model(input_ids=ids[:, :-1]).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            target = ids[0, 1:]
            losses.append((-logp.gather(1, target[:, None])[:, 0]).cpu())
            probs = logp.exp()
            entropies.append((-(probs * logp).sum(-1)).cpu())
            best = probs.max(-1)
            top1.append(best.values.cpu())
            correct += int((best.indices == target).sum())
            for w_row, position in wanted:
                if w_row == row:
                    values, ids_top = logits[position].topk(FINGERPRINT_TOP_K)
                    fingerprint.append({"window": row, "position": position,
                                        "top_ids": [int(i) for i in ids_top.cpu()],
                                        "top_logits": [round(float(v), 5) for v in values.cpu()]})
    loss = torch.cat(losses)
    entropy = torch.cat(entropies)
    top1_all = torch.cat(top1)
    histogram = torch.histc(top1_all, bins=TOP1_HISTOGRAM_BINS, min=0.0, max=1.0)
    out = {"positions": int(loss.numel()), "heldout_loss_nats": round(float(loss.mean()), 6),
           "mean_entropy_nats": round(float(entropy.mean()), 6),
           "median_entropy_nats": round(float(entropy.median()), 6),
           "top1_accuracy": round(correct / loss.numel(), 6),
           "mean_top1_probability": round(float(top1_all.mean()), 6),
           "top1_probability_histogram": {"bin_edges": [round(i / TOP1_HISTOGRAM_BINS, 4)
                                                        for i in range(TOP1_HISTOGRAM_BINS + 1)],
                                          "counts": [int(c) for c in histogram.cpu()]}}
    if with_fingerprint:
        out["fingerprint_positions"] = sorted(fingerprint, key=lambda f: (f["window"], f["position"]))
    return out


def fingerprint_mismatches(expected: dict[str, Any], got: dict[str, Any], *, loss_tol: float = FINGERPRINT_LOSS_TOL,
                           logit_tol: float = FINGERPRINT_LOGIT_TOL) -> list[str]:
    """Where two records' fingerprints differ beyond tolerance (empty: they agree). Compares the held-out
    loss, and at each fixed position the logits of ids in both top-8 lists and the top-1 id (a different
    top-1 is tolerated only where the expected top-1/top-2 margin is within logit_tol)."""
    a, b = expected["fingerprint"], got["fingerprint"]
    problems = []
    if abs(a["heldout_loss_nats"] - b["heldout_loss_nats"]) > loss_tol:
        problems.append(f"heldout_loss_nats: {a['heldout_loss_nats']} vs {b['heldout_loss_nats']} (tol {loss_tol})")
    pos_a = {(p["window"], p["position"]): p for p in a["positions"]}
    pos_b = {(p["window"], p["position"]): p for p in b["positions"]}
    if pos_a.keys() != pos_b.keys():
        return [*problems, "fingerprint positions differ (different corpus or recipe)"]
    for key, pa in pos_a.items():
        pb = pos_b[key]
        logits_b = dict(zip(pb["top_ids"], pb["top_logits"], strict=True))
        for token, value in zip(pa["top_ids"], pa["top_logits"], strict=True):
            if token in logits_b and abs(value - logits_b[token]) > logit_tol:
                problems.append(f"position {key}: logit of id {token} {value} vs {logits_b[token]} (tol {logit_tol})")
                break
        margin = pa["top_logits"][0] - pa["top_logits"][1]
        if pa["top_ids"][0] != pb["top_ids"][0] and margin > logit_tol:
            problems.append(f"position {key}: top-1 id {pa['top_ids'][0]} vs {pb['top_ids'][0]} (margin {margin})")
    return problems


@contextlib.contextmanager
def deterministic_kernels(device: str, kernels: TrainKernels) -> Iterator[None]:
    """Deterministic algorithms for the kernels' choice, restored on exit (a process that trains in-process,
    a test run, keeps its own settings afterwards)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=not kernels.strict_determinism)
    torch.utils.deterministic.fill_uninitialized_memory = kernels.fill_uninitialized
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = saved[3:]


def _attention_context(kernels: TrainKernels) -> contextlib.AbstractContextManager:
    """SDPA pinned to FlashAttention-2: no silent fallback to a kernel whose backward is not deterministic
    (memory-efficient, cuDNN) or to the math path; an input flash cannot take raises."""
    if kernels.attention != "sdpa":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def make_optimizer(model: Any, recipe: TrainRecipe, kernels: TrainKernels) -> Any:
    """AdamW(betas 0.9/0.95, eps 1e-8), weight decay on matrices only, float32 master weights."""
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    implementation = {"fused": True} if kernels.optimizer == "fused" else {"foreach": True}
    lr: Any = recipe.peak_lr
    if kernels.step == "graph":  # inside a CUDA graph: the step count and the learning rate live on the device
        implementation["capturable"] = True
        lr = torch.tensor(recipe.peak_lr, dtype=torch.float32, device=next(model.parameters()).device)
    return torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, **implementation)


def set_learning_rate(optimizer: Any, value: float) -> None:
    """The schedule's rate for the next step: a float, or written into the device tensor a captured step reads."""
    for group in optimizer.param_groups:
        if hasattr(group["lr"], "fill_"):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


class GraphStep:
    """TrainKernels(step="graph"): forward, loss, backward, clipping and the AdamW step captured as one CUDA graph
    and replayed once per step (no Python and no per-op launch between them: the lever if a step is
    launch-bound). The first WARMUP_STEPS steps run eagerly on a side stream (lazy initialisations must not happen
    inside a capture), with the same capturable kernels; they are real training steps, as are the replays. The
    batch goes through one static input buffer; gradients live in the graph's pool (set to None before the
    capture, written by each replay); the loss is read from the graph's output. A replay runs the captured kernels
    in their captured order: deterministic."""

    WARMUP_STEPS = 3

    def __init__(self, model: Any, optimizer: Any, recipe: TrainRecipe, kernels: TrainKernels, autocast: bool,
                 batch_shape: tuple[int, int], device: str) -> None:
        import torch

        self.model, self.optimizer, self.recipe = model, optimizer, recipe
        self.kernels, self.autocast = kernels, autocast
        self.device = torch.device(device)
        self.batch = torch.zeros(batch_shape, dtype=torch.long, device=self.device)
        self.graph: Any = None
        self.loss: Any = None
        self.steps = 0

    def _body(self) -> Any:
        return training_step(self.model, self.optimizer, self.batch, self.recipe, self.kernels, self.autocast)

    def __call__(self, batch: Any) -> Any:
        """One training step on `batch`; returns its loss (a device scalar)."""
        import torch

        self.batch.copy_(batch)
        if self.steps < self.WARMUP_STEPS:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._body()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        else:
            if self.graph is None:
                self.optimizer.zero_grad(set_to_none=True)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.loss = self._body()
            self.graph.replay()
            loss = self.loss
        self.steps += 1
        return loss


def training_step(model: Any, optimizer: Any, batch: Any, recipe: TrainRecipe, kernels: TrainKernels,
                  autocast: bool) -> Any:
    """Forward, loss, backward, clipping and the AdamW step on `batch` (inputs and shifted targets); the
    gradients must be None before it. Returns the loss (detached)."""
    import torch

    out = forward_for_loss(model, batch[:, :-1], kernels, autocast)
    loss = loss_of(model, out, batch[:, 1:], kernels, autocast)
    del out  # the loss holds what backward needs; the logits need not live through it
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    optimizer.step()
    return loss.detach()


def forward_for_loss(model: Any, inputs: Any, kernels: TrainKernels, autocast: bool) -> Any:
    """The forward pass up to what the loss takes: the logits (`full`) or the final hidden states (`chunked`)."""
    import torch

    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast, cache_enabled=kernels.autocast_cache), \
            _attention_context(kernels):
        if kernels.loss == "chunked":
            return model.model(input_ids=inputs).last_hidden_state
        return model(input_ids=inputs).logits


def loss_of(model: Any, out: Any, targets: Any, kernels: TrainKernels, autocast: bool) -> Any:
    """Mean next-token cross-entropy over every position of the batch, in float32."""
    import torch

    if kernels.loss == "chunked":
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast, cache_enabled=kernels.autocast_cache):
            return chunked_cross_entropy(out.reshape(-1, out.shape[-1]), model.get_output_embeddings().weight,
                                         targets.reshape(-1))
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), targets.reshape(-1))


def chunked_cross_entropy(hidden: Any, weight: Any, targets: Any, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> Any:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, one chunk of tokens at a time; each chunk is
    checkpointed, so backward recomputes its logits instead of keeping a [tokens, vocabulary] float32 block."""
    from torch.utils.checkpoint import checkpoint

    total = None
    for start in range(0, hidden.shape[0], chunk_tokens):
        # no randomness in a chunk: nothing for checkpoint to save and restore (no RNG state read, also inside a
        # CUDA-graph capture)
        part = checkpoint(_chunk_nll_sum, hidden[start:start + chunk_tokens], weight,
                          targets[start:start + chunk_tokens], use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    return total / hidden.shape[0]


def _chunk_nll_sum(hidden: Any, weight: Any, targets: Any) -> Any:
    import torch

    logits = torch.nn.functional.linear(hidden, weight)
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")


CAUSAL_SDPA = "rollout_causal_sdpa"


def _attn_implementation(attention: str) -> str:
    """`sdpa` in training is transformers' SDPA function registered under its own name: transformers then builds
    no mask for it (a custom attention gets none), so SDPA runs causal without one, with no host sync for a
    packed-sequence check and nothing that a CUDA-graph capture would turn into a 4D mask; the batches have no
    padding, so this is what transformers' own `sdpa` computes for them."""
    if attention != "sdpa":
        return attention
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


def _load_float32(snapshot: Path, device: str, attention: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(snapshot), dtype=torch.float32, device_map={"": device},
                                                trust_remote_code=False, attn_implementation=attention)


def state_dict_bf16(model: Any, names: list[str]) -> dict[str, Any]:
    """The trained weights under the synthetic snapshot's tensor names, rounded to bfloat16."""
    import torch

    params = dict(model.named_parameters())
    return {name: params[name].detach().to("cpu", torch.bfloat16).contiguous() for name in names}


@dataclass(frozen=True)
class TrainPlan:
    arch: Qwen3Arch
    role: str
    seed: int
    manifest: Manifest
    bpe_vocab_size: int
    recipe: TrainRecipe
    device: str
    compute_dtype: str  # "bfloat16" (autocast) or "float32"
    kernels: TrainKernels


def plan_training(arch_name: str, *, role: str | None = None, seed: int | None = None, corpus: str | None = None,
                  bpe_vocab_size: int | None = None, steps: int | None = None, device: str = "cpu",
                  compute_dtype: str | None = None, kernels: TrainKernels | None = None) -> TrainPlan:
    """Every input checked (named field) before any work: architecture, corpus (verified file by file),
    vocabulary, steps, device, dtype, kernels."""
    arch = get_architecture(arch_name)
    role = role or ("teacher" if arch.name == "qwen3-1.7b" else "actor")
    if role not in ("actor", "teacher"):
        raise TrainError(f"role: {role!r}; allowed: actor, teacher")
    manifest = load_manifest(corpus or (TINY_CORPUS if arch.name == "tiny" else DEFAULT_CORPUS))
    verify_corpus(manifest)
    bpe = bpe_vocab_size if bpe_vocab_size is not None else default_bpe_vocab(arch)
    try:
        check_bpe_vocab(arch, bpe)
    except ValueError as err:
        raise TrainError(str(err)) from None
    recipe = RECIPES[arch.name]
    if steps is not None:
        if steps < 1:
            raise TrainError(f"steps: {steps}; allowed: an integer >= 1")
        recipe = replace(recipe, steps=steps, warmup_steps=min(recipe.warmup_steps, max(1, steps // 10)))
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise TrainError(f"device: {device!r}; allowed: cpu, cuda, cuda:N")
    dtype = compute_dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in ("bfloat16", "float32"):
        raise TrainError(f"compute_dtype: {dtype!r}; allowed: bfloat16, float32")
    kernels = kernels or TrainKernels()
    check_kernels(kernels, device)
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise TrainError(f"device: {device!r} but torch sees no CUDA device here; allowed: cpu")
    return TrainPlan(arch=arch, role=role, seed=seed if seed is not None else INIT_SEEDS[(arch.name, role)],
                     manifest=manifest, bpe_vocab_size=bpe, recipe=recipe, device=device, compute_dtype=dtype,
                     kernels=kernels)


def train_standin(plan: TrainPlan, out_dir: str | Path, *, replace_existing: bool = False,
                  log: Any = None) -> dict[str, Any]:
    """Train, then write the snapshot at `out_dir` atomically (built in a temporary sibling, renamed into
    place; an existing directory is replaced only with `replace_existing`, and only after success).
    Returns the record (also written as rollout_trained.json in the snapshot)."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir).resolve()
    if out.exists() and not replace_existing:
        raise TrainError(f"out: {out} exists; choose a new directory or pass --replace")
    out.parent.mkdir(parents=True, exist_ok=True)
    arch, recipe, device = plan.arch, plan.recipe, plan.device
    torch.manual_seed(plan.seed)
    threads = torch.get_num_threads()
    if device == "cpu":  # a CPU reduction's order can follow the thread count: one thread, one order
        torch.set_num_threads(1)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    settings = contextlib.ExitStack()
    try:
        # from before the first cuBLAS call (its workspace setting is read when its handle is made) to the
        # final metrics, as lease 22's stand-ins were trained
        settings.enter_context(deterministic_kernels(device, plan.kernels))
        caught: list[str] = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            init = build_snapshot(arch, plan.seed, tmp, logit_scale=1.0)
            names = sorted(_snapshot_names(tmp))
            train_ids = token_stream(plan.manifest, plan.bpe_vocab_size, "train")
            heldout_ids = token_stream(plan.manifest, plan.bpe_vocab_size, "heldout")
            train_set = windows(train_ids, recipe.sequence_tokens)
            eval_set = eval_windows(heldout_ids, recipe)
            model = _load_float32(tmp, device, _attn_implementation(plan.kernels.attention))
            model.eval()
            init_metrics = heldout_metrics(model, eval_set, device, with_fingerprint=False)
            model.train()
            curve, train_losses = _train_loop(model, plan, train_set, eval_set, log)
            tensors = state_dict_bf16(model, names)
            caught = sorted({str(w.message)[:300] for w in seen if "determinis" in str(w.message).lower()})
        train_wall_s = time.perf_counter() - started
        del model
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        digest = payload_digest_of_tensors(tensors)
        (tmp / "tokenizer.json").write_bytes(padded_tokenizer_json(plan.manifest, plan.bpe_vocab_size, arch))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(arch, plan.bpe_vocab_size), indent=2,
                                                              sort_keys=True) + "\n")
        (tmp / "rollout_synthetic.json").unlink()  # these are no longer the synthetic weights
        trained = _load_float32(tmp, device, "sdpa")
        trained.eval()
        final = heldout_metrics(trained, eval_set, device, with_fingerprint=True)
        del trained
        record = {
            "schema": RECORD_SCHEMA, "arch": arch.name, "role": plan.role, "init_seed": plan.seed,
            "init_payload_digest_logit_scale_1": init.payload_digest, "payload_digest": digest,
            "tokenizer_json_sha256": sha256_bytes((tmp / "tokenizer.json").read_bytes()),
            "corpus": {"name": plan.manifest.name, "manifest_sha256": plan.manifest.manifest_sha256,
                       "package": f"{plan.manifest.package}=={plan.manifest.package_version}",
                       "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids),
                       "train_bytes": plan.manifest.total_bytes("train"),
                       "heldout_bytes": plan.manifest.total_bytes("heldout"),
                       # nats/token -> bits/byte (tokenizer-free, comparable with published byte-level
                       # figures): loss / ln 2 / heldout_bytes_per_token
                       "heldout_bytes_per_token": round(plan.manifest.total_bytes("heldout") / len(heldout_ids), 6)},
            "bpe_vocab_size": plan.bpe_vocab_size, "vocab_size": arch.vocab_size,
            "recipe": asdict(recipe) | {"tokens_per_step": recipe.tokens_per_step,
                                        "planned_tokens": recipe.planned_tokens,
                                        "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8), float32 master weights",
                                        "schedule": "linear warmup, cosine to min_lr_ratio * peak_lr"},
            "trained_tokens": recipe.planned_tokens,
            "epochs_over_train_split": round(recipe.planned_tokens / max(1, len(train_set) * recipe.sequence_tokens),
                                             4),
            "device": device, "compute_dtype": plan.compute_dtype, "attention_in_training": plan.kernels.attention,
            "kernels": plan.kernels.describe(),
            "deterministic": {"use_deterministic_algorithms": True, "warn_only": not plan.kernels.strict_determinism,
                              "fill_uninitialized_memory": plan.kernels.fill_uninitialized,
                              "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                              "nondeterminism_warnings": caught},
            "heldout_loss_curve": curve, "train_loss_every_step": train_losses,
            "init_metrics": init_metrics,
            "final_metrics": {k: v for k, v in final.items() if k != "fingerprint_positions"},
            "fingerprint": {"heldout_loss_nats": final["heldout_loss_nats"], "loss_tol": FINGERPRINT_LOSS_TOL,
                            "logit_tol": FINGERPRINT_LOGIT_TOL, "compute_dtype": "float32",
                            "positions": final["fingerprint_positions"]},
            "environment": {"torch": torch.__version__, "transformers": _version("transformers"),
                            "tokenizers": _version("tokenizers"), "python": platform.python_version(),
                            "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None},
            "train_wall_s": round(train_wall_s, 3),
            "train_tokens_per_s": round(recipe.planned_tokens / train_wall_s, 1),
        }
        (tmp / RECORD_NAME).write_bytes(canonical_json_bytes(record))
        _publish(tmp, out, replace_existing)
        return record
    finally:
        settings.close()
        torch.set_num_threads(threads)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _train_loop(model: Any, plan: TrainPlan, train_set: np.ndarray, eval_set: np.ndarray,
                log: Any) -> tuple[list[dict[str, Any]], list[float]]:
    import torch

    recipe, device, kernels = plan.recipe, plan.device, plan.kernels
    optimizer = make_optimizer(model, recipe, kernels)
    autocast = device.startswith("cuda") and plan.compute_dtype == "bfloat16"
    curve: list[dict[str, Any]] = []
    train_losses: list[float] = []

    def evaluate(step: int) -> None:
        model.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            total, count = 0.0, 0
            for window in eval_set:
                ids = torch.as_tensor(window, device=device).unsqueeze(0)
                logits = model(input_ids=ids[:, :-1]).logits.float()
                loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
                total += float(loss)
                count += ids.shape[1] - 1
        model.train()
        curve.append({"step": step, "tokens": step * recipe.tokens_per_step,
                      "heldout_loss_nats": round(total / count, 6)})
        if log:
            log(f"step {step}/{recipe.steps} held-out loss {total / count:.4f}")

    graph_step = (GraphStep(model, optimizer, recipe, kernels, autocast,
                            (recipe.batch_sequences, recipe.sequence_tokens + 1), device)
                  if kernels.step == "graph" else None)
    evaluate(0)
    for step in range(recipe.steps):
        set_learning_rate(optimizer, lr_at(recipe, step))
        batch = torch.as_tensor(train_set[batch_indices(plan.seed, len(train_set), step, recipe.batch_sequences)],
                                device=device)
        if graph_step is not None:
            loss = graph_step(batch)
        else:
            optimizer.zero_grad(set_to_none=True)
            loss = training_step(model, optimizer, batch, recipe, kernels, autocast)
        train_losses.append(round(float(loss), 5))
        if (step + 1) % recipe.eval_every_steps == 0 or step + 1 == recipe.steps:
            evaluate(step + 1)
    return curve, train_losses


def _snapshot_names(snapshot: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(snapshot / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


def _publish(tmp: Path, out: Path, replace_existing: bool) -> None:
    """Rename the finished directory into place; an old one is moved aside first and removed after."""
    if out.exists() and replace_existing:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def _version(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


def read_record(snapshot: str | Path) -> dict[str, Any]:
    path = Path(snapshot) / RECORD_NAME
    if not path.is_file():
        raise TrainError(f"snapshot: {snapshot} has no {RECORD_NAME} (not a trained stand-in)")
    return json.loads(path.read_text())
