"""Phase timing with device synchronization at both boundaries.

`PhaseTimer` measures wall time of a block with `time.perf_counter`, synchronizing the CUDA device
(when there is one) on entry and exit, so queued kernels are charged to the phase that issued them.
A field a backend cannot expose is recorded with its status (see backends.base.Phase), never 0.
"""

from __future__ import annotations

import time
from types import TracebackType

from rollout_lib.backends.decode import synchronize


class PhaseTimer:
    """`with PhaseTimer(device) as t: ...; t.seconds`"""

    def __init__(self, device=None):
        self.device = device
        self.seconds: float | None = None
        self._start = 0.0

    def __enter__(self) -> PhaseTimer:
        if self.device is not None:
            synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.device is not None and exc_type is None:
            synchronize(self.device)
        self.seconds = time.perf_counter() - self._start
