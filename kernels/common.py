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


@cache
def shared_memory_bytes(device: torch.device) -> int:
    """Shared memory one program may use on a CUDA device (the opt-in maximum); 99 KiB elsewhere."""
    if device.type != "cuda":
        return 99 * 1024
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024)


def fit_stages(block_k: int, stages: int, tile_rows: int, elem_bytes: int, device: torch.device) -> tuple[int, int]:
    """``(block_k, stages)`` lowered until ``stages`` buffers of ``tile_rows x block_k`` elements fit
    in shared memory (block_k halves down to 64 first, then stages drop): a tuned config met at a
    taller tile than it was tuned for must still launch."""
    budget = shared_memory_bytes(device) - 4096  # the compiler's own scratch
    while stages * tile_rows * block_k * elem_bytes > budget and (block_k > 64 or stages > 1):
        if block_k > 64:
            block_k //= 2
        else:
            stages -= 1
    return block_k, stages


def device_key(device: torch.device | str | None = None) -> str:
    """The device as a key for tuned configs: ``nvidia_h100_80gb_hbm3``, or ``cpu``."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")
