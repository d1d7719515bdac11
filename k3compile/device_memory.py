"""Free memory of a device, read before allocating (the runtime's and the reference
model's memory checks)."""

from __future__ import annotations

from pathlib import Path

import torch

GiB = 1 << 30


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``: a GPU's free memory, or the host's available memory
    (``MemAvailable``); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
