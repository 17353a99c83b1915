"""Skinny linear: ``y = x @ w.T (+ bias)`` for a few rows of x (decode steps), streaming w.

At decode a projection's GEMM has a handful of rows (setup (a): 16 tokens) and thousands of
columns: it only has to read W once, so its floor is W's bytes over the read bandwidth.  cuBLAS
picks tiles of 16 x 64 there, and for GPT-OSS-20B's o projection (K 4096) a split-K kernel plus a
separate reduction launch.  This kernel streams W in column tiles of ``block_n`` rows of W, the
whole (padded) x block in every program, and optionally splits K over ``split_k`` programs per
tile.  ``swap`` computes ``y.T = w @ x.T`` instead, so that w's ``block_n x block_k`` tile is the tall
operand of the dot (on Hopper, a warpgroup MMA that reads it from shared memory; block_n >= 64).

Math (per output element, fp32 accumulation, one rounding to the output dtype)::

    y[m, n] = round(sum_k x[m, k] * w[n, k] + bias[n])

as ``F.linear`` (cuBLAS's bias epilogue: the bias added before the one rounding).  The order of
the fp32 sum differs from cuBLAS's, so results agree within the model dtype's rounding.

Split K.  With ``split_k`` > 1 the programs of a column tile write their fp32 partial to a
workspace; the last to finish (a per-tile counter, atomic, acquire-release) adds the partials in
split order, so the result does not depend on which program finished last, writes y and resets
the counter for the next launch.  The counters live in one zeroed buffer per device that every
launch reuses: two split-K launches on different streams at once would share them (the engine
runs its projections on one stream).

Where it runs.  `linear` (the model's projections and router) takes the kernel only for a weight
shape with a tuned entry in ``configs/skinny.json`` for this GPU (or one of its compute capability:
`common.config_devices`), for x of 1 to the entry's ``max_tokens`` rows; everything else runs
``F.linear``.  The entries come from ``benchmarks/kernels_skinny.py --tune --save``, which writes one
only where the kernel beat ``F.linear``.  `skinny_linear_ref` is ``F.linear``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from unipage.kernels.common import cdiv, config_devices, fit_stages, next_pow2
from unipage.kernels.launch import launch

__all__ = ["ENABLED", "SKINNY", "check_config", "linear", "shape_key", "skinny_linear", "skinny_linear_ref",
           "tuned_config"]

CONFIG_PATH = Path(__file__).with_name("configs") / "skinny.json"
# the settings a tuned entry overlays; max_tokens: x of at most this many rows takes the kernel
SKINNY = {"max_tokens": 0, "block_n": 32, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 4,
          "swap": False}
MAX_ROWS = 64  # the kernel's x block: at most this many rows (a larger x takes F.linear)
MAX_SPLIT = 16  # split_k at most
ENABLED = True  # False: `linear` is F.linear everywhere (an A/B switch; captured graphs keep what they hold)
COUNTERS = 1 << 14  # per-device split-K counters: column tiles one launch may have

_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                   stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   SPLIT: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr):
    tile, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BM)
    cols = tile * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok, col_ok = rows < M, cols < N
    k_start = split * k_per_split
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_start + ks)[None, :]
    w_ptrs = w_ptr + cols[:, None] * stride_wn + (k_start + ks)[None, :]
    acc = tl.zeros((BN, BM) if SWAP else (BM, BN), tl.float32)
    for k in range(k_start, k_start + k_per_split, BK):
        xt, wt = _load_tiles(x_ptrs, w_ptrs, row_ok, col_ok, k + ks, K, EVEN_K)
        acc = _mma(acc, xt, wt, SWAP)
        x_ptrs += BK
        w_ptrs += BK
    if SWAP:
        acc = tl.trans(acc)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT > 1:
        part_ptrs = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(part_ptrs + split * BM * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            acc = tl.zeros((BM, BN), tl.float32)
            for s in range(SPLIT):  # split order: the same sum whichever program came last
                acc += tl.load(part_ptrs + s * BM * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch
            _store_y(acc, b_ptr, y_ptr, rows, cols, stride_ym, col_ok, out_mask, HAS_BIAS)
    else:
        _store_y(acc, b_ptr, y_ptr, rows, cols, stride_ym, col_ok, out_mask, HAS_BIAS)


@triton.jit
def _mma(acc, xt, wt, SWAP: tl.constexpr):
    """``acc + x @ w.T`` (``[BM, BN]``), or with SWAP ``acc + w @ x.T`` (``[BN, BM]``: w's tile the dot's tall
    operand; on Hopper a warpgroup MMA that reads it from shared memory)."""
    if SWAP:
        out = tl.dot(wt, tl.trans(xt), acc)
    else:
        out = tl.dot(xt, tl.trans(wt), acc)
    return out


@triton.jit
def _load_tiles(x_ptrs, w_ptrs, row_ok, col_ok, k_offs, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        wt = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
    else:
        k_ok = (k_offs < K)[None, :]
        xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok, other=0.0)
        wt = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok, other=0.0)
    return xt, wt


@triton.jit
def _store_y(acc, b_ptr, y_ptr, rows, cols, stride_ym, col_ok, out_mask, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def check_config(cfg: dict) -> None:
    """ValueError unless ``cfg`` (all of `SKINNY`'s settings) is a valid launch setting."""
    pow2 = lambda n: isinstance(n, int) and n > 0 and n & (n - 1) == 0  # noqa: E731
    if not (pow2(cfg["block_n"]) and 16 <= cfg["block_n"] <= 256):
        raise ValueError(f"skinny_linear: block_n must be a power of two in [16, 256], got {cfg['block_n']}")
    if not (pow2(cfg["block_k"]) and cfg["block_k"] >= 16):
        raise ValueError(f"skinny_linear: block_k must be a power of two >= 16, got {cfg['block_k']}")
    if not (isinstance(cfg["split_k"], int) and 1 <= cfg["split_k"] <= MAX_SPLIT):
        raise ValueError(f"skinny_linear: split_k must be in [1, {MAX_SPLIT}], got {cfg['split_k']}")
    if not isinstance(cfg["swap"], bool):
        raise ValueError(f"skinny_linear: swap must be a bool, got {cfg['swap']!r}")
    if not 0 <= cfg["max_tokens"] <= MAX_ROWS:
        raise ValueError(f"skinny_linear: max_tokens must be in [0, {MAX_ROWS}], got {cfg['max_tokens']}")


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_linear: x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear: at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"skinny_linear: x and w must be one dtype (fp16 or bf16) on one device, got {x.dtype} "
                         f"{x.device} and {w.dtype} {w.device}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("skinny_linear: x's and w's rows must be contiguous")
    if max(_span(x), _span(w), MAX_SPLIT * MAX_ROWS * w.shape[0]) >= 1 << 31:  # (element offsets are 32-bit)
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and w {tuple(w.shape)} must span fewer than 2**31 "
                         f"elements, and N x {MAX_SPLIT * MAX_ROWS} too (the split-K partials)")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != w.dtype or bias.device != w.device
                             or bias.stride(0) != 1):
        raise ValueError(f"skinny_linear: bias must be contiguous [{w.shape[0]}] {w.dtype}, got "
                         f"{tuple(bias.shape)} {bias.dtype} with strides {bias.stride()}")


