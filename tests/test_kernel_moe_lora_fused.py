"""Expert LoRA fused into the base MoE GEMMs (`unipage.kernels.moe_lora_fused`, launch config
``"fused": true``): against the separate-pass reference (`fused_experts_ref`) and the per-token
loop, under the Triton interpreter at tiny shapes; `-m gpu` in bf16 at real layers."""

import dataclasses
import importlib

import pytest
import test_kernel_fused_moe_lora as lt
import test_kernel_fused_moe_lora_gpu as gpu
import torch
from test_kernel_moe_gptoss import OAI, _biases
from unipage.kernels import moe_lora_fused
from unipage.kernels.fused_moe import (
    fused_experts,
    fused_experts_ref,
    moe_down,
    moe_gate_up,
)
from unipage.kernels.fused_moe_lora import (
    lora_pairs,
    moe_lora_gate_up,
    moe_lora_shrink,
    plan_moe_lora,
)
from unipage.kernels.common import next_pow2
from unipage.kernels.moe_align import moe_align_ref


def _fused(config: dict, lora_k: int = 64, down_shrink: str = "epilogue", steps: int = 2) -> dict:
    return {**config, "fused": True, "lora_k": lora_k, "down_shrink": down_shrink, "lora_steps": steps}


FUSED_GROUP, FUSED_PAIR = _fused(lt.GROUP), _fused(lt.PAIR)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mode, num_tokens", [("pair", 1), ("pair", 7), ("group", 7), ("group", 40)])
def test_fused_matches_reference(mode, num_tokens, dtype):
    c = lt._case(num_tokens, dtype, "uniform", seed=num_tokens)
    config = FUSED_PAIR if mode == "pair" else FUSED_GROUP
    lt._close(lt._run(fused_experts, c, config), lt._run(fused_experts_ref, c, lt.GROUP), dtype)


@pytest.mark.parametrize("mix", ["identical", "distinct", "zipf", "skewed", "none"])
@pytest.mark.parametrize("lora_k", [16, 32, 128])  # rank-8 gate/up rows: two slots per extra K step, four, sixteen
@pytest.mark.parametrize("steps", [1, 3])  # unrolled steps: the rest of a tile's slot ids take the loop
def test_mixes_and_slots_per_step(mix, lora_k, steps):
    c = lt._case(40, torch.float16, mix, seed=11)
    lt._close(lt._run(fused_experts, c, _fused(lt.GROUP, lora_k, steps=steps)),
              lt._run(fused_experts_ref, c, lt.GROUP), torch.float16)


@pytest.mark.parametrize("lora_k, steps", [(16, 1), (32, 0)])
def test_sparse_slot_ids(lora_k, steps):
    """Adapters at slots 0, 21 and 42 with empty slots between (many resident adapters): the loop after the
    unrolled steps goes from one slot a pair has to the next."""
    slots = [("fused", 8)] + [None] * 20 + [("split", 4)] + [None] * 20 + [("fused", 8)]
    c = lt._case(40, torch.float32, "distinct", seed=15, slots=slots)
    lt._close(lt._run(fused_experts, c, _fused(lt.GROUP, lora_k, steps=steps)), lt._loop_moe(c, torch.float32),
              torch.float32)


@pytest.mark.parametrize("lora_k, steps", [(16, 1), (16, 2), (32, 0)])
@pytest.mark.parametrize("given", [False, True])
def test_slots_by_rank(lora_k, steps, given):
    """With a bound on the step's slots below the tables' rows the fused GEMMs take a tile's slots by rank
    among the step's (the plan's ranks: the engine's, or made by the plan): adapters at slots 3, 21, 30 and 42
    of 43 are ranks 0-3, two steps of two rank-8 slots (lora_k 16) or one (32), whatever the slot ids."""
    from unipage.kernels.moe_ranks import slot_ranks

    slots = [None] * 3 + [("fused", 8)] + [None] * 17 + [("split", 4)] + [None] * 8 + [("fused", 8)] \
        + [None] * 11 + [("down_only", 8)]
    c = lt._case(40, torch.float32, "distinct", seed=16, slots=slots)
    token_slots = torch.tensor([42, 3, -1, 30, 21, 42, 3])[torch.arange(40) % 7].int()  # tokens without adapter too
    ranks = slot_ranks(token_slots, len(slots), 4) if given else None
    c = {**c, "lora": dataclasses.replace(c["lora"], token_slots=token_slots, active_slots=4, ranks=ranks)}
    plan = plan_moe_lora(c["lora"], c["topk_ids"], _fused(lt.GROUP, lora_k, steps=steps))
    assert plan.ranks is not None and moe_lora_fused.gemm_args(plan, True, 64)[1]["RANKED"]
    lt._close(lt._run(fused_experts, c, _fused(lt.GROUP, lora_k, steps=steps)), lt._loop_moe(c, torch.float32),
              torch.float32)


