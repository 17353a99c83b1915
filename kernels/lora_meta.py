"""Host-side inputs of the paged dense LoRA kernels (`unipage.kernels.lora`).

Shape legend: S = adapter slots, J = output slices of one call (q, k, v),
T = tokens of the step, M = row tiles of the grouped path.

* `DenseLoraMeta` — per slot and slice, where A and B start in the slot's
  per-layer buffer and the rank (0: the slot's adapter lacks that target).
  Built from the real `AdapterLayout`s by `dense_lora_meta`, or kept up to
  date slot by slot by `unipage.models.lora_tables.LoraTables`.
* `LoraBatch` — how one step's tokens are cut into kernel programs: one per
  token (GEMV path, decode) or tiles of ``block_m`` tokens of one adapter
  (grouped, SGMV-like path).  Built once per step on the device with torch
  ops, no host sync, and shared by every layer.
* `launch_config` — tile sizes, Split-K and warps, from
  ``configs/lora_dense.json`` (a default, plus entries tuned per device and
  shape by ``benchmarks/kernels_lora.py --tune``).
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unipage.kernels.common import clear_device_caches, config_devices, next_pow2, num_sms
from unipage.lora_layout import ALIGN, AdapterLayout

CONFIG_PATH = Path(__file__).with_name("configs") / "lora_dense.json"
COL_TILE_WIDTHS = (64, 128, 256, 512)  # block_n values whose column tables are built eagerly


class HostRows(Sequence):
    """Rows of a host int array ``[S, J]`` read as tuples: a host copy with no Python object per slot.

    A view: it follows the array it was made from (`LoraTables` writes one slot's row in place).
    """

    __slots__ = ("array",)

    def __init__(self, array) -> None:
        self.array = array  # [S, J] numpy int array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, slot):
        if isinstance(slot, slice):
            return [tuple(row) for row in self.array[slot].tolist()]
        return tuple(self.array[slot].tolist())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(
            row == tuple(want) for row, want in zip(self, other))

    __hash__ = None


@dataclass(frozen=True, eq=False)
class DenseLoraMeta:
    """Where each slot's LoRA matrices for one layer and one group of targets live.

    Slice ``j`` writes ``y[:, slice_starts[j] : slice_starts[j] + slice_cols[j]]``.
    Host copies (tuples, or `HostRows` views) serve the torch reference; tensors the kernels.
    ``max_rank`` and ``buffer_elems`` may exceed what the slots hold now (`LoraTables` keeps
    them at their high-water marks so that launch shapes do not change as adapters come and go).
    """

    targets: tuple[str, ...]  # target names, one per slice (repeated if a target has several)
    d_in: int  # input width shared by every slice
    slice_cols: tuple[int, ...]  # [J] output columns of each slice
    slice_starts: tuple[int, ...]  # [J] first column of each slice in y
    ranks: Sequence[tuple[int, ...]]  # [S][J] rank; 0 = slot empty or lacks the target
    a_offsets: Sequence[tuple[int, ...]]  # [S][J] virtual element of the slice's first A row
    b_offsets: Sequence[tuple[int, ...]]  # [S][J] virtual element of the slice's B
    buffer_elems: int  # elements of the largest slot's buffer in this layer: the page tables must cover them
    max_rank: int  # >= every rank in ``ranks`` (0: no slot has these targets): sets the kernels' rank block
    rank: torch.Tensor  # [S, J] int32
    a_offset: torch.Tensor  # [S, J] int32
    b_offset: torch.Tensor  # [S, J] int32
    col_tiles: dict = field(default_factory=dict)  # block_n -> [n_tiles, 4] int32

    @property
    def num_slots(self) -> int:
        return len(self.ranks)

    @property
    def num_slices(self) -> int:
        return len(self.slice_cols)

    @property
    def out_cols(self) -> int:
        return self.slice_starts[-1] + self.slice_cols[-1]

    @functools.cached_property  # (max_rank is a field of a frozen object: computed once per meta)
    def rank_block(self) -> int:
        """Rank padded to a power of two >= 16: the kernels' intermediate width per slice."""
        return max(16, next_pow2(self.max_rank))

    def col_tile_table(self, block_n: int) -> torch.Tensor:
        """``[n_tiles, 4]`` int32 rows ``(slice, first column in slice, slice width, y column of slice)``.

        Every tile lies inside one slice, so slices of any width share one grid.
        """
        if block_n not in self.col_tiles:  # not graph-capturable: prefer COL_TILE_WIDTHS
            self.col_tiles[block_n] = _col_tiles(self.slice_cols, self.slice_starts, block_n, self.rank.device)
        return self.col_tiles[block_n]


def _col_tiles(cols, starts, block_n: int, device) -> torch.Tensor:
    rows = [(j, n0, width, start) for j, (width, start) in enumerate(zip(cols, starts))
            for n0 in range(0, width, block_n)]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(-1, 4)


def _target_slices(layouts, layer: int, target: str, model) -> list[int]:
    """Output widths of the slices of ``target``: from the first adapter that has it, else the model."""
    for layout in layouts:
        entry = layout and layout.layers[layer].targets.get((target, -1))
        if entry is not None:
            return [piece.b.cols for piece in entry.slices]
    if model is None:
        raise ValueError(f"no adapter has target {target!r} in layer {layer}: pass model= to size its slice")
    return [model.target_dims(target, layer)[1]]


def dense_slot_row(layout: AdapterLayout | None, layer: int, targets, widths) -> list[tuple[int, int, int]]:
    """``(rank, a_offset, b_offset)`` per slice for one slot (``widths``: each target's slice widths)."""
    row = []
    for target, target_widths in zip(targets, widths):
        entry = layout.layers[layer].targets.get((target, -1)) if layout else None
        if entry is None:
            row += [(0, 0, 0)] * len(target_widths)
            continue
        got = [piece.b.cols for piece in entry.slices]
        if got != target_widths:
            raise ValueError(f"{target!r} in layer {layer}: slice widths {got} differ from {target_widths}")
        row += [(p.rank, entry.a.offset + p.a_row * entry.a.stride, p.b.offset) for p in entry.slices]
    return row


def _d_in(layouts, layer: int, targets, model) -> int:
    widths = {e.a.cols for lay in layouts if lay for t in targets
              if (e := lay.layers[layer].targets.get((t, -1))) is not None}
    if model is not None:
        widths |= {model.target_dims(t, layer)[0] for t in targets}
    if len(widths) != 1:
        raise ValueError(f"targets {targets} of layer {layer} must share one input width, got {sorted(widths)}")
    return widths.pop()


def dense_lora_meta(layouts: list[AdapterLayout | None], layer: int, targets: tuple[str, ...],
                    device: torch.device | str = "cpu", model=None) -> DenseLoraMeta:
    """Build the metadata of one call over ``targets`` (e.g. q, k, v) of ``layer``.

    ``layouts[s]`` is the layout of the adapter in slot ``s`` (None: empty
    slot).  ``model`` (a `ModelConfig`) is needed only to size a target no
    adapter has.
    """
    if not layouts:
        raise ValueError("dense_lora_meta needs at least one slot")
    targets = tuple(targets)
    widths = [_target_slices(layouts, layer, t, model) for t in targets]
    rows = [dense_slot_row(lay, layer, targets, widths) for lay in layouts]
    cols = tuple(w for ws in widths for w in ws)
    starts = tuple(sum(cols[:j]) for j in range(len(cols)))

    def table(k: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(entry[k] for entry in row) for row in rows)

    def tensor(k: int) -> torch.Tensor:
        return torch.tensor(table(k), dtype=torch.int32, device=device).view(len(rows), len(cols))

    ranks = table(0)
    elems = max((lay.layers[layer].size for lay in layouts if lay), default=0)
    meta = DenseLoraMeta(
        targets=tuple(t for t, ws in zip(targets, widths) for _ in ws),
        d_in=_d_in(layouts, layer, targets, model), slice_cols=cols, slice_starts=starts,
        ranks=ranks, a_offsets=table(1), b_offsets=table(2), buffer_elems=elems,
        max_rank=max((r for row in ranks for r in row), default=0),
        rank=tensor(0), a_offset=tensor(1), b_offset=tensor(2))
    for block_n in COL_TILE_WIDTHS:
        meta.col_tile_table(block_n)
    return meta


# ---------------------------------------------------------------- batch plan


@dataclass(frozen=True, eq=False)
class LoraBatch:
    """How the tokens of one step map onto kernel programs (shared by every layer).

    GEMV path (``grouped`` False): one program row per token; ``tiles`` and
    ``token_order`` are unused.  Grouped path: tile ``m`` covers the tokens
    ``token_order[first:end]``, all of adapter ``slot``; padding tiles have
    slot -1 so the grid size depends only on ``T``, ``S`` and ``block_m``.
    """

    num_tokens: int  # T
    grouped: bool
    block_m: int  # tokens per tile: 1 on the GEMV path, else a power of two >= 16
    token_order: torch.Tensor  # [T] int64, token ids sorted by slot (tokens without adapter first)
    tiles: torch.Tensor  # [M, 3] int32 (slot, first, end) into token_order
    plans: dict = field(default_factory=dict, repr=False)  # the launchers' per-geometry plans of this batch

    @property
    def num_row_tiles(self) -> int:
        return self.tiles.shape[0] if self.grouped else self.num_tokens


def plan_lora_batch(token_slots: torch.Tensor, num_slots: int, group_tokens: int | None = None,
                    grouped: bool | None = None, block_m: int | None = None,
                    max_groups: int | None = None) -> LoraBatch:
    """Plan one step from ``token_slots`` ``[T]`` int32 (slot per token, -1 for none).

    ``group_tokens``: tokens of the largest adapter group if the caller knows
    it (the scheduler does); else estimated as ``ceil(T / min(T, S))``.  The
    tile height follows it, not ``T``.  ``max_groups``: at most this many
    distinct adapters among the tokens (the step's adapter count, if known):
    it bounds the padding tiles of the grid, which otherwise grow with ``S``
    (the slot capacity, thousands with many adapters).  ``grouped`` /
    ``block_m`` override the choice (tests, tuning).
    """
    count = token_slots.numel()
    if group_tokens is None:
        group_tokens = -(-count // max(1, min(count, num_slots)))
    if grouped is None:
        grouped = plan_block_m(group_tokens) > 1
    if not grouped:
        return LoraBatch(count, False, 1, token_slots, token_slots)
    if block_m is None:
        block_m = max(16, plan_block_m(group_tokens))
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    groups = min(num_slots, count) if max_groups is None else min(num_slots, count, max(max_groups, 1))
    order, tiles = _group_tiles(token_slots, num_slots, block_m, groups)
    return LoraBatch(count, True, block_m, order, tiles)


def plan_block_m(group_tokens: int) -> int:
    """The tile height `plan_lora_batch` picks when the largest adapter group has ``group_tokens``
    tokens: 1 for the GEMV path, else a power of two >= 16.  A plan made with ``group_tokens`` equal
    to the result picks it again (the CUDA graphs of mixed steps key on it)."""
    plan = _load_json()["plan"]
    if group_tokens <= plan["gemv_max_group"]:
        return 1
    return min(plan["max_block_m"], max(16, next_pow2(group_tokens)))


def _group_tiles(token_slots: torch.Tensor, num_slots: int, block_m: int, groups: int):
    """Sort tokens by slot and cut each adapter's run into tiles, on the device, without a sync.
    ``groups`` bounds the adapters present: the grid has ``ceil(T / block_m) + groups`` tile rows."""
    count, device = token_slots.numel(), token_slots.device
    slots = token_slots.long()
    order = torch.sort(slots, stable=True).indices
    sizes = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
    sizes.scatter_add_(0, slots + 1, torch.ones_like(slots))  # sizes[0]: tokens without adapter
    ends = torch.cumsum(sizes, 0)[1:]  # [S] end of each slot's run in `order`
    sizes = sizes[1:]
    per_slot = (sizes + block_m - 1) // block_m
    cum = torch.cumsum(per_slot, 0)
    capacity = -(-count // block_m) + groups
    index = torch.arange(capacity, device=device)
    slot = torch.searchsorted(cum, index, right=True)
    valid = slot < num_slots
    slot = slot.clamp(max=num_slots - 1)
    first = ends[slot] - sizes[slot] + (index - cum[slot] + per_slot[slot]) * block_m
    end = torch.minimum(first + block_m, ends[slot])
    tiles = torch.stack([torch.where(valid, slot, -1), first, end], 1).to(torch.int32)
    return order, tiles.contiguous()


# ------------------------------------------------------------- launch configs


@functools.lru_cache(maxsize=1)
def _load_json() -> dict:
    return json.loads(CONFIG_PATH.read_text())


def shape_key(meta: DenseLoraMeta, dtype: torch.dtype) -> str:
    """Key of a tuned entry: dtype, d_in, slice widths and rank block."""
    name = str(dtype).removeprefix("torch.")
    return f"{name}/{meta.d_in}/{'+'.join(map(str, meta.slice_cols))}/r{meta.rank_block}"


def launch_config(meta: DenseLoraMeta, batch: LoraBatch, dtype: torch.dtype,
                  device: torch.device) -> dict:
    """The default config of the batch's path, overlaid with the tuned entry for this device (else a
    GPU of its compute capability: `config_devices`), shape and the largest token bucket <= T (if any)."""
    path = "grouped" if batch.grouped else "gemv"
    buckets, configs = _tuned(config_devices(device), shape_key(meta, dtype), path)
    return dict(configs[bisect.bisect_right(buckets, batch.num_tokens)])


def reload_configs() -> None:
    """Read ``configs/lora_dense.json`` again at the next launch (after a tuning run rewrote it)."""
    _load_json.cache_clear()
    _tuned.cache_clear()
    clear_device_caches()


@functools.lru_cache(maxsize=256)
def _tuned(devices: tuple[str, ...], shape: str, path: str) -> tuple[list[int], list[dict]]:
    """``(buckets, configs)``: the tuned token buckets of the first of ``devices`` with an entry for the
    shape and path, in ascending order, and ``configs[i]`` the config for a batch of at least
    ``buckets[i - 1]`` tokens (``configs[0]``: the default, for fewer tokens than any bucket)."""
    data = _load_json()
    config = dict(data["default"][path])
    entries = (data.get("tuned", {}).get(device, {}).get(shape, {}).get(path) for device in devices)
    tuned = next((entry for entry in entries if entry), {})
    buckets = sorted(int(b) for b in tuned)
    configs = [config] + [config | tuned[str(b)] for b in buckets]
    return buckets, configs


def split_k_plan(d_in: int, block_k: int, programs: int, config: dict, device) -> tuple[int, int, int]:
    """``(block_k, split_k, k_per_split)``: Split-K so that the skinny shrink fills the GPU.

    ``block_k`` is lowered (halving, down to 64) until it divides ``d_in``
    (then the K masks go) and there are at least ``split_k`` steps; every
    split covers a whole number of ``block_k`` steps.
    """
    split = config.get("split_k", 0)
    if not split:
        target = config.get("waves", 2) * num_sms(device)
        split = min(config.get("max_split_k", 64), next_pow2(-(-target // max(1, programs))))
    while block_k > ALIGN and (d_in % block_k or -(-d_in // block_k) < split):
        block_k //= 2  # whole steps per split, and no K masks where d_in allows
    steps = -(-d_in // block_k)
    split = max(1, min(split, steps))
    k_per_split = -(-steps // split) * block_k
    return block_k, -(-d_in // k_per_split), k_per_split


def rows_block(meta: DenseLoraMeta, config: dict) -> int:
    """Stacked A rows (slices x rank block) one shrink program computes."""
    return min(next_pow2(meta.num_slices * meta.rank_block), max(16, config.get("rows", 64)))
