"""Arrival counters for kernels whose last-arriving program finishes a reduction.

A kernel that splits a reduction over programs (split-K rows GEMV, value tiles of the
fused KDA step) lets each program take a ticket from an int32 counter; the last one
combines the partials and resets the counter to 0, so the counters are zero between
launches and CUDA-graph replays need no memset. Each kernel keeps its own pool.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ArrivalCounters:
    """Per device, every counter buffer handed out so far: a grown buffer replaces the last
    one for new launches, but the old ones stay alive because captured CUDA graphs hold
    their addresses."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self._buffers: dict[torch.device, list[Tensor]] = {}

    def get(self, device: torch.device, n: int) -> Tensor:
        """At least n int32 counters on device, zero between launches (the kernel resets those
        it uses). Growing the pool allocates, which a CUDA graph capture must not do."""
        buffers = self._buffers.setdefault(device, [])
        if not buffers or buffers[-1].numel() < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    f"{self.kernel} needs {n} arrival counters on {device} but only "
                    f"{buffers[-1].numel() if buffers else 0} exist: run it once at this shape "
                    "before capturing a CUDA graph"
                )
            buffers.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
        return buffers[-1]