@pytest.mark.parametrize("config", ["fused", "separate pair mode"])
def test_a_broken_bound_drops_the_lora_of_the_slots_ranked_past_it(config, monkeypatch):
    """A bound below the step's distinct slots (a GPU caller's mistake: on CPU tensors `_check_active` refuses
    it) drops the LoRA of the slots ranked past it in the fused GEMMs; pair mode's separate pass takes every
    slot.  (Group mode's separate pass does not: its base GEMM leaves those pairs' act to a LoRA pass whose
    alignment drops them.)"""
    from unipage.kernels import moe_lora_plan

    monkeypatch.setattr(moe_lora_plan, "_check_active", lambda lora: None)
    slots = [None, ("fused", 8), None, ("split", 4), ("fused", 8), None, ("down_only", 8), ("fused", 4)]
    c = lt._case(40, torch.float32, "distinct", seed=17, slots=slots)
    token_slots = torch.tensor([7, 1, 3, -1, 4, 6])[torch.arange(40) % 6].int()  # ranks 0-4 of slots 1-7
    bounded = {**c, "lora": dataclasses.replace(c["lora"], token_slots=token_slots, active_slots=4)}
    got = lt._run(fused_experts, bounded, {"fused": FUSED_GROUP, "separate pair mode": lt.PAIR}[config])
    kept = token_slots if config == "separate pair mode" else torch.where(token_slots == 7, -1, token_slots).int()
    want = lt._loop_moe({**c, "lora": dataclasses.replace(c["lora"], token_slots=kept)}, torch.float32)
    lt._close(got, want, torch.float32)


SMALL_RANKS = {"rank 1 beside 32": [("fused", 1), ("split", 32)], "gate/up 32, down 1": [("gate_only", 32),
               ("down_only", 1)], "no down": [("gate_only", 16)]}


@pytest.mark.parametrize("slots", sorted(SMALL_RANKS))
@pytest.mark.parametrize("down_shrink", ["epilogue", "pass"])
def test_small_and_unequal_ranks(slots, down_shrink, monkeypatch):
    """Steps of rank-1 rows, or gate/up and down ranks far apart: every step's dots span >= 16 (the interpreter
    does not enforce the tensor-core minimum, so the widths are checked here), the gate/up step is not widened
    by the down rank, and the result matches the per-token loop."""
    widths = []
    real = moe_lora_fused.gemm_args

    def spy(plan, gated, block_n):
        args, c = real(plan, gated, block_n)
        widths.append((gated, c["CHUNK_SLOTS"] * (c["RK"] if gated else c["RD"]), c["DOWN_SLOTS"] * c["RD"]))
        return args, c

    monkeypatch.setattr(moe_lora_fused, "gemm_args", spy)
    c = lt._case(40, torch.float32, "distinct", seed=3, slots=SMALL_RANKS[slots])
    lt._close(lt._run(fused_experts, c, _fused(lt.GROUP, 32, down_shrink, 1)), lt._loop_moe(c, torch.float32),
              torch.float32)
    assert widths and all(step >= 16 and down >= 16 for _, step, down in widths)
    gate_up = next(step for gated, step, _ in widths if gated)
    assert gate_up == max(32, next_pow2(max(rank for _, rank in SMALL_RANKS[slots])))


