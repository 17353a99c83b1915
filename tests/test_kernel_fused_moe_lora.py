"""Paged fused_moe_lora: expert LoRA deltas of many adapters read from scattered pool pages.

Adapters are packed with `pack_adapter` into pages placed at shuffled ids of a
pool whose other pages hold noise.  CPU runs the Triton kernels under the
interpreter at tiny shapes; the GPU tests (GPT-OSS-20B and Qwen3-30B-A3B layers) are in
`test_kernel_fused_moe_lora_gpu`.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from unipage.adapter_pack import pack_adapter, random_lora_weights
from unipage.config import ModelConfig
from unipage.kernels.fused_moe import fused_experts, fused_experts_ref, moe_gate_up_ref, route_topk_ref
from unipage.kernels.fused_moe_lora import (MoeLora, lora_pairs, moe_lora_down, moe_lora_down_ref,
                                            moe_lora_gate_up, moe_lora_gate_up_ref, moe_lora_meta, moe_lora_shrink,
                                            plan_moe_lora, plan_moe_lora_ref)
from unipage.kernels.moe_align import moe_align_ref
from unipage.kernels.moe_ranks import slot_ranks
from unipage.lora_layout import TargetSpec, build_layout

H, I, E, K, LAYER = 64, 32, 8, 2, 1
BASE_CONFIG = {"block_m": 16,
               "gate_up": {"block_n": 32, "block_k": 64, "group_m": 2, "num_warps": 4, "num_stages": 2},
               "down": {"block_n": 64, "block_k": 32, "group_m": 2, "num_warps": 4, "num_stages": 2}}


def _lora_config(block_m, split_k=1, block_n=64):
    launch = {"group_m": 2, "num_warps": 4, "num_stages": 2}
    return {"block_m": block_m, "split_k": split_k, "shrink": launch,
            "gate_up": {"block_n": block_n, **launch}, "down": {"block_n": block_n, **launch}}


PAIR, GROUP, SMALL = _lora_config(1, split_k=2), _lora_config(16), _lora_config(4, split_k=2)
MODES = {"pair": PAIR, "group": GROUP, "small": SMALL}


def _model(hidden=H, inter=I, experts=E, top_k=K, layers=2):
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_heads=2, num_kv_heads=1, head_dim=32,
                       num_experts=experts, top_k=top_k, expert_intermediate_size=inter, dtype="float32")


def _specs(kind: str, rank: int):
    """One adapter's targets per layer; ``kind`` picks the expert targets of layer 1."""
    attention = TargetSpec("q_proj", (4,))
    fused = TargetSpec("experts.gate_up", (rank,))
    split = TargetSpec("experts.gate_up", (rank, max(rank // 2, 1)))
    down = TargetSpec("experts.down", (2 * rank,))
    gate_only = TargetSpec("experts.gate_up", (rank, 0))  # a zero-rank slice: up was not trained
    up_only = TargetSpec("experts.gate_up", (0, rank))
    expert = {"fused": (fused, down), "split": (split, down), "gate_only": (gate_only,),
              "up_only": (up_only, down), "down_only": (down,), "attention_only": ()}[kind]
    return [(attention, fused, down), (attention,) + expert]


# slot -> adapter kind and rank; None = empty slot.  Mixed ranks, both gate/up formats, zero-rank slices.
SLOTS = [("fused", 8), ("split", 4), None, ("attention_only", 4), ("gate_only", 4), ("down_only", 8)]


@torch.no_grad()
def _pool(model, slots, dtype, page_elems, seed=0, device="cpu", std=0.1):
    """Pack every slot's adapter at shuffled page ids of a noisy pool; return layouts, weights, pool, page table."""
    g = torch.Generator().manual_seed(seed)
    layouts = [build_layout(model, _specs(*s)) if s else None for s in slots]
    weights = [random_lora_weights(lay, g, std=std) if lay else None for lay in layouts]
    pages = [lay.num_pages(page_elems) if lay else 0 for lay in layouts]
    total = sum(pages) + 7
    pool = torch.randn(model.num_layers, total, page_elems, generator=g).to(dtype)
    order = torch.randperm(total, generator=g).tolist()
    table = torch.full((len(slots), max(pages)), total - 1, dtype=torch.int32)
    for s, lay in enumerate(layouts):
        if lay is not None:
            ids = [order.pop() for _ in range(pages[s])]
            pool[:, ids] = pack_adapter(lay, weights[s], page_elems, dtype)
            table[s, : pages[s]] = torch.tensor(ids, dtype=torch.int32)
    return layouts, weights, pool.to(device), table.to(device)


def _mix(name: str, num_tokens: int, num_slots: int, g: torch.Generator) -> torch.Tensor:
    """Adapter slot of each token (-1 = none) for a popularity mix."""
    if name == "identical":
        slots = torch.zeros(num_tokens, dtype=torch.long)
    elif name == "distinct":
        slots = torch.arange(num_tokens) % num_slots
    elif name == "none":
        slots = torch.full((num_tokens,), -1)
    else:
        p = {"uniform": torch.ones(num_slots + 1),
             "zipf": 1.0 / torch.arange(1, num_slots + 2),
             "skewed": torch.tensor([0.05, 0.05, 0.9] + [0.05] * (num_slots - 2))}[name]
        slots = torch.multinomial(p, num_tokens, replacement=True, generator=g) - 1
    return slots.int()


def _case(num_tokens, dtype, mix="uniform", page_elems=128, seed=0, slots=SLOTS, hidden=H, inter=I):
    model = _model(hidden=hidden, inter=inter)
    layouts, weights, pool, table = _pool(model, slots, dtype, page_elems, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w_gate_up = (torch.randn(E, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w_down = (torch.randn(E, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    topk_weights, topk_ids = route_topk_ref(torch.randn(num_tokens, E, generator=g), K, True)
    lora = MoeLora(pool[LAYER].contiguous(), table, _mix(mix, num_tokens, len(slots), g),
                   moe_lora_meta(layouts, LAYER))
    return {"x": x, "w_gate_up": w_gate_up, "w_down": w_down, "topk_weights": topk_weights,
            "topk_ids": topk_ids, "lora": lora, "layouts": layouts, "weights": weights}


def _loop_moe(c, dtype):
    """Per token and expert, float32, from the unpacked matrices (no pool, no page table)."""
    x, slots = c["x"].float(), c["lora"].token_slots.tolist()
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(K):
            e, s = int(c["topk_ids"][t, j]), slots[t]
            h = c["w_gate_up"][e].float() @ x[t]
            targets = c["layouts"][s].layers[LAYER].targets if s >= 0 and c["layouts"][s] else {}
            mats = c["weights"][s] if s >= 0 else None
            if ("experts.gate_up", e) in targets:
                entry, m = targets[("experts.gate_up", e)], mats[(LAYER, "experts.gate_up", e)]
                z = m.a.to(dtype).float() @ x[t]
                for piece, b in zip(entry.slices, m.b):
                    h[piece.col: piece.col + piece.b.cols] += z[piece.a_row: piece.a_row + piece.rank] @ \
                        b.to(dtype).float()
            inter = h.shape[0] // 2
            act = F.silu(h[:inter]) * h[inter:]
            y = c["w_down"][e].float() @ act
            if ("experts.down", e) in targets:
                m = mats[(LAYER, "experts.down", e)]
                y += (m.a.to(dtype).float() @ act) @ m.b[0].to(dtype).float()
            out[t] += float(c["topk_weights"][t, j]) * y
    return out


def _run(fn, c, lora_config):
    return fn(c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"], c["lora"],
              BASE_CONFIG, lora_config)


def _close(got, want, dtype):
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# --- metadata -------------------------------------------------------------------------------------


def test_meta_matches_layout():
    model = _model()
    layouts = [build_layout(model, _specs(*s)) if s else None for s in SLOTS]
    meta = moe_lora_meta(layouts, LAYER)
    rows = meta.table.tolist()
    assert meta.slot_flags.tolist() == [1, 1, 0, 0, 1, 1]
    assert (meta.hidden, meta.inter, meta.num_experts, meta.num_lora_slots) == (H, I, E, 4)
    assert (meta.max_gate_up_rows, meta.max_gate_up_rank, meta.max_down_rank) == (8, 8, 16)
    for slot in (0, 1, 4, 5):
        layer = layouts[slot].layers[LAYER]
        f = dict(zip(_field_names(), rows[slot]))
        for e in (0, E - 1):
            start = f["expert_base"] + e * f["expert_stride"]
            gate_up = layer.targets.get(("experts.gate_up", e))
            if gate_up is None:
                assert f["gu_rows"] == 0 and f["s0_rank"] == 0
            else:
                assert (start + f["gu_a"], f["gu_rows"], f["gu_slices"]) == (
                    gate_up.a.offset, gate_up.a.rows, len(gate_up.slices))
                for j, piece in enumerate(gate_up.slices):
                    assert [f[f"s{j}_{n}"] for n in ("a_row", "rank", "col", "ncols")] == [
                        piece.a_row, piece.rank, piece.col, piece.b.cols]
                    assert start + f[f"s{j}_b"] == piece.b.offset
            down = layer.targets.get(("experts.down", e))
            if down is None:
                assert f["down_rank"] == 0
            else:
                assert (start + f["down_a"], f["down_rank"], start + f["down_b"]) == (
                    down.a.offset, down.a.rows, down.slices[0].b.offset)
    split = dict(zip(_field_names(), rows[1]))
    assert (split["s1_a_row"], split["s1_col"], split["s1_ncols"]) == (4, I, I)  # up reads A rows after gate's
    assert moe_lora_meta(layouts, 0).slot_flags.tolist() == [1, 1, 0, 1, 1, 1]


def _field_names():
    from unipage.kernels.moe_align import FIELDS
    return FIELDS


# --- references -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", ["identical", "distinct", "uniform", "zipf", "skewed"])
def test_reference_matches_per_token_loop(mix):
    c = _case(40, torch.float32, mix, seed=3)
    _close(_run(fused_experts_ref, c, GROUP), _loop_moe(c, torch.float32), torch.float32)


def test_reference_lora_changes_the_output():
    c = _case(40, torch.float32, "uniform")
    with_lora = _run(fused_experts_ref, c, GROUP)
    base = fused_experts_ref(c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"])
    has = lora_pairs(c["lora"].token_slots, c["lora"].meta.slot_flags, K).view(-1, K).any(1)
    assert has.any() and (~has).any()
    assert ((with_lora - base).abs().amax(1) > 1e-2)[has].all()
    assert torch.equal(with_lora[~has], base[~has])


# --- Triton vs reference --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mode, num_tokens", [("pair", 1), ("pair", 7), ("group", 7), ("group", 40), ("small", 1),
                                              ("small", 40)])
def test_fused_experts_with_lora_matches_reference(mode, num_tokens, dtype):
    c = _case(num_tokens, dtype, "uniform", seed=num_tokens)
    config = MODES[mode]
    _close(_run(fused_experts, c, config), _run(fused_experts_ref, c, config), dtype)


@pytest.mark.parametrize("mix", ["identical", "distinct", "zipf", "skewed", "none"])
def test_mixes_match_reference(mix):
    c = _case(40, torch.float16, mix, seed=11)
    _close(_run(fused_experts, c, GROUP), _run(fused_experts_ref, c, GROUP), torch.float16)


def test_pair_mode_metadata_read_through_the_slot(monkeypatch):
    """Tables above `GATHER_SLOTS` rows: a pair-mode program reads its slot's metadata through the
    slot, as group mode does (threshold lowered so a small table takes that path)."""
    from unipage.kernels import fused_moe_lora as fl
    from unipage.kernels import moe_lora_plan
    monkeypatch.setattr(moe_lora_plan, "GATHER_SLOTS", 0)
    launched = []
    real = fl.launch

    def spy(kernel, grid, *args, **kwargs):
        launched.append(kwargs.get("S_PAD"))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(fl, "launch", spy)
    c = _case(40, torch.float16, "zipf", seed=13)
    _close(_run(fused_experts, c, PAIR), _run(fused_experts_ref, c, PAIR), torch.float16)
    assert launched and all(pad == 0 for pad in launched)  # every LoRA kernel read through the slot


@pytest.mark.parametrize("inter, block_n", [(48, 64), (96, 64), (96, 128)])
def test_gate_up_tiles_of_several_runs(inter, block_n):
    """I = 48: runs of 16 (the up half starts 48 in), four to a 64-wide tile, the last one past the
    end; I = 96: runs of 32, two or four to a tile that ends past the end (EVEN_N off).  Fused,
    split, gate-only and up-only gate/up slots."""
    c = _case(23, torch.float32, "uniform", seed=6, inter=inter)
    for config in (_lora_config(1, split_k=2, block_n=block_n), _lora_config(16, block_n=block_n),
                   _lora_config(4, block_n=block_n)):
        _close(_run(fused_experts, c, config), _loop_moe(c, torch.float32), torch.float32)


@pytest.mark.parametrize("page_elems", [64, 1024])
def test_page_sizes_split_k_and_ragged_hidden(page_elems):
    """H = 96: two 64-runs per A row (split-K of 2), the second half masked."""
    c = _case(7, torch.float32, "uniform", page_elems=page_elems, seed=5, hidden=96)
    for config in (_lora_config(1, split_k=2, block_n=128), _lora_config(16, split_k=2, block_n=64)):
        _close(_run(fused_experts, c, config), _loop_moe(c, torch.float32), torch.float32)


@pytest.mark.parametrize("hidden, split_k", [(320, 1), (200, 2)])
def test_pair_mode_splits_of_several_runs(hidden, split_k):
    """A pair-mode shrink program loads its whole K split at once: five 64-runs in one split (H = 320), and
    two splits of two runs with the last one ragged (H = 200)."""
    c = _case(5, torch.float32, "uniform", seed=8, hidden=hidden)
    _close(_run(fused_experts, c, _lora_config(1, split_k=split_k)), _loop_moe(c, torch.float32), torch.float32)


@pytest.mark.parametrize("hidden, split_k, mix, dtype", [(64, 1, "uniform", torch.float32),
                                                          (320, 1, "zipf", torch.float32),
                                                          (200, 2, "skewed", torch.float16)])
def test_group_mode_whole_k_shrink(monkeypatch, hidden, split_k, mix, dtype):
    """Config ``shrink.whole_k``: a group-mode shrink loads its split whole (x rows and A at once, then one
    dot) instead of walking it one 64-run at a time: one run, five runs, and two ragged splits, with
    padded tiles (rows of no pair) and tokens without adapter."""
    import unipage.kernels.fused_moe_lora as module

    seen, real = [], module.launch

    def spy(kernel, grid, *args, **kwargs):
        if kernel is module._moe_shrink_kernel:
            seen.append(kwargs["WHOLE_K"])
        real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch", spy)
    c = _case(23, dtype, mix, seed=9, hidden=hidden)
    config = _lora_config(16, split_k=split_k)
    config["shrink"] = {**config["shrink"], "whole_k": True}
    whole = _run(fused_experts, c, config)
    _close(whole, _loop_moe(c, dtype), dtype)
    _close(whole, _run(fused_experts, c, _lora_config(16, split_k=split_k)), dtype)
    assert seen == [True, False]  # the flag reached the kernel, and only where set


def test_stage_register_cap(monkeypatch):
    """A stage's ``"maxnreg"`` reaches its launch as a launch option, and only that stage's (the interpreter
    ignores the cap; `launch.check_binding` accepts it)."""
    import unipage.kernels.fused_moe_lora as module

    seen, real = {}, module.launch

    def spy(kernel, grid, *args, **kwargs):
        seen[kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__] = kwargs.get("maxnreg")
        real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch", spy)
    c = _case(40, torch.float32, "zipf", seed=9)
    config = {**GROUP, "gate_up": {**GROUP["gate_up"], "maxnreg": 128}, "down": {**GROUP["down"], "maxnreg": 96}}
    _close(_run(fused_experts, c, config), _loop_moe(c, torch.float32), torch.float32)
    assert seen == {"_moe_shrink_kernel": None, "_expand_gate_up_kernel": 128, "_expand_down_kernel": 96}


def test_active_slots_rank_the_groups():
    """``active_slots``: tokens of slots 0 and 4 of 6 under a bound of 2 (or 5) are aligned by their slots'
    ranks (same output, fewer tiles); a bound at the slots (6), 0 or none changes nothing; on CPU a bound the
    tokens break is refused."""
    c = _case(40, torch.float32, "uniform", seed=12)
    lora = dataclasses.replace(c["lora"], token_slots=torch.tensor([0, 4, -1], dtype=torch.int32)[torch.arange(40) % 3])
    c = {**c, "lora": lora}
    want = _run(fused_experts_ref, c, GROUP)
    for bound in (2, 5, 6, 0, None):
        bounded = {**c, "lora": dataclasses.replace(lora, active_slots=bound)}
        _close(_run(fused_experts, bounded, GROUP), want, torch.float32)
        _close(_run(fused_experts_ref, bounded, GROUP), want, torch.float32)
        if bound in (2, 5):  # the ranks made once for a step's layers
            ranks = slot_ranks(lora.token_slots, 6, bound)
            _close(_run(fused_experts, {**c, "lora": dataclasses.replace(lora, active_slots=bound, ranks=ranks)},
                        GROUP), want, torch.float32)
    tiles = {b: plan_moe_lora(dataclasses.replace(lora, active_slots=b), c["topk_ids"], GROUP).align.max_blocks
             for b in (2, None)}
    assert tiles[2] < tiles[None]
    for bad, match in ((1, "2 distinct adapter slots"), (-1, "active_slots"), (2.0, "active_slots")):
        with pytest.raises(ValueError, match=match):
            plan_moe_lora(dataclasses.replace(lora, active_slots=bad), c["topk_ids"], GROUP)


def test_without_lora_tokens_or_layers_equals_base():
    c = _case(7, torch.float32, "none")
    base = fused_experts(c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"], None, BASE_CONFIG)
    assert torch.equal(_run(fused_experts, c, GROUP), base)
    c = _case(7, torch.float32, "uniform", slots=[("attention_only", 4), None])
    assert not c["lora"].meta.any_lora
    assert torch.equal(_run(fused_experts, c, GROUP), base)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_phases_write_only_lora_pairs(mode):
    """``act`` starts as NaN: LoRA pairs must be written, others left alone; ``y`` likewise."""
    dtype, config = torch.float32, MODES[mode]
    c = _case(40, dtype, "zipf", seed=2)
    lora, ids, num_pairs = c["lora"], c["topk_ids"], c["topk_ids"].numel()
    has = lora_pairs(lora.token_slots, lora.meta.slot_flags, K)
    raw = torch.full((num_pairs, 2 * I), float("nan"))
    moe_gate_up_ref(c["x"], c["w_gate_up"], ids, moe_align_ref(ids, E, 16), torch.empty(num_pairs, I), raw,
                    lora.token_slots, lora.meta.slot_flags)
    y0 = torch.randn(num_pairs, H)
    results = []
    for plan_fn, gate_up, down in ((plan_moe_lora, moe_lora_gate_up, moe_lora_down),
                                   (plan_moe_lora_ref, moe_lora_gate_up_ref, moe_lora_down_ref)):
        plan = plan_fn(lora, ids, config)
        plan.gate_up_z.fill_(float("nan"))  # scratch too: the kernels must write what they read
        plan.down_z.fill_(float("nan"))
        act, y = torch.full((num_pairs, I), float("nan")), y0.clone()
        gate_up(plan, c["x"], raw, act)
        down(plan, act, y, c["topk_weights"])
        results.append((act, y))
    (act, y), (act_ref, y_ref) = results
    assert has.any() and (~has).any()
    assert act[~has].isnan().all() and not act[has].isnan().any()
    assert torch.equal(y[~has], y0[~has])
    _close(act[has], act_ref[has], dtype)
    _close(y, y_ref, dtype)


def test_ranks_above_sixteen_and_up_only():
    slots = [("split", 24), ("fused", 16), ("up_only", 8)]
    c = _case(7, torch.float32, "uniform", seed=9, slots=slots)
    assert c["lora"].meta.max_gate_up_rows == 36
    for config in (GROUP, SMALL):
        _close(_run(fused_experts, c, config), _loop_moe(c, torch.float32), torch.float32)


def test_small_tiles_in_every_mix():
    """Tiles of 2 and 8 pairs (broadcast-reduce math, aligned by group), and of 4 with ``whole_k`` set (which
    small tiles ignore: they walk K), against the per-token loop: groups of one pair and of many, tokens
    without adapter."""
    for mix in ("identical", "distinct", "skewed"):
        c = _case(40, torch.float32, mix, seed=12)
        for config in (_lora_config(2), _lora_config(8, split_k=2), {**SMALL, "shrink": {**SMALL["shrink"],
                                                                                         "whole_k": True}}):
            _close(_run(fused_experts, c, config), _loop_moe(c, torch.float32), torch.float32)


def test_overlap_is_ignored_off_cuda(monkeypatch):
    """Config "overlap" is CUDA-only: on CPU tensors the single-stream path runs and no stream is made
    (this machine may have no CUDA at all)."""
    from unipage.kernels import moe_lora_side

    monkeypatch.setattr(moe_lora_side, "SIDE_STREAMS", {})
    c = _case(9, torch.float32, "zipf", seed=27)
    _close(_run(fused_experts, c, {**GROUP, "overlap": True}), _loop_moe(c, torch.float32), torch.float32)
    assert not moe_lora_side.SIDE_STREAMS


@pytest.mark.parametrize("mode", sorted(MODES))
def test_gate_up_after_its_shrink_ran_apart(mode):
    """``moe_lora_gate_up(..., shrunk=True)`` (the overlap's: the shrink launched before, on the side stream)
    launches the expand alone, reading ``raw`` after its PDL wait: the same ``act`` and ``down_z`` as the
    two launches together; and nothing right where the shrink did not run."""
    c = _case(40, torch.float32, "zipf", seed=28)
    lora, ids, num_pairs = c["lora"], c["topk_ids"], c["topk_ids"].numel()
    g = torch.Generator().manual_seed(5)
    raw = torch.randn(num_pairs, 2 * I, generator=g)
    outs = []
    for apart in (False, True, None):  # None: shrunk=True without the shrink
        plan = plan_moe_lora(lora, ids, MODES[mode])
        plan.gate_up_z.fill_(float("nan"))
        act = torch.zeros(num_pairs, I)
        if apart:
            moe_lora_shrink(plan, c["x"])
        moe_lora_gate_up(plan, c["x"], raw, act, shrunk=apart is not False)
        outs.append((act, plan.down_z))
    has = lora_pairs(lora.token_slots, lora.meta.slot_flags, K)
    (act, down_z), (act_apart, down_z_apart), (act_none, _) = outs
    assert torch.equal(act, act_apart) and torch.equal(down_z[has], down_z_apart[has])
    assert act_none[has].isnan().any()


def test_block_m_must_be_a_power_of_two():
    c = _case(7, torch.float32, "uniform")
    for block_m in (0, 3, 12, 2.0):
        with pytest.raises(ValueError, match="power of two"):
            _run(fused_experts, c, {**GROUP, "block_m": block_m})


# --- errors ---------------------------------------------------------------------------------------


def test_launchers_reject_bad_arguments():
    c = _case(7, torch.float32)
    lora, ids = c["lora"], c["topk_ids"]
    bad = {
        "pool": MoeLora(lora.pool.half(), lora.page_table, lora.token_slots, lora.meta),
        "page_table": MoeLora(lora.pool, lora.page_table.long(), lora.token_slots, lora.meta),
        "token_slots": MoeLora(lora.pool, lora.page_table, lora.token_slots[:-1], lora.meta),
    }
    with pytest.raises(ValueError, match="page_table"):
        plan_moe_lora(bad["page_table"], ids, GROUP)
    with pytest.raises(ValueError, match="token_slots"):
        plan_moe_lora(bad["token_slots"], ids, GROUP)
    with pytest.raises(ValueError, match="pool"):
        plan_moe_lora(MoeLora(lora.pool[:, :48].contiguous(), lora.page_table, lora.token_slots, lora.meta), ids)
    plan = plan_moe_lora(bad["pool"], ids, GROUP)
    num_pairs = ids.numel()
    with pytest.raises(ValueError, match="x must be"):
        moe_lora_gate_up(plan, c["x"], torch.empty(num_pairs, 2 * I), torch.empty(num_pairs, I))
    plan = plan_moe_lora(lora, ids, GROUP)
    with pytest.raises(ValueError, match="raw"):
        moe_lora_gate_up(plan, c["x"], torch.empty(num_pairs, I), torch.empty(num_pairs, I))
    with pytest.raises(ValueError, match="topk_weights"):
        moe_lora_down(plan, torch.empty(num_pairs, I), torch.empty(num_pairs, H), c["topk_weights"].double())
    with pytest.raises(ValueError, match="experts"):
        fused_experts(c["x"], c["w_gate_up"][:4], c["w_down"][:4], c["topk_weights"], ids % 4, lora)


def test_triton_needs_intermediate_multiple_of_16():
    model = _model(inter=24)
    layouts, _, pool, table = _pool(model, [("fused", 4)], torch.float32, 128)
    lora = MoeLora(pool[LAYER].contiguous(), table, torch.zeros(3, dtype=torch.int32),
                   moe_lora_meta(layouts, LAYER))
    ids = torch.zeros(3, K, dtype=torch.int32)
    plan = plan_moe_lora_ref(lora, ids, GROUP)
    with pytest.raises(ValueError, match="I % 16"):
        moe_lora_gate_up(plan, torch.zeros(3, H), torch.zeros(6, 48), torch.zeros(6, 24))


# --- GPU: real layers in bf16 ---------------------------------------------------------------------
