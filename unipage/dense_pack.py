"""Pack a dense adapter's files into pages a target at a time, across layers.

`unipage.adapter_reader.read_and_pack` reads and packs every adapter load
(in the reader processes on CUDA).  The general path
(`peft_io.load_adapter_weights` + `adapter_pack.pack_adapter`) converts and
writes each module on its own: some ten small tensor operations per module,
64 modules for rank-4 attention LoRA on a 16-layer model, whose fixed costs
make up most of the read.  An adapter whose modules are all dense (no
experts) and whose every target sits at the same place of its layer's row in
every layer it appears in, those layers' rows being consecutive pool rows (as
in a model with one KV group: a row per layer), is packed here instead with a
few operations per target: its layers' A and B matrices stacked, B transposed
and scaled at once, each written into the page buffer as one strided copy.  The result is the general path's, bit for bit (the same
element-wise fp32 arithmetic and casts); anything else returns None, and the
general path packs it.

Shape legend: G = layers a target appears in, r = rank, L = pool rows,
n = the adapter's pages, P = page_elems.
"""

from __future__ import annotations

import torch

from unipage.adapter_info import AdapterInfo, LoraModule
from unipage.config import ModelConfig
from unipage.errors import AdapterFormatError
from unipage.lora_layout import AdapterLayout, Block
from unipage.peft_io import KEY_PREFIX, read_verified


def pack_dense(info: AdapterInfo, layout: AdapterLayout, model: ModelConfig, page_elems: int,
               dtype: torch.dtype) -> torch.Tensor | None:
    """The packed page buffer ``[L, n, P]``, or None if the adapter does not qualify (see above)."""
    groups = _target_groups(info, layout)
    if groups is None:
        return None
    tensors = read_verified(info)
    num_pages = layout.num_pages(page_elems)
    buf = torch.zeros(layout.num_rows, num_pages * page_elems, dtype=dtype)
    for modules, rows, a_block, b_block in groups:
        a, b = _stacked(modules, tensors, model)
        scaling = torch.tensor([m.scaling for m in modules], dtype=torch.float32).view(-1, 1, 1)
        _write(buf, rows, a_block, a)
        _write(buf, rows, b_block, b.float().transpose(1, 2) * scaling)
    return buf.view(layout.num_rows, num_pages, page_elems)


def _target_groups(info: AdapterInfo, layout: AdapterLayout):
    """Per target: ``(modules, rows, A block, B block)``, modules in layer order and ``rows`` the pool rows
    of their layers as a slice; None unless every module is dense and each target's blocks are the same
    in every layer, on consecutive rows."""
    by_target: dict[str, list[LoraModule]] = {}
    for module in info.modules:
        if module.expert != -1 or module.fused or module.part != 0:
            return None
        by_target.setdefault(module.target, []).append(module)
    groups = []
    for modules in by_target.values():
        modules.sort(key=lambda m: m.layer)
        entries = [layout.layers[m.layer].targets.get((m.target, -1)) for m in modules]
        if any(e is None or len(e.slices) != 1 for e in entries):
            return None
        first = entries[0]
        if any((e.a, e.slices[0].b) != (first.a, first.slices[0].b) for e in entries):
            return None
        start = layout.rows[modules[0].layer]
        if [layout.rows[m.layer] for m in modules] != list(range(start, start + len(modules))):
            return None
        groups.append((modules, slice(start, start + len(modules)), first.a, first.slices[0].b))
    return groups


def _stacked(modules: list[LoraModule], tensors: dict, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The modules' ``lora_A`` ``[G, r, d_in]`` and ``lora_B`` ``[G, d_out, r]``, as stored."""
    a = [tensors[f"{KEY_PREFIX}{m.name}.lora_A.weight"] for m in modules]
    b = [tensors[f"{KEY_PREFIX}{m.name}.lora_B.weight"] for m in modules]
    for m, a_m, b_m in zip(modules, a, b):
        d_in, d_out = model.target_dims(m.target, m.layer)
        if tuple(a_m.shape) != (m.rank, d_in) or tuple(b_m.shape) != (d_out, m.rank):
            raise AdapterFormatError(f"module {m.name} changed shape since it was inspected")
    return torch.stack(a), torch.stack(b)


def _write(buf: torch.Tensor, rows: slice, block: Block, values: torch.Tensor) -> None:
    """Copy ``values`` ``[G, block.rows, block.cols]`` into ``block`` of the rows ``rows`` (cast in the copy)."""
    if tuple(values.shape[1:]) != (block.rows, block.cols):  # no broadcasting into the block
        raise ValueError(f"expected [G, {block.rows}, {block.cols}] for the block, got {tuple(values.shape)}")
    span = buf[rows, block.offset:block.offset + block.size].view(-1, block.rows, block.stride)
    span[:, :, :block.cols].copy_(values)
