"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import re
from functools import cache

import torch


@cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere, for the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_key(device: torch.device | str | None = None) -> str:
    """The device as a key for tuned configs: ``nvidia_h100_80gb_hbm3``, or ``cpu``."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")
