"""Small helpers shared by the kernels and their launchers."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper+): optional
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints (``triton.cdiv`` is a constexpr function: slow to call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), for host ints."""
    return 1 << max(0, n - 1).bit_length()


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
    return _cuda_key(_index(device))


DEVICES_PATH = Path(__file__).with_name("configs") / "devices.json"


def config_devices(device: torch.device | str | None = None) -> tuple[str, ...]:
    """The device keys whose tuned launch configs serve ``device``, best first: its own, then the other
    GPUs of its compute capability that ``configs/devices.json`` lists, in its order (a lookup takes the
    first of them with an entry for its shape).  A GPU with no entry of its own for a shape (an H100
    PCIe, a GH200) then runs a sibling's tuned entry, not the defaults."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return ("cpu",)
    return _cuda_config_devices(_index(device))


@cache
def _cuda_config_devices(index: int) -> tuple[str, ...]:  # (asked at launches: once per device)
    return similar_devices(_cuda_key(index), _capability(index))


@cache
def similar_devices(key: str, capability: str) -> tuple[str, ...]:
    """``key``, then the listed devices of compute ``capability`` ("9.0"), in their listed order."""
    listed = _read_devices(DEVICES_PATH).get("capability", {})
    return (key, *(k for k, c in listed.items() if c == capability and k != key))


def record_tuned_device(path: Path | None = None) -> None:
    """Add the current CUDA device and its compute capability to ``devices.json`` (``path``: the
    package's), as the tuners do once they write configs for it."""
    path = path or DEVICES_PATH
    data = _read_devices(path)
    key, capability = device_key("cuda"), _capability(torch.cuda.current_device())
    if data.get("capability", {}).get(key) != capability:
        data.setdefault("capability", {})[key] = capability
        path.write_text(json.dumps(data, indent=1) + "\n")
    clear_device_caches()


def clear_device_caches() -> None:
    """Read ``devices.json`` again at the next lookup (after a tuner wrote it)."""
    similar_devices.cache_clear()
    _cuda_config_devices.cache_clear()


def _read_devices(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


@cache
def _capability(index: int) -> str:
    return "{}.{}".format(*torch.cuda.get_device_capability(index))


@cache
def _cuda_key(index: int) -> str:  # (a device's name never changes: asked once, not at every launch)
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(index).lower()).strip("_")


def hopper_or_later(device: torch.device) -> bool:
    """Whether a device is a CUDA GPU of compute capability 9 or more (Hopper's PDL, TMA)."""
    if device.type != "cuda":
        return False
    return _major(_index(device)) >= 9


def _index(device: torch.device) -> int:
    """A CUDA device's index (the current device for ``cuda`` without one)."""
    return torch.cuda.current_device() if device.index is None else device.index


@cache
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@triton.jit
def finish_early(USE_PDL: tl.constexpr):
    """A PDL program that exits without work still waits for the kernel before: its grid must not
    complete (and release the next launch) before the kernel it depends on has."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def load_runs(pool_ptr, pt_ptr, row_virt, row_ok, cols_left, WIDTH: tl.constexpr, RUN: tl.constexpr,
              PAGE_SHIFT: tl.constexpr, PAGED: tl.constexpr):
    """``[rows, WIDTH]``: row i = the pool elements at virtual ``row_virt[i] + [0, WIDTH)`` of the
    buffer whose page-table row is ``pt_ptr``; columns ``>= cols_left`` read 0 (and look up no page).

    Read as WIDTH / RUN runs per row, all issued at once: one page-table lookup per run, then one
    vectorised load of the whole tile (no chain of dependent loads run by run).  ``row_virt`` is
    RUN-aligned and RUN <= 64, so each run lies in one page.  Not PAGED: the buffer is contiguous
    from its first page.
    """
    base, run_ok = run_bases(pt_ptr, row_virt, row_ok, cols_left, WIDTH, RUN, PAGE_SHIFT, PAGED)
    return load_bases(pool_ptr, base, run_ok, cols_left, WIDTH, RUN)


@triton.jit
def run_bases(pt_ptr, row_virt, row_ok, cols_left, WIDTH: tl.constexpr, RUN: tl.constexpr,
              PAGE_SHIFT: tl.constexpr, PAGED: tl.constexpr):
    """`load_runs`' page lookups alone: ``(pool offset of each run [rows, WIDTH // RUN] int64, run mask)``,
    so that a kernel can look its pages up early and load the runs later (`load_bases`)."""
    runs = tl.arange(0, WIDTH // RUN)
    run_ok = row_ok[:, None] & (runs[None, :] * RUN < cols_left)
    virt = row_virt[:, None] + runs[None, :] * RUN
    if PAGED:
        page = tl.load(pt_ptr + (virt >> PAGE_SHIFT), mask=run_ok, other=0)
        base = page.to(tl.int64) * (1 << PAGE_SHIFT) + (virt & ((1 << PAGE_SHIFT) - 1))
    else:
        base = tl.load(pt_ptr).to(tl.int64) * (1 << PAGE_SHIFT) + virt
    return tl.multiple_of(base, [RUN, RUN]), run_ok


@triton.jit
def load_bases(pool_ptr, base, run_ok, cols_left, WIDTH: tl.constexpr, RUN: tl.constexpr):
    """``[rows, WIDTH]``: the runs at pool offsets ``base`` (from `run_bases`), masked as `load_runs`."""
    runs = tl.arange(0, WIDTH // RUN)
    lanes = tl.arange(0, RUN)
    col_ok = (runs[:, None] * RUN + lanes[None, :]) < cols_left
    tile = tl.load(pool_ptr + base[:, :, None] + lanes[None, None, :],
                   mask=run_ok[:, :, None] & col_ok[None, :, :], other=0.0)
    return tl.reshape(tile, (base.shape[0], WIDTH))
