"""Backend interface, result types and the registry.

A backend serves one policy version at a time: `cold_start()` loads it (timed, separate from any
measurement), `sync_policy(policy)` makes a version live and returns the identity it now serves
(computed from the tensors it really holds), `generate(requests)` serves a batch, `teardown()`
releases everything (timed). Every phase field carries a status: `measured`, `not_measured` (the
backend cannot expose that boundary) or `not_applicable`; never a fabricated 0.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from rollout_lib.models.policy import PolicyVersion
    from rollout_lib.study.prereg import Preregistration
    from rollout_lib.study.workload import GenerationRequest

PhaseStatus = Literal["measured", "not_measured", "not_applicable"]
PHASE_FIELDS = ("prefill_s", "decode_s", "ttft_s")


@dataclass(frozen=True)
class Phase:
    status: PhaseStatus
    seconds: float | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.status == "measured" and (self.seconds is None or self.seconds < 0):
            raise ValueError(f"a measured phase needs seconds >= 0, got {self.seconds!r}")
        if self.status != "measured" and self.seconds is not None:
            raise ValueError(f"a {self.status} phase has no seconds (got {self.seconds!r}); never a fake 0")

    @classmethod
    def measured(cls, seconds: float) -> Phase:
        return cls("measured", float(seconds))

    @classmethod
    def not_measured(cls, reason: str) -> Phase:
        return cls("not_measured", None, reason)

    @classmethod
    def not_applicable(cls, reason: str) -> Phase:
        return cls("not_applicable", None, reason)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


StopReason = Literal["eos", "length"]


class ServerDied(RuntimeError):
    """A managed engine process exited during a request (invalidation rule INV-SERVER-DIED)."""


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    token_ids: tuple[int, ...]
    stop_reason: StopReason
    logprobs: tuple[float, ...] | None  # sampled-token log-probabilities, one per token
    policy_identity: str

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "token_ids": list(self.token_ids), "stop_reason": self.stop_reason,
                "logprobs": None if self.logprobs is None else list(self.logprobs),
                "policy_identity": self.policy_identity, "generated_tokens": len(self.token_ids)}


@dataclass
class BatchResult:
    results: list[RequestResult]
    wall_s: float
    phases: dict[str, Phase] = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)


class Backend(ABC):
    """One rollout backend. Subclasses set `name` and register with `@register_backend`."""

    name: ClassVar[str]
    description: ClassVar[str]

    def __init__(self, study: Preregistration, **options: Any):
        self.study = study
        self.options = options
        self.served_identity: str | None = None

    def cold_start(self) -> Phase:
        start = time.perf_counter()
        self._start()
        self._synchronize()
        return Phase.measured(time.perf_counter() - start)

    @abstractmethod
    def _start(self) -> None: ...

    @abstractmethod
    def sync_policy(self, policy: PolicyVersion) -> str: ...

    @abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> BatchResult: ...

    def teardown(self) -> Phase:
        start = time.perf_counter()
        self._stop()
        return Phase.measured(time.perf_counter() - start)

    @abstractmethod
    def _stop(self) -> None: ...

    def teardown_report(self) -> dict[str, Any]:
        """Proof of a clean teardown (port closed, no child left) for backends that own processes."""
        return {}

    def _synchronize(self) -> None:  # noqa: B027 - optional hook: CPU-only backends have nothing to wait for
        """Wait for queued GPU work, so a timing boundary means what it says."""

    def environment(self) -> dict[str, Any]:
        """Backend-specific facts for the raw file (dtypes, attention implementation, ...)."""
        return {}


_REGISTRY: dict[str, type[Backend]] = {}

# Built-in backends are imported on first lookup, not when the package is imported: a measuring
# process then imports only its own backend's code, and the measurement-code digest of one backend
# (measure/identity.py) does not change when another backend's module does.
BUILTIN_BACKENDS: dict[str, str] = {
    "hf_reference": "rollout_lib.backends.hf_reference",
    "hf_cached": "rollout_lib.backends.hf_cached",
    "vllm": "rollout_lib.backends.vllm_managed",
}


class UnknownBackendError(KeyError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown backend {self.name!r}; known backends: {', '.join(known_backends())}"


def register_backend(cls: type[Backend]) -> type[Backend]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"backend name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def known_backends() -> list[str]:
    return sorted(set(_REGISTRY) | set(BUILTIN_BACKENDS))


def backend_module(name: str) -> str:
    """The module that defines backend `name` (registered or built-in)."""
    if name in _REGISTRY:
        return _REGISTRY[name].__module__
    if name in BUILTIN_BACKENDS:
        return BUILTIN_BACKENDS[name]
    raise UnknownBackendError(name)


def get_backend_class(name: str) -> type[Backend]:
    if name not in _REGISTRY and name in BUILTIN_BACKENDS:
        importlib.import_module(BUILTIN_BACKENDS[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownBackendError(name) from None


def create_backend(name: str, study: Preregistration, **options: Any) -> Backend:
    return get_backend_class(name)(study, **options)
