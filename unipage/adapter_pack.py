"""Move LoRA matrices into and out of the paged layout of `unipage.lora_layout`.

Shape legend: L = pool rows (the layers, or pairs of them: `ModelConfig.layer_rows`),
N = pages in the pool, P = page_elems,
n = pages of one adapter, R = rows of a target's A, r = rank of one slice.

``LoraWeights`` maps ``(layer, target, expert)`` (expert -1 for dense and
attention targets) to ``LoraMatrices``: A ``[R, d_in]`` and one B
``[r, ncols]`` per output slice, with the scaling already folded into B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unipage.lora_layout import AdapterLayout, Block


@dataclass(frozen=True, slots=True)
class LoraMatrices:
    a: torch.Tensor  # [R, d_in]
    b: tuple[torch.Tensor, ...]  # per slice: [r, ncols], scaling folded in


LoraWeights = dict  # (layer, target, expert) -> LoraMatrices


def _check_shape(key, what: str, tensor: torch.Tensor, block: Block) -> None:
    if tuple(tensor.shape) != (block.rows, block.cols):
        raise ValueError(f"{key} {what}: expected shape {(block.rows, block.cols)}, got {tuple(tensor.shape)}")


def pack_adapter(layout: AdapterLayout, weights: LoraWeights, page_elems: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Pack ``weights`` into a zero-padded page buffer ``[L, n, P]``.

    Page ``i`` of the result is what goes into pool page ``page_table[i]``.
    """
    num_pages = layout.num_pages(page_elems)
    buf = torch.zeros(layout.num_rows, num_pages * page_elems, dtype=dtype, device=device)
    for layer, entry in layout.entries():
        key = (layer, entry.target, entry.expert)
        if key not in weights:
            raise ValueError(f"no weights for {key}")
        mats = weights[key]
        if len(mats.b) != len(entry.slices):
            raise ValueError(f"{key}: expected {len(entry.slices)} B slices, got {len(mats.b)}")
        row = buf[layout.rows[layer]]
        _write_block(row, entry.a, mats.a, key, "A")
        for index, (piece, tensor) in enumerate(zip(entry.slices, mats.b)):
            _write_block(row, piece.b, tensor, key, f"B[{index}]")
    return buf.view(layout.num_rows, num_pages, page_elems)


def _write_block(flat: torch.Tensor, block: Block, tensor: torch.Tensor, key, what: str) -> None:
    _check_shape(key, what, tensor, block)
    rows = flat[block.offset: block.offset + block.size].view(block.rows, block.stride)
    rows[:, : block.cols].copy_(tensor)  # cast in the copy (one op: adapters are packed per load)


def block_indices(page_table: torch.Tensor, block: Block, page_elems: int) -> torch.Tensor:
    """Flat indices into one layer's ``[N * P]`` pool for the elements of ``block``: ``[rows, cols]``.

    ``page_table``: ``[n]`` int64, the adapter's page ids.
    """
    shift = page_elems.bit_length() - 1
    device = page_table.device
    virtual = (block.offset + torch.arange(block.rows, device=device)[:, None] * block.stride
               + torch.arange(block.cols, device=device)[None, :])
    return page_table[virtual >> shift] * page_elems + (virtual & (page_elems - 1))


def gather_block(pool_layer: torch.Tensor, page_table: torch.Tensor, block: Block) -> torch.Tensor:
    """Read ``block`` of one layer through the page table.

    ``pool_layer``: ``[N, P]`` (one layer of the pool); returns ``[rows, cols]``.
    """
    index = block_indices(page_table, block, pool_layer.shape[-1])
    return pool_layer.reshape(-1)[index]


def gather_adapter(pool: torch.Tensor, page_table: list[int] | torch.Tensor,
                   layout: AdapterLayout) -> LoraWeights:
    """Read every matrix of a resident adapter back out of ``pool`` ``[L, N, P]`` (L pool rows)."""
    table = torch.as_tensor(page_table, dtype=torch.int64, device=pool.device)
    out = {}
    for layer, entry in layout.entries():
        row = pool[layout.rows[layer]]
        a = gather_block(row, table, entry.a)
        b = tuple(gather_block(row, table, piece.b) for piece in entry.slices)
        out[(layer, entry.target, entry.expert)] = LoraMatrices(a, b)
    return out


def random_lora_weights(layout: AdapterLayout, generator: torch.Generator,
                        dtype: torch.dtype = torch.float32, std: float = 0.1) -> LoraWeights:
    """Random (never zero) matrices for every entry of ``layout``: for tests and benchmarks."""
    def rand(block: Block) -> torch.Tensor:
        return (torch.randn(block.rows, block.cols, generator=generator) * std).to(dtype)

    return {
        (layer, e.target, e.expert): LoraMatrices(rand(e.a), tuple(rand(s.b) for s in e.slices))
        for layer, e in layout.entries()
    }
