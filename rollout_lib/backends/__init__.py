"""Backend registry. Importing this package registers the built-in backends."""

from rollout_lib.backends import hf_cached, hf_reference, vllm_managed  # noqa: F401  (registration)
from rollout_lib.backends.base import (
    Backend,
    BatchResult,
    Phase,
    RequestResult,
    UnknownBackendError,
    create_backend,
    get_backend_class,
    known_backends,
    register_backend,
)

__all__ = ["Backend", "BatchResult", "Phase", "RequestResult", "UnknownBackendError", "create_backend",
           "get_backend_class", "known_backends", "register_backend"]