def _span(t: torch.Tensor) -> int:
    """Elements from a 2-D tensor's first to its last, plus one."""
    return (t.shape[0] - 1) * t.stride(0) + t.shape[1] if t.numel() else 0


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    if tiles > COUNTERS:
        raise ValueError(f"skinny_linear: {tiles} column tiles with split_k > 1, at most {COUNTERS}")
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # (its zero-fill would only be
            raise RuntimeError("skinny_linear: the first split-K launch on a device must run before CUDA graph "
                               "capture (its counters are made and zeroed then)")  # recorded, not run)
        counters = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return counters


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` (module docstring): x ``[M, K]`` (M <= `MAX_ROWS`), w ``[N, K]``, bias ``[N]``
    or None, one dtype, rows contiguous; returns a new ``[M, N]``.  ``config`` overrides `SKINNY`."""
    _check(x, w, bias)
    cfg = SKINNY | (config or {})
    check_config(cfg)
    (rows, k), n = x.shape, w.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    block_m, block_n = max(16, next_pow2(rows)), cfg["block_n"]
    # (a setting tuned at 16 rows must still launch at 64: block_k, then the stages, shrink to fit)
    block_k, stages = fit_stages(cfg["block_k"], cfg["num_stages"], block_m + block_n, x.element_size(), x.device)
    split = max(1, min(cfg["split_k"], cdiv(k, block_k)))
    k_per_split = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_per_split)  # (no empty split)
    tiles = cdiv(n, block_n)
    part = counters = y  # (unused pointers without split-K)
    if split > 1:
        part = torch.empty(split, block_m, n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device, tiles)
    launch(_skinny_kernel, (tiles, split), x, w, bias if bias is not None else w, y, part, counters,
           rows, n, k, k_per_split, x.stride(0), w.stride(0), y.stride(0),
           HAS_BIAS=bias is not None, BM=block_m, BN=block_n, BK=block_k, SPLIT=split,
           EVEN_K=k % k_per_split == 0, SWAP=bool(cfg["swap"]),
           num_warps=cfg["num_warps"], num_stages=stages)
    return y


def skinny_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """The reference: ``F.linear`` (``config`` ignored)."""
    _check(x, w, bias)
    return F.linear(x, w, bias)


def shape_key(n: int, k: int, dtype: torch.dtype) -> str:
    """A weight's key in ``configs/skinny.json``: ``"bfloat16/3136x4096"`` for w ``[3136, 4096]`` bf16."""
    return f"{str(dtype).removeprefix('torch.')}/{n}x{k}"


@functools.lru_cache(maxsize=256)
def tuned_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict | None:
    """The tuned setting for a weight ``[n, k]`` of ``dtype`` on ``device``, or None (`F.linear` there)."""
    if device.type != "cuda":
        return None
    tables, key = _load_json().get("tuned", {}), shape_key(n, k, dtype)
    entry = next((tables[d][key] for d in config_devices(device) if key in tables.get(d, {})), None)
    return None if entry is None else SKINNY | entry


@functools.cache
def _load_json() -> dict:
    return json.loads(CONFIG_PATH.read_text())


def reload_configs() -> None:
    """Read ``configs/skinny.json`` again at the next lookup (after a tuner rewrote it; CUDA graphs captured
    before keep the launches they hold)."""
    _load_json.cache_clear()
    tuned_config.cache_clear()


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)``: `skinny_linear` for w's tuned entry (`tuned_config`) and a 2-D x of 1 to its
    ``max_tokens`` rows, rows and the bias contiguous; ``F.linear`` otherwise (and while `ENABLED` is False)."""
    if ENABLED and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1 \
            and x.dtype == w.dtype and x.dtype in (torch.float16, torch.bfloat16) \
            and (bias is None or bias.stride(0) == 1):
        cfg = tuned_config(w.shape[0], w.shape[1], w.dtype, w.device)
        if cfg is not None and x.shape[0] <= cfg["max_tokens"]:
            return skinny_linear(x, w, bias, cfg)
    return F.linear(x, w, bias)
