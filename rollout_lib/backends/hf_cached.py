"""`hf_cached`: batched incremental KV-cache decoding on a BF16 inference mirror of the NF4 actor.

Two decode paths (option `decode`): `graphs` (the default) runs the compact Qwen3 decoder of
`compact_qwen3.py` on a static KV cache, one CUDA graph per (rows, cache length) bucket captured at
cold start, LoRA as fused low-rank terms in static buffers and counter-based per-request noise
(`counter_noise.py`); on a CPU the same compact step runs without capture. `eager` is the
transformers + peft loop with per-request `torch.Generator`s, kept for profiling and as a
diagnostic. Stochastic tokens of the two paths differ (different noise streams); each is
deterministic and independent of batch mates.

The process holds the NF4 + LoRA actor (the training source of truth) and a mirror whose
projections are the exact dequantized NF4 weights. Before each policy version, the actor's live
LoRA tensors are copied into the mirror's LoRA adapter, which stays as separate low-rank terms
(not merged: see actor.py for why), and the identity is recomputed from the mirror's tensors.
All requests of a call decode together, one step for all rows; each stochastic request keeps its
own generator, so its samples do not depend on its batch mates. Prefill (= TTFT for the batch) and
decode are measured with device synchronization at the boundaries.
"""

from __future__ import annotations

import time
from typing import Any

from rollout_lib.backends.base import BatchResult, Phase, RequestResult, register_backend
from rollout_lib.backends.decode import generate_kv_cache
from rollout_lib.backends.hf_common import HFBackendBase
from rollout_lib.models.actor import add_lora, build_mirror_base, load_nf4_base
from rollout_lib.models.fast_identity import policy_identity_streamed
from rollout_lib.models.policy import (
    PolicyIdentityMismatch,
    copy_lora_tensors,
    load_policy_into_peft,
    read_policy_from_peft,
)

DECODE_PATHS = ("graphs", "eager")
STEP_COMPILE = ("auto", "inductor", "off")  # auto: inductor on CUDA, off on a CPU (no capture there)
# each engine setting (compact_qwen3.ENGINE_SETTINGS) as the engine's attribute and its default: the environment
# names a setting only where it differs from the default, so a default engine's record is what it always was
ENGINE_ENVIRONMENT_DEFAULTS = {
    "lora_shrink": "reductions", "lora_expand": "reductions", "attention_backend": "auto", "prefill": "per_row",
    "prefill_step": "eager", "step_pieces": "per_half_layer", "sampler_reduction": "row", "decode_prefix": "per_row",
    "readback": "per_step", "step_edges": "eager", "gemm_split_k": "off", "autotune_rows": "first_bucket",
    "combo_kernels": "off", "attention_plan": "per_call", "gemm_kernel": "cublas", "reduction_launch": "benchmarked",
    "gate_up_epilogue": "inductor", "o_epilogue": "inductor", "down_epilogue": "inductor", "qkv_epilogue": "inductor",
    "norm_epilogue_row": "one_program", "attention_launch": "fixed", "weight_prefetch": "off",
    "dependent_launch": "off", "attention_dependent_launch": "off", "weight_prefetch_by": "side_stream"}