def test_bad_fused_config_is_refused():
    c = lt._case(7, torch.float32, "uniform", seed=3)
    for bad in ({"lora_steps": -1}, {"lora_steps": 9}, {"lora_steps": True}, {"chunks": "range"}, {"lora_k": 8},
                {"lora_k": 48}, {"lora_k": 32.0}):
        with pytest.raises(ValueError, match="lora_steps|chunks|lora_k"):
            lt._run(fused_experts, c, {**FUSED_GROUP, **bad})


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mode, mix", [("pair", "uniform"), ("group", "zipf"), ("group", "distinct")])
def test_down_shrink_as_a_pass(mode, mix, dtype):
    """Config ``"down_shrink": "pass"``: the down shrink is a grouped pass over act between the GEMMs."""
    c = lt._case(40, dtype, mix, seed=14)
    config = _fused(lt.PAIR if mode == "pair" else lt.GROUP, down_shrink="pass")
    lt._close(lt._run(fused_experts, c, config), lt._run(fused_experts_ref, c, lt.GROUP), dtype)
    with pytest.raises(ValueError, match="down_shrink"):
        lt._run(fused_experts, c, {**config, "down_shrink": "later"})


def test_fused_is_the_path_taken(monkeypatch):
    """With ``"fused"`` the separate LoRA kernels never run (and without it they do)."""
    fused_moe = importlib.import_module("unipage.kernels.fused_moe")  # the module (the package exports a function)

    def fail(*args, **kwargs):
        raise AssertionError("separate LoRA pass called")

    monkeypatch.setattr(fused_moe._TRITON, "lora_gate_up", fail)
    monkeypatch.setattr(fused_moe._TRITON, "lora_down", fail)
    c = lt._case(7, torch.float32, "uniform", seed=4)
    lt._run(fused_experts, c, FUSED_GROUP)
    with pytest.raises(AssertionError, match="separate"):
        lt._run(fused_experts, c, lt.GROUP)


@pytest.mark.parametrize("inter, block_n", [(48, 64), (96, 64), (96, 128)])
def test_runs_and_ragged_column_tiles(inter, block_n):
    """I = 48 / 96: B rows read as runs of 16 / 32 (the up half starts I in); base tiles past I."""
    c = lt._case(23, torch.float32, "uniform", seed=6, inter=inter)
    base = {**lt.BASE_CONFIG, "gate_up": {**lt.BASE_CONFIG["gate_up"], "block_n": block_n}}
    for config in (FUSED_PAIR, FUSED_GROUP):
        got = fused_experts(c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"], c["lora"],
                            base, config)
        lt._close(got, lt._loop_moe(c, torch.float32), torch.float32)


@pytest.mark.parametrize("page_elems", [64, 1024])
def test_page_sizes_split_k_and_ragged_hidden(page_elems):
    """H = 96: split-K partials of z summed in the GEMM; down B rows end mid-tile."""
    c = lt._case(7, torch.float32, "uniform", page_elems=page_elems, seed=5, hidden=96)
    for config in (_fused(lt._lora_config(1, split_k=2)), _fused(lt._lora_config(16, split_k=2), 32),
                   _fused(lt._lora_config(16, split_k=2), 32, "pass")):
        lt._close(lt._run(fused_experts, c, config), lt._loop_moe(c, torch.float32), torch.float32)


def test_ranks_above_sixteen_and_up_only():
    c = lt._case(7, torch.float32, "uniform", seed=9, slots=[("split", 24), ("fused", 16), ("up_only", 8)])
    for config in (_fused(lt.GROUP, 16), _fused(lt.GROUP, 64), _fused(lt.PAIR, 32, "pass")):
        lt._close(lt._run(fused_experts, c, config), lt._loop_moe(c, torch.float32), torch.float32)


