"""`hf_reference`: the frozen legacy (pre-v0.11) behaviour, the compatibility oracle.

Runs on the NF4 + LoRA actor (the training source of truth).
- greedy: one padded batch; every step recomputes the full prefix (no KV cache);
- seeded stochastic: one request at a time on the KV-cache path, each with its own seed, so a
  request's tokens depend only on its seed.
The legacy path exposes no prefill / decode / TTFT boundary: those fields are `not_measured`.
"""

from __future__ import annotations

import time

from rollout_lib.backends.base import BatchResult, Phase, RequestResult, register_backend
from rollout_lib.backends.decode import generate_full_recompute, generate_kv_cache
from rollout_lib.backends.hf_common import HFBackendBase
from rollout_lib.models.actor import add_lora, load_nf4_base
from rollout_lib.models.policy import PolicyVersion, load_policy_into_peft

_LEGACY = "the legacy path exposes no prefill/decode/TTFT boundary"


@register_backend
class HFReferenceBackend(HFBackendBase):
    name = "hf_reference"
    description = "legacy HF path on the NF4+LoRA actor: greedy full-prefix recompute, stochastic sequential"

    def _start(self) -> None:
        self._apply_memory_budget()
        path = self._load_snapshot()
        quant = self.study.actor.quantization
        self.model = add_lora(load_nf4_base(path, quant, self.compute_dtype, str(self.device)), self.study.actor.lora)

    def sync_policy(self, policy: PolicyVersion) -> str:
        load_policy_into_peft(self.model, policy)
        self._synchronize()
        self.served_identity = self._served_identity(self.model, policy)
        return self.served_identity

    def generate(self, requests) -> BatchResult:
        identity = self._require_policy()
        greedy = [r for r in requests if r.greedy]
        stochastic = [r for r in requests if not r.greedy]
        outputs = {}
        self._synchronize()
        start = time.perf_counter()
        if greedy:
            out = generate_full_recompute(self.model, greedy, self.device, self.pad_id)
            for i, request in enumerate(greedy):
                outputs[request.request_id] = (out.token_ids[i], out.logprobs[i], out.stop_reasons[i])
        for request in stochastic:  # sequential by design: the legacy way to keep per-request RNG
            out = generate_kv_cache(self.model, [request], self.device, self.pad_id)
            outputs[request.request_id] = (out.token_ids[0], out.logprobs[0], out.stop_reasons[0])
        self._synchronize()
        wall = time.perf_counter() - start
        results = [RequestResult(r.request_id, tuple(outputs[r.request_id][0]), outputs[r.request_id][2],
                                 tuple(outputs[r.request_id][1]), identity) for r in requests]
        phases = {"prefill_s": Phase.not_measured(_LEGACY), "decode_s": Phase.not_measured(_LEGACY),
                  "ttft_s": Phase.not_measured(_LEGACY)}
        return BatchResult(results, wall, phases)

    def environment(self):
        return super().environment() | {"weights": "nf4+lora", "greedy_path": "full_prefix_recompute",
                                        "stochastic_path": "sequential_kv_cache"}
