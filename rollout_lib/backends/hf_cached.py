"""`hf_cached`: batched incremental KV-cache decoding on a BF16 inference mirror of the NF4 actor.

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

from rollout_lib.backends.base import BatchResult, Phase, RequestResult, register_backend
from rollout_lib.backends.decode import generate_kv_cache
from rollout_lib.backends.hf_common import HFBackendBase
from rollout_lib.models.actor import add_lora, build_mirror_base, load_nf4_base
from rollout_lib.models.policy import copy_lora_tensors, load_policy_into_peft, read_policy_from_peft


@register_backend
class HFCachedBackend(HFBackendBase):
    name = "hf_cached"
    description = "batched KV-cache decoding on the BF16 mirror of the NF4 actor, exact live LoRA synced per version"

    def _start(self) -> None:
        self._apply_memory_budget()
        path = self._load_snapshot()
        quant = self.study.actor.quantization
        nf4 = load_nf4_base(path, quant, self.compute_dtype, str(self.device))
        mirror = build_mirror_base(path, nf4, self.compute_dtype, str(self.device))
        self.actor = add_lora(nf4, self.study.actor.lora)
        self.mirror = add_lora(mirror, self.study.actor.lora)

    def set_actor_policy(self, policy) -> None:
        """What an optimizer step does to the source of truth (the benchmark's stand-in for training)."""
        load_policy_into_peft(self.actor, policy)

    def sync_policy(self, policy) -> str:
        self.set_actor_policy(policy)
        live = read_policy_from_peft(self.actor)  # the exact live tensors of the actor
        copy_lora_tensors(self.mirror, live, policy.scaling)
        self._synchronize()
        self.served_identity = self._served_identity(self.mirror, policy)
        return self.served_identity

    def generate(self, requests) -> BatchResult:
        identity = self._require_policy()
        self._synchronize()
        start = time.perf_counter()
        out = generate_kv_cache(self.mirror, list(requests), self.device, self.pad_id)
        wall = time.perf_counter() - start
        results = [RequestResult(r.request_id, tuple(out.token_ids[i]), out.stop_reasons[i], tuple(out.logprobs[i]),
                                 identity) for i, r in enumerate(requests)]
        phases = {"prefill_s": Phase.measured(out.prefill_s), "decode_s": Phase.measured(out.decode_s),
                  "ttft_s": Phase.measured(out.prefill_s)}
        result = BatchResult(results, wall, phases)
        result.decode_steps = out.decode_steps
        return result

    def environment(self):
        return super().environment() | {"weights": "dequantized_nf4_mirror+lora",
                                        "lora_application": "separate_low_rank_terms_float32",
                                        "decode": "batched_dynamic_kv_cache"}