def test_without_lora_tokens_equals_base():
    c = lt._case(7, torch.float32, "none")
    base = fused_experts(c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"], None,
                         lt.BASE_CONFIG)
    assert torch.equal(lt._run(fused_experts, c, FUSED_GROUP), base)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_biases_and_clamped_swiglu(dtype):
    c = lt._case(40, dtype, "zipf", seed=12)
    b_gu, b_d = _biases(dtype, lt.E, lt.I, lt.H)
    args = (c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"], c["lora"], lt.BASE_CONFIG)
    options = {"gate_up_bias": b_gu, "down_bias": b_d, "activation": OAI}
    lt._close(fused_experts(*args, FUSED_GROUP, **options), fused_experts_ref(*args, lt.GROUP, **options), dtype)


@pytest.mark.parametrize("mode", ["pair", "group"])
def test_stages_write_every_row_and_the_down_shrink(mode):
    """Poisoned ``act``/``y``/scratch: the fused gate/up GEMM writes every pair's ``act`` and, for LoRA
    pairs, the same ``down_z`` as the separate pass; the fused down GEMM writes every ``y`` row."""
    dtype, config = torch.float32, (FUSED_PAIR if mode == "pair" else FUSED_GROUP)
    c = lt._case(40, dtype, "zipf", seed=2)
    lora, ids, num_pairs = c["lora"], c["topk_ids"], c["topk_ids"].numel()
    has = lora_pairs(lora.token_slots, lora.meta.slot_flags, lt.K)
    align = moe_align_ref(ids, lt.E, lt.BASE_CONFIG["block_m"])
    plan = plan_moe_lora(lora, ids, config)
    plan.gate_up_z.fill_(float("nan"))
    plan.down_z.fill_(float("nan"))
    act = torch.full((num_pairs, lt.I), float("nan"))
    moe_lora_shrink(plan, c["x"])
    moe_gate_up(c["x"], c["w_gate_up"], ids, align, act, config=lt.BASE_CONFIG, lora_plan=plan)
    y = torch.full((num_pairs, lt.H), float("nan"))
    moe_down(act, c["w_down"], ids, c["topk_weights"], align, y, lt.BASE_CONFIG, lora_plan=plan)
    assert not act.isnan().any() and not y.isnan().any()
    separate = plan_moe_lora(lora, ids, lt.GROUP)
    raw = torch.empty(num_pairs, 2 * lt.I)
    act_sep = torch.full((num_pairs, lt.I), float("nan"))
    moe_gate_up(c["x"], c["w_gate_up"], ids, align, act_sep, raw, lora.token_slots, lora.meta.slot_flags,
                lt.BASE_CONFIG)
    moe_lora_gate_up(separate, c["x"], raw, act_sep)
    lt._close(act, act_sep, dtype)
    rank = lora.meta.max_down_rank
    lt._close(plan.down_z[has, :rank], separate.down_z[has, :rank], dtype)


def test_raw_and_lora_plan_exclude_each_other():
    c = lt._case(3, torch.float32, "uniform")
    ids, num_pairs = c["topk_ids"], c["topk_ids"].numel()
    plan = plan_moe_lora(c["lora"], ids, FUSED_GROUP)
    with pytest.raises(ValueError, match="exclude"):
        moe_gate_up(c["x"], c["w_gate_up"], ids, moe_align_ref(ids, lt.E, 16), torch.empty(num_pairs, lt.I),
                    torch.empty(num_pairs, 2 * lt.I), c["lora"].token_slots, c["lora"].meta.slot_flags,
                    lt.BASE_CONFIG, lora_plan=plan)


def test_fused_mode_follows_the_config():
    c = lt._case(3, torch.float32, "uniform")

    def mode(**extra):
        return moe_lora_fused.fused_mode(plan_moe_lora(c["lora"], c["topk_ids"], {**lt.GROUP, **extra}))

    assert mode(fused=True) == "all" and mode(fused="down") == "down"
    assert mode() == "" and mode(fused=False) == "" and moe_lora_fused.fused_mode(None) == ""
    for bad in ("gate_up", 1, None):
        with pytest.raises(ValueError, match='"fused"'):
            mode(fused=bad)
    plan = plan_moe_lora(c["lora"], c["topk_ids"], {**lt.GROUP, "fused": True})
    assert not moe_lora_fused.down_shrink_in_epilogue(plan)  # the default: a pass between the GEMMs


def _fused_down(config: dict, lora_k: int = 64, steps: int = 2) -> dict:
    return {**config, "fused": "down", "lora_k": lora_k, "lora_steps": steps}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mode, mix, num_tokens", [("pair", "uniform", 1), ("pair", "zipf", 7),
                                                   ("group", "distinct", 40), ("group", "none", 7)])
def test_fused_down_only(mode, mix, num_tokens, dtype):
    """``"fused": "down"``: the separate gate/up pass leaves ``down_z``, the base down GEMM adds the delta."""
    c = lt._case(num_tokens, dtype, mix, seed=20 + num_tokens)
    config = _fused_down(lt.PAIR if mode == "pair" else lt.GROUP)
    lt._close(lt._run(fused_experts, c, config), lt._run(fused_experts_ref, c, lt.GROUP), dtype)


