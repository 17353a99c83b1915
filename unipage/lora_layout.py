"""Where each LoRA matrix of an adapter lives inside its per-layer buffer.

A resident adapter owns a list of page ids (its *page table*), the same in
every pool row.  In each row those pages form one virtually contiguous buffer;
virtual element ``v`` of layer ``l`` lives at::

    pool[row(l), page_table[v // page_elems], v % page_elems]

``row(l)`` is ``ModelConfig.layer_rows[l]``: the layer itself when every layer
attends alike; with full and sliding-window layers (two KV groups) two layers
share a row, and the row's buffer holds the first one's matrices, then the
second's (every offset of a layer is counted from the start of its row).

Inside the buffer every matrix is stored **rank-major** — A as ``[r, d_in]``,
B as ``[r, d_out]`` (PEFT's ``lora_B`` is ``[d_out, r]``: transposed when
packed) — with every row starting at a multiple of 64 elements and padded to
a multiple of 64 (``stride = round_up(cols, 64)``).  ``page_elems`` is a power
of two >= 64, so any 64-aligned run of 64 elements lies inside one page.

Order inside one layer's buffer::

    [ q A | q B | k A | k B | v A | v B | o A | o B | gate A | gate B | up A | up B | down A | down B ]
      (only the targets the adapter has in this layer, in this order)
    then, in an MoE layer, for expert e = 0 .. E-1 (each expert laid out alike):
    [ gate_up A | gate_up B | down A | down B ]

A target's B may be split into *slices* that cover consecutive output column
ranges; slice ``s`` multiplies rows ``[a_row, a_row + rank)`` of the target's
A-product.  A dense target has one slice.  ``experts.gate_up`` has one slice of
``2·I`` columns when the adapter was trained on the fused 3D parameter (PEFT
``target_parameters``), and two slices — gate (columns ``[0, I)``, A rows
``[0, r_g)``) and up (columns ``[I, 2I)``, A rows ``[r_g, r_g + r_u)``) — when
it was trained on per-expert ``gate_proj``/``up_proj`` modules; then "gate/up
A" is gate's A stacked over up's A and "gate/up B" is gate's B rows followed
by up's B rows (a slice has rank 0 when the adapter trained only one of the
two; A then has up to ``2 · max_rank`` rows).  No matrix is ever padded to a
larger rank.

The LoRA scaling (alpha/r, or alpha/sqrt(r) with rslora) is folded into B
when packing, so ``delta = (x @ A.T) @ B`` for every slice.

This module is pure Python: it computes offsets; `unipage.adapter_pack`
moves the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from unipage.config import EXPERT_TARGETS, ModelConfig

ALIGN = 64  # elements: row starts and row padding


def round_up(n: int, multiple: int = ALIGN) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class Block:
    """A matrix ``[rows, cols]`` at virtual element ``offset``, rows ``stride`` apart."""

    offset: int
    rows: int
    cols: int

    @property
    def stride(self) -> int:
        return round_up(self.cols)

    @property
    def size(self) -> int:
        return self.rows * self.stride


@dataclass(frozen=True, slots=True)
class Slice:
    """One output slice of a target: ``y[:, col:col+b.cols] += t[:, a_row:a_row+b.rows] @ B``."""

    a_row: int  # first row of the target's A feeding this slice
    col: int  # first output column written
    b: Block  # [rank, ncols]

    @property
    def rank(self) -> int:
        return self.b.rows


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """Ranks of one target of one layer (for experts.*: of every expert alike)."""

    target: str  # one of ModelConfig.targets(layer)
    ranks: tuple[int, ...]  # rank of each output slice; slices split d_out evenly
    shared_a: bool = False  # every slice reads the same A rows (fused gate_up)

    def __reduce__(self):  # pickled field by field (an adapter's info holds one per layer and target)
        return TargetSpec, (self.target, self.ranks, self.shared_a)

    @property
    def a_rows(self) -> int:
        return self.ranks[0] if self.shared_a else sum(self.ranks)


@dataclass(frozen=True, slots=True)
class TargetLayout:
    target: str
    expert: int  # -1 for attention / dense targets
    a: Block  # [a_rows, d_in]
    slices: tuple[Slice, ...]

    @property
    def blocks(self) -> tuple[Block, ...]:
        return (self.a,) + tuple(s.b for s in self.slices)


@dataclass(frozen=True, slots=True)
class LayerLayout:
    targets: dict  # (target, expert) -> TargetLayout, in buffer order
    size: int  # end of this layer's matrices in its row's buffer (elements)
    expert_base: int  # offset of expert 0's group (== end of the dense targets)
    expert_stride: int  # elements between consecutive experts' groups; 0 if none


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    layers: tuple[LayerLayout, ...]
    rows: tuple[int, ...]  # pool row of each layer
    num_rows: int  # rows of the pool (and of a packed adapter)

    @property
    def layer_elems(self) -> int:
        """Buffer length needed in every row (the longest row)."""
        return max((layer.size for layer in self.layers), default=0)

    def num_pages(self, page_elems: int) -> int:
        return -(-self.layer_elems // page_elems)

    def entries(self):
        """Yield ``(layer, TargetLayout)`` for every matrix group, in buffer order."""
        for index, layer in enumerate(self.layers):
            for entry in layer.targets.values():
                yield index, entry


def _target_layout(spec: TargetSpec, expert: int, d_in: int, d_out: int, offset: int) -> TargetLayout:
    ncols, rem = divmod(d_out, len(spec.ranks))
    if rem:
        raise ValueError(f"{spec.target}: {d_out} output columns do not split into {len(spec.ranks)} slices")
    a = Block(offset, spec.a_rows, d_in)
    offset += a.size
    slices, a_row = [], 0
    for index, rank in enumerate(spec.ranks):
        b = Block(offset, rank, ncols)
        slices.append(Slice(0 if spec.shared_a else a_row, index * ncols, b))
        offset += b.size
        a_row += rank
    return TargetLayout(spec.target, expert, a, tuple(slices))


def _layer_layout(model: ModelConfig, layer: int, specs: tuple[TargetSpec, ...], offset: int) -> LayerLayout:
    """The layer's matrices from ``offset`` of its row's buffer on."""
    by_target = {s.target: s for s in specs}
    unknown = set(by_target) - set(model.targets(layer))
    if unknown:
        raise ValueError(f"layer {layer} has no LoRA target(s) {sorted(unknown)}")
    entries = {}
    for target in model.targets(layer):
        if target in by_target and target not in EXPERT_TARGETS:
            entry = _target_layout(by_target[target], -1, *model.target_dims(target, layer), offset)
            entries[(target, -1)] = entry
            offset = entry.slices[-1].b.offset + entry.slices[-1].b.size
    expert_base, group = offset, 0
    expert_specs = [by_target[t] for t in EXPERT_TARGETS if t in by_target]
    for expert in range(model.num_experts if expert_specs else 0):
        for spec in expert_specs:
            entry = _target_layout(spec, expert, *model.target_dims(spec.target, layer), offset)
            entries[(spec.target, expert)] = entry
            offset = entry.slices[-1].b.offset + entry.slices[-1].b.size
        if expert == 0:
            group = offset - expert_base
    return LayerLayout(entries, offset, expert_base, group)


def build_layout(model: ModelConfig, layers: list[tuple[TargetSpec, ...]]) -> AdapterLayout:
    """Lay out an adapter whose layer ``l`` has the targets ``layers[l]``."""
    if len(layers) != model.num_layers:
        raise ValueError(f"adapter spec has {len(layers)} layers, model has {model.num_layers}")
    row_end = [0] * model.pool_rows  # elements of each row's buffer used so far
    out = []
    for i, specs in enumerate(layers):  # KV groups in layer order: a row's layers stack in that order
        row = model.layer_rows[i]
        out.append(_layer_layout(model, i, tuple(specs), row_end[row]))
        row_end[row] = out[-1].size
    return AdapterLayout(tuple(out), model.layer_rows, model.pool_rows)


@lru_cache(maxsize=1024)
def cached_layout(model: ModelConfig, layers: tuple[tuple[TargetSpec, ...], ...]) -> AdapterLayout:
    """`build_layout`, shared between adapters of the same shape (layouts are immutable)."""
    return build_layout(model, list(layers))
