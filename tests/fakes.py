"""Test doubles of a backend: full-length outputs at once, with hooks for OOMs and delays."""

from __future__ import annotations

import torch

from rollout_lib.backends.base import Backend, BatchResult, Phase, RequestResult


class FakeBackend(Backend):
    """Serves every request its full response of token 3 on the CPU; no model, no GPU."""

    name = "fake"
    description = "test double"

    def __init__(self, study):
        super().__init__(study)
        self.calls = 0
        self.device = torch.device("cpu")

    def _start(self):
        pass

    def _stop(self):
        pass

    def sync_policy(self, policy):
        self.served_identity = policy.identity
        return policy.identity

    def before_generate(self, requests) -> float:
        """Hook: raise, sleep or advance a clock; returns the wall seconds to report."""
        return 0.01

    def generate(self, requests):
        self.calls += 1
        wall = self.before_generate(requests)
        results = [RequestResult(r.request_id, tuple([3] * r.max_new_tokens), "length", None, self.served_identity)
                   for r in requests]
        return BatchResult(results, wall, {k: Phase.not_measured("fake") for k in ("prefill_s", "decode_s", "ttft_s")})