@pytest.mark.parametrize("lora_k, steps", [(16, 0), (32, 1), (128, 3)])
def test_fused_down_slots_per_step_and_sparse_slots(lora_k, steps):
    slots = [("fused", 8)] + [None] * 9 + [("split", 4)] + [None] * 9 + [("up_only", 8), ("fused", 16)]
    c = lt._case(40, torch.float32, "distinct", seed=16, slots=slots, hidden=96)
    lt._close(lt._run(fused_experts, c, _fused_down(lt._lora_config(16, split_k=2), lora_k, steps)),
              lt._loop_moe(c, torch.float32), torch.float32)


def test_fused_down_skips_only_the_separate_down(monkeypatch):
    fused_moe = importlib.import_module("unipage.kernels.fused_moe")

    def fail(*args, **kwargs):
        raise AssertionError("separate down called")

    monkeypatch.setattr(fused_moe._TRITON, "lora_down", fail)
    c = lt._case(7, torch.float32, "uniform", seed=4)
    lt._run(fused_experts, c, _fused_down(lt.GROUP))
    with pytest.raises(AssertionError, match="separate down"):
        lt._run(fused_experts, c, lt.GROUP)


def test_fused_min_tokens_bounds_the_steps_that_fuse(monkeypatch):
    """``"fused_min_tokens"``: a step of fewer tokens takes the separate gate/up pass (same output)."""
    fused_moe = importlib.import_module("unipage.kernels.fused_moe")
    separate = fused_moe._TRITON.lora_gate_up
    calls = []
    monkeypatch.setattr(fused_moe._TRITON, "lora_gate_up", lambda *a, **k: calls.append(1) or separate(*a, **k))
    c = lt._case(7, torch.float32, "uniform", seed=5)
    want = lt._run(fused_experts_ref, c, lt.GROUP)
    for least, separated in ((8, True), (7, False), (0, False)):
        calls.clear()
        config = {**FUSED_GROUP, "fused_min_tokens": least}
        lt._close(lt._run(fused_experts, c, config), want, torch.float32)
        assert bool(calls) == separated, least
        assert moe_lora_fused.config_mode(config, 7) == ("" if separated else "all")
    with pytest.raises(ValueError, match="fused_min_tokens"):
        lt._run(fused_experts, c, {**FUSED_GROUP, "fused_min_tokens": -1})


def test_fused_base_settings_reach_the_fused_gemms(monkeypatch):
    """``"fused_base"``: launch settings merged into the base config's stages for the fused GEMMs only (the
    gate/up GEMM's ``"maxnreg"`` reaches its launch, not under ``"fused": "down"``; the output is unchanged);
    bad values are refused."""
    fused_moe = importlib.import_module("unipage.kernels.fused_moe")
    seen, real = [], fused_moe.launch

    def spy(kernel, grid, *args, **kwargs):
        if kernel.fn.__name__ == "_moe_gemm_kernel":
            seen.append((kwargs["GATED"], kwargs["BLOCK_N"], kwargs.get("maxnreg")))
        real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(fused_moe, "launch", spy)
    c = lt._case(7, torch.float32, "uniform", seed=6)
    want = lt._run(fused_experts_ref, c, lt.GROUP)
    config = {**FUSED_GROUP, "fused_base": {"gate_up": {"maxnreg": 128}, "down": {"block_n": 32}}}
    lt._close(lt._run(fused_experts, c, config), want, torch.float32)
    assert seen == [(True, lt.BASE_CONFIG["gate_up"]["block_n"], 128), (False, 32, None)]
    seen.clear()
    gate_up_n, down_n = lt.BASE_CONFIG["gate_up"]["block_n"], lt.BASE_CONFIG["down"]["block_n"]
    lt._close(lt._run(fused_experts, c, {**config, "fused": "down"}), want, torch.float32)  # the down GEMM's alone
    assert seen == [(True, gate_up_n, None), (False, 32, None)]
    seen.clear()
    lt._run(fused_experts, c, {**config, "fused": False})  # the separate pass: the base config as it is
    assert seen == [(True, gate_up_n, None), (False, down_n, None)]
    for bad in ({"gate": {}}, {"gate_up": {"block_m": 32}}, {"down": 4}, [1]):
        with pytest.raises(ValueError, match="fused_base"):
            lt._run(fused_experts, c, {**FUSED_GROUP, "fused_base": bad})