@register_backend
class HFCachedBackend(HFBackendBase):
    name = "hf_cached"
    description = "batched KV-cache decoding on the BF16 mirror of the NF4 actor, exact live LoRA synced per version"
    allowed_options = (*HFBackendBase.allowed_options, "decode", "step_compile", "lora_add", "engine")

    def __init__(self, study, **options):
        super().__init__(study, **options)
        self.decode = options.get("decode") or "graphs"
        if self.decode not in DECODE_PATHS:
            raise ValueError(f"hf_cached: decode {self.decode!r} is not allowed; allowed: {', '.join(DECODE_PATHS)}")
        self.step_compile = options.get("step_compile") or "auto"
        if self.step_compile not in STEP_COMPILE:
            raise ValueError(f"hf_cached: step_compile {self.step_compile!r} is not allowed; "
                             f"allowed: {', '.join(STEP_COMPILE)}")
        from rollout_lib.backends.compact_qwen3 import LORA_ADD_ALLOWED, check_engine_settings, lora_add_mode

        # issue 43's engine: the study's (`hf_cached_engine`, empty before h200-v3), or a candidate given as the
        # `engine` option (e.g. {"LORA_SHRINK": "in_base_gemm"}), which replaces it whole; checked now
        engine = options["engine"] if "engine" in options else (dict(getattr(study, "hf_cached_engine", {})) or None)
        try:
            self.engine_settings = check_engine_settings(engine)
        except ValueError as exc:
            raise ValueError(f"hf_cached: {exc}") from exc
        if self.engine_settings and self.decode != "graphs":
            raise ValueError("hf_cached: engine settings apply to decode graphs only")

        # how the graphs path adds the low-rank term (a conformance diagnostic; see _fused_linear)
        try:
            self.lora_add = lora_add_mode(options.get("lora_add"))
        except ValueError as exc:
            raise ValueError(f"hf_cached: {exc}") from exc
        if self.decode == "eager" and self.lora_add != LORA_ADD_ALLOWED[0]:
            raise ValueError("hf_cached: lora_add applies to decode graphs only (the eager path is peft's "
                             "lora.Linear, which adds in float32 and rounds once)")
        self.engine = None
        self.buckets = None
        self.actor_preset_identity: str | None = None  # see actor_holds
        self.actor_lora_layers: list | None = None  # the actor's LoRA modules (graphs path), see _start
        self.served_policies: list[dict] = []  # graphs path: each sync's copy and identity seconds

    def _start(self) -> None:
        self._apply_memory_budget()
        path = self._load_snapshot()
        quant = self.study.actor.quantization
        lora = self.study.actor.lora
        nf4 = load_nf4_base(path, quant, self.compute_dtype, str(self.device))
        mirror = build_mirror_base(path, nf4, self.compute_dtype, str(self.device))
        self.actor = add_lora(nf4, lora)
        if self.decode == "eager":
            self.mirror = add_lora(mirror, lora)
            return
        from rollout_lib.backends.compact_qwen3 import BucketSet, CompactQwen3, bucket_length

        compile_step = self.step_compile == "inductor" or (self.step_compile == "auto" and self.device.type == "cuda")
        self.engine = CompactQwen3(mirror, lora.rank, tuple(lora.target_modules), lora.alpha / lora.rank,
                                   compile_step=compile_step, lora_add=self.lora_add, settings=self.engine_settings)
        del mirror  # the engine keeps what it reads (fused copies, norms, embedding, float32 head)
        work = self.study.workload
        lengths = [bucket_length(p, r) for p in work.prompt_tokens for r in work.response_tokens]
        self.buckets = BucketSet(self.engine, max(lengths), use_graphs=self.device.type == "cuda")
        # every measured shape is captured now (cold start), never inside a measured repetition; with
        # AUTOTUNE_ROWS "largest" the largest row count first, where inductor's first-run picks are made
        samples = work.samples_per_prompt
        if self.engine.autotune_rows == "largest":
            samples = sorted(samples, reverse=True)
        for n in samples:
            for length in sorted(set(lengths)):
                self.buckets.get(work.logical_prompts * n, length)
        # a sync's one-time costs are paid now, not by the first policy version (lease 4: 91 ms against
        # 44-52 ms for the others): page-locked staging, the copy's and the gather's first allocations
        self.actor_lora_layers = lora_layers(self.actor)  # walked once: a sync reads their weights
        self.engine.load_lora(live_lora_tensors(self.actor, layers=self.actor_lora_layers), lora.alpha / lora.rank)
        policy_identity_streamed("cold-start warmup", self.engine.served_lora(), self.engine.identity_staging())
        self._synchronize()

    def set_actor_policy(self, policy) -> None:
        """What an optimizer step does to the source of truth (the benchmark's stand-in for training).
        Called before `sync_policy` (the refresh check does, outside its timer), the next sync of the
        same policy skips it, once; the sync's identity check covers the tensors either way."""
        load_policy_into_peft(self.actor, policy)
        self.actor_holds(policy)

    def actor_holds(self, policy) -> None:
        """The actor's live tensors are `policy`'s already (written by `set_actor_policy`, or a trainer
        stepped the actor in place and `policy` was read from it): the next sync of `policy` copies
        them as they are, once. The sync's identity check still verifies what is served."""
        self.actor_preset_identity = policy.identity

    def sync_policy(self, policy) -> str:
        stand_in = time.perf_counter()
        preset, self.actor_preset_identity = self.actor_preset_identity, None
        if preset != policy.identity:  # one-shot: a later sync writes its policy again
            load_policy_into_peft(self.actor, policy)
        if self.engine is None:
            live = read_policy_from_peft(self.actor)  # the exact live tensors of the actor
            copy_lora_tensors(self.mirror, live, policy.scaling)
            self._synchronize()
            self.served_identity = self._served_identity(self.mirror, policy)
            return self.served_identity
        # device to device into the static buffers the graphs read: no recapture
        started = time.perf_counter()
        self.engine.load_lora(live_lora_tensors(self.actor, layers=self.actor_lora_layers), policy.scaling)
        self._synchronize()
        copied = time.perf_counter()
        identity_timings: dict[str, float] = {}
        identity = policy_identity_streamed(policy.base_digest, self.engine.served_lora(),
                                            self.engine.identity_staging(), identity_timings)
        if identity != policy.identity:
            raise PolicyIdentityMismatch(f"hf_cached serves identity {identity}, policy version {policy.version} "
                                         f"is {policy.identity}")
        self.served_identity = identity
        self.served_policies.append({"version": policy.version, "identity": identity, "sync_phases_s": {
            "actor_stand_in_s": started - stand_in, "copy_into_buffers_s": copied - started,
            "identity_from_buffers_s": time.perf_counter() - copied,
            **{f"identity_{key}": value for key, value in identity_timings.items()}}})
        return identity

    def generate(self, requests) -> BatchResult:
        identity = self._require_policy()
        self._synchronize()
        start = time.perf_counter()
        if self.engine is not None:
            from rollout_lib.backends.compact_qwen3 import generate_static

            out = generate_static(self.engine, self.buckets, list(requests), self.pad_id)
        else:
            out = generate_kv_cache(self.mirror, list(requests), self.device, self.pad_id)
        wall = time.perf_counter() - start
        results = [RequestResult(r.request_id, tuple(out.token_ids[i]), out.stop_reasons[i], tuple(out.logprobs[i]),
                                 identity) for i, r in enumerate(requests)]
        phases = {"prefill_s": Phase.measured(out.prefill_s), "decode_s": Phase.measured(out.decode_s),
                  "ttft_s": Phase.measured(out.prefill_s)}
        result = BatchResult(results, wall, phases)
        result.decode_steps = out.decode_steps
        return result

    def teacher_forced(self, prompt, response):
        """Scores of `response` after `prompt` by the model this backend serves with (conformance)."""
        if self.engine is not None:
            return self.engine.score(tuple(prompt), list(response))
        from rollout_lib.backends.decode import teacher_forced

        return teacher_forced(self.mirror, prompt, list(response), self.device)

    def _stop(self) -> None:
        self.engine = None
        self.buckets = None
        super()._stop()

    def environment(self):
        out = super().environment() | {"weights": "dequantized_nf4_mirror+lora",
                                       "lora_application": "separate_low_rank_terms_float32"}
        if self.engine is None:
            return out | {"decode": "eager", "decode_loop": "transformers+peft, dynamic kv cache",
                          "sampler": "torch.Generator per request (exponential race)"}
        return out | {"decode": "graphs", "decode_loop": "compact qwen3, static kv cache, fused qkv/gate_up, "
                                                         "lora as fused float32 low-rank terms",
                      "cuda_graphs": self.buckets.use_graphs if self.buckets else None,
                      "step_compile": "inductor" if self.engine.compiled else "off",
                      "step_shapes": self.engine.step_shapes if self.engine.compiled else "not_applicable",
                      "cache_write": self.engine.cache_write if self.engine.compiled else "outside",
                      "inductor_options": dict(self.engine.inductor_options) if self.engine.compiled
                      else "not_applicable",
                      "lm_head": self.engine.head_mode,
                      "lora_add": self.engine.lora_add,
                      # a non-default engine setting (issue 43 candidates) is named; a default adds no key
                      **{key: getattr(self.engine, key) for key, default in ENGINE_ENVIRONMENT_DEFAULTS.items()
                         if getattr(self.engine, key) != default},
                      **({"gemm_splits": self.engine.gemm_split_plan()} if self.engine.gemm_split_k != "off" else {}),
                      "graph_buckets": sorted(self.buckets.buckets) if self.buckets else [],
                      **({"graph_buckets_shared_prefix": sorted(self.buckets.shared_prefix_buckets)}
                         if self.buckets and self.buckets.shared_prefix_buckets else {}),
                      "graph_capture_s": self.buckets.capture_s if self.buckets else None,
                      "static_cache_bytes": self.buckets.cache_bytes if self.buckets else None,
                      "sampler": "counter-based noise (seed, step, vocab index), exponential race"}


def lora_layers(peft_model) -> list[tuple[str, Any]]:
    """(canonical module path, peft LoraLayer) for every LoRA-wrapped module, in module order."""
    from peft.tuners.lora import LoraLayer

    return [(name.split("base_model.model.", 1)[-1], module) for name, module in peft_model.named_modules()
            if isinstance(module, LoraLayer)]


def live_lora_tensors(peft_model, adapter: str = "default", layers: list[tuple[str, Any]] | None = None) -> dict:
    """Canonical name -> the live LoRA weight tensors of a peft model, where they are (no copy).
    `layers`: `lora_layers(peft_model)` kept from an earlier call (walking ~2,500 modules costs a few ms
    per sync; the weights are read from the modules each time, so a replaced parameter is still seen)."""
    out = {}
    for path, module in layers if layers is not None else lora_layers(peft_model):
        out[f"{path}.lora_A"] = module.lora_A[adapter].weight.detach()
        out[f"{path}.lora_B"] = module.lora_B[adapter].weight.detach()
    return out
