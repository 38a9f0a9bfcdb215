"""Backends: interface and registry (built-ins load on first lookup), hf_reference, hf_cached, vllm,
the managed server, the decode loops and per-request sampling."""

from rollout_lib.backends.base import (
    Backend,
    BatchResult,
    Phase,
    RequestResult,
    UnknownBackendError,
    backend_module,
    create_backend,
    get_backend_class,
    known_backends,
    register_backend,
)

__all__ = ["Backend", "BatchResult", "Phase", "RequestResult", "UnknownBackendError", "backend_module",
           "create_backend", "get_backend_class", "known_backends", "register_backend"]