# --- GPU: real layers in bf16 ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 2048])
@pytest.mark.parametrize("shape", sorted(gpu.GPU_SHAPES))
def test_gpu_fused_bf16(shape, num_tokens):
    from unipage.kernels.fused_moe_lora import MoeLora, lora_config

    x, w_gate_up, w_down, topk_weights, topk_ids, lora = gpu._gpu_case(shape, num_tokens)
    lora32 = MoeLora(lora.pool.float(), lora.page_table, lora.token_slots, lora.meta)
    want = fused_experts_ref(x.float(), w_gate_up.float(), w_down.float(), topk_weights, topk_ids, lora32)
    base = fused_experts_ref(x.float(), w_gate_up.float(), w_down.float(), topk_weights, topk_ids)
    assert ((want - base).norm() / base.norm()).item() > 0.1
    for mode in (True, "down"):
        config = {**lora_config(lora, topk_ids), "fused": mode}
        got = fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids, lora, lora_config=config)
        assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2, mode


@pytest.mark.gpu
def test_gpu_fused_compiles_once_across_token_counts():
    from unipage.kernels.fused_moe_lora import MoeLora
    from unipage.kernels.moe_align import launch_config

    fused_moe = importlib.import_module("unipage.kernels.fused_moe")

    config = {**launch_config("lora", "none", 1e9, "cpu"), "fused": True}
    x, w_gate_up, w_down, topk_weights, topk_ids, lora = gpu._gpu_case("qwen3-30b-a3b", 64)
    counts = []
    for num_tokens in (1, 2, 3, 5, 17, 64):
        part = MoeLora(lora.pool, lora.page_table, lora.token_slots[:num_tokens].contiguous(), lora.meta)
        fused_experts(x[:num_tokens], w_gate_up, w_down, topk_weights[:num_tokens].contiguous(),
                      topk_ids[:num_tokens].contiguous(), part, lt.BASE_CONFIG, config)
        counts.append(gpu._compiled(fused_moe._moe_gemm_kernel))
    assert counts[-1] == counts[0]


@pytest.mark.gpu
def test_gpu_tuned_entry_at_the_prefill_mix():
    """The tuned entry as shipped at 2,048 tokens of 4 adapters (on an H200: Qwen3's entry past load 22.6,
    which large steps of few adapters take: fused from 2,048 tokens, one step of four rank-8 slot ids, the
    down shrink in the epilogue)."""
    from unipage.kernels.fused_moe_lora import lora_config

    case = gpu._gpu_case("qwen3-30b-a3b", 2048, adapters=4)
    config = lora_config(case[-1], case[4])
    if torch.cuda.get_device_name() == "NVIDIA H200":
        assert moe_lora_fused.config_mode(config, 2048) == "all" and config["down_shrink"] == "epilogue"
    gpu._check_gpu(*case)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [256, 4096])
@pytest.mark.parametrize("shape", sorted(gpu.GPU_SHAPES))
def test_gpu_fused_by_rank_bf16(shape, num_tokens):
    """The fused GEMMs taking slots by rank (a bound of 5 below the tables' 8 rows, the step's ranks made once,
    as the engine does): 5 of 8 adapters at scattered slots, a mixed step's order (decodes round-robin over
    four, then the fifth's prompt) and tokens without an adapter."""
    from unipage.kernels.fused_moe_lora import MoeLora, lora_config
    from unipage.kernels.moe_ranks import slot_ranks

    x, w_gate_up, w_down, topk_weights, topk_ids, lora = gpu._gpu_case(shape, num_tokens)
    index = torch.arange(num_tokens, device="cuda")
    slots = torch.tensor([6, 1, 4, 7, 2, -1], device="cuda")
    token_slots = torch.where(index < num_tokens // 16, slots[index % 6], 2).int()
    ranks = slot_ranks(token_slots, 8, 5)
    case = dataclasses.replace(lora, token_slots=token_slots, active_slots=5, ranks=ranks)
    lora32 = MoeLora(lora.pool.float(), lora.page_table, token_slots, lora.meta)
    want = fused_experts_ref(x.float(), w_gate_up.float(), w_down.float(), topk_weights, topk_ids, lora32)
    config = {**lora_config(case, topk_ids), "fused": True, "fused_min_tokens": 0}
    got = fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids, case, lora_config=config)
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2
