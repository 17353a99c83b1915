"""GPU benchmark of the MoE kernels: the base fused MoE and the paged fused_moe_lora.

    python benchmarks/kernels_moe.py [--out FILE]            # the benchmark (JSON lines)
    python benchmarks/kernels_moe.py --tune [--tokens 1 256]  # tune launch configs, write
                                                             # kernels/configs/moe_<device>.json
    python benchmarks/kernels_moe.py --align                 # the alignment alone (base, 8 and 16 slots)
    python benchmarks/kernels_moe.py --split ['{"gate_up.num_warps": 1}' ...]  # each LoRA pass alone
    python benchmarks/kernels_moe.py --adapters 16 --rank 8 ...  # serve.py's setup (b) mix (with any mode)
    python benchmarks/kernels_moe.py --adapters 5 --active-slots 16 --slot-order mixed ...  # (b)'s mixed steps

Shapes: a GPT-OSS-20B layer (H 2880, I 2880, 32 experts, top-4, rank 32) and a
Qwen3-30B-A3B layer (H 2048, I 768, 128 experts, top-8, rank 16), bf16, 8 adapters
(fused gate/up format) in scattered pool pages, tokens round-robin over the
adapters, random routing.  Per row:

- ``base_us`` / ``base_tflops``: `fused_moe` (routing, alignment, both GEMMs, the
  sum); FLOPs = 6·T·K·H·I.
- ``lora_us``: `plan_moe_lora` (its alignment) + `moe_lora_gate_up` + `moe_lora_down`, timed
  with the sum over the K choices after them and that sum's time alone (``topk_sum_us``) taken
  off, so that a config whose down stage says ``"sum"`` (`moe_lora_down_sum`: the
  delta inside that sum) is timed alike.
- ``lora_floor_us``: bytes over the copy bandwidth measured in this run (``lora_floor_read_us`` /
  ``lora_over_read_floor``: over the read bandwidth, ``read_gbps``: the true floor of a pass that
  mostly reads; the targets below still use the copy); bytes =
  the distinct (adapter, expert) pairs' LoRA weights + the activations the LoRA
  pass must touch (x in, raw gate/up in, act out, y in and out).
- ``moe_lora_us``: `fused_moe` with LoRA end to end (its excess over ``base_us`` is
  the LoRA cost as the engine sees it).
- ``lora_path``: what the tuned "lora" config picks at the row's token count (`config_mode`).
  "separate": ``lora_us`` times the LoRA kernels alone (above).  "fused" (config ``"fused": true``,
  `moe_lora_fused`: the deltas are extra K steps of the base GEMMs, so they cannot be timed alone) and
  "fused_down" (``"fused": "down"``: the down delta alone is fused): ``lora_us`` =
  ``moe_lora_us - base_us``, i.e. the plan, the LoRA kernels and the GEMMs' extra work.
  Every path is timed in every row, whatever the entry's ``"fused_min_tokens"`` (``lora_separate_us``,
  ``lora_fused_us``, ``lora_fused_down_us``, ``moe_lora_<path>_us``).  ``moe_lora_one_stream_us`` /
  ``moe_lora_overlap_us``: `fused_moe` with the separate pass, its plan and gate/up shrink on the main
  stream / on a side stream beside the base gate/up GEMM (config ``"overlap"``, `moe_lora_side`), whatever
  the tuned entry says; ``moe_lora_separate_us`` follows the tuned entry's ``"overlap"``, while
  ``lora_us`` (the separate pass timed alone) is always one stream.
Targets: LoRA <= 15 us at 1 token, <= 3 x floor + 10 us from 16 to 256 tokens,
<= 0.30 x base everywhere.  One failing row is recorded with its error and the run
goes on.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

try:
    from benchmarks.timing import copy_bandwidth, emit, read_bandwidth, time_graph
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from timing import copy_bandwidth, emit, read_bandwidth, time_graph
from unipage.adapter_pack import pack_adapter, random_lora_weights  # noqa: E402
from unipage.config import ModelConfig  # noqa: E402
from unipage.kernels.fused_moe import base_config, fused_experts, fused_moe, moe_project, route_topk  # noqa: E402
from unipage.kernels.fused_moe_lora import (MoeLora, expected_load, lora_config, moe_lora_down,  # noqa: E402
                                            moe_lora_gate_up, moe_lora_meta, moe_lora_shrink, plan_moe_lora)
from unipage.kernels.common import config_devices, record_tuned_device  # noqa: E402
from unipage.kernels.moe_lora_fused import config_mode  # noqa: E402
from unipage.kernels.moe_lora_stack import build_stack, shrink_configs  # noqa: E402
from unipage.kernels.moe_lora_sum import moe_lora_down_sum, sums_down  # noqa: E402
from unipage.kernels.moe_align import CONFIG_DIR, device_key, launch_config, moe_align, shape_key  # noqa: E402
from unipage.kernels.moe_ranks import slot_ranks, slot_ranks_ref  # noqa: E402
from unipage.lora_layout import TargetSpec, build_layout  # noqa: E402

log = logging.getLogger("kernels_moe")

SHAPES = {"gpt-oss-20b": {"hidden": 2880, "inter": 2880, "experts": 32, "top_k": 4, "rank": 32},
          "qwen3-30b-a3b": {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8, "rank": 16}}
TOKENS = (1, 16, 64, 256, 1024, 4096)
ADAPTERS = 8
SLOT_ORDERS = ("round-robin", "sorted", "mixed")  # token i's adapter: i % adapters, i * adapters // tokens (runs),
# or a mixed step's: MIXED_DECODES decodes round-robin over all adapters but the last, then a prompt run of the last
MIXED_DECODES = 256
SLOT_ORDER = "round-robin"
ACTIVE = None  # the MoeLora's bound on the step's adapters (None: the distinct adapters of the tokens)
SLOT_IDS = None  # adapter i's slot in the tables (None: slot i); the rows between hold no adapter
PAGE_ELEMS = 16 * 2 * 8 * 64  # one KV block of 16 tokens, 8 KV heads of 64
SEED = 0
DTYPE = torch.bfloat16
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------
# Setup


def _pool(shape: dict, gen: torch.Generator):
    """8 adapters packed at shuffled page ids of a pool whose other pages are noise."""
    model = ModelConfig(num_layers=1, hidden_size=shape["hidden"], num_heads=32, num_kv_heads=8, head_dim=64,
                        num_experts=shape["experts"], top_k=shape["top_k"],
                        expert_intermediate_size=shape["inter"], dtype="bfloat16")
    spec = [(TargetSpec("experts.gate_up", (shape["rank"],)), TargetSpec("experts.down", (shape["rank"],)))]
    ids_of = slot_ids()
    layouts = [None] * (max(ids_of) + 1)
    for slot in ids_of:
        layouts[slot] = build_layout(model, spec)
    pages = [layout.num_pages(PAGE_ELEMS) if layout else 0 for layout in layouts]
    total = sum(pages) + 64
    pool = torch.randn(total, PAGE_ELEMS, device=DEVICE, dtype=DTYPE)
    table = torch.zeros(len(layouts), max(pages), dtype=torch.int32)
    order = torch.randperm(total, generator=gen).tolist()
    std = 2.0 / math.sqrt(shape["hidden"])
    for slot in ids_of:
        ids = [order.pop() for _ in range(pages[slot])]
        packed = pack_adapter(layouts[slot], random_lora_weights(layouts[slot], gen, std=std), PAGE_ELEMS, DTYPE)
        pool[torch.tensor(ids, device=DEVICE)] = packed[0].to(DEVICE)
        table[slot, : pages[slot]] = torch.tensor(ids, dtype=torch.int32)
    return layouts, pool, table.to(DEVICE)


def slot_ids() -> list[int]:
    """Each adapter's slot: `SLOT_IDS`, or 0 .. ADAPTERS - 1."""
    return list(SLOT_IDS) if SLOT_IDS is not None else list(range(ADAPTERS))


def setup(name: str) -> dict:
    shape = SHAPES[name]
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    h, i, e = shape["hidden"], shape["inter"], shape["experts"]
    layouts, pool, table = _pool(shape, gen)
    return {"name": name, **shape, "layouts": layouts, "pool": pool, "page_table": table,
            "meta": moe_lora_meta(layouts, 0, DEVICE),
            "w_gate_up": torch.randn(e, 2 * i, h, device=DEVICE, dtype=DTYPE) / math.sqrt(h),
            "w_down": torch.randn(e, h, i, device=DEVICE, dtype=DTYPE) / math.sqrt(i)}


def token_slots(num_tokens: int) -> torch.Tensor:
    """Each token's adapter slot, `SLOT_ORDER`: round-robin, sorted (runs of about tokens / adapters, slot 0
    first), or mixed (setup (b)'s steps with a prefill: up to `MIXED_DECODES` decodes, at most half the tokens,
    round-robin over every adapter but the last, then the prompt tokens of the last)."""
    index = torch.arange(num_tokens, device=DEVICE)
    if SLOT_ORDER == "round-robin":
        adapter = index % ADAPTERS
    elif SLOT_ORDER == "sorted":
        adapter = index * ADAPTERS // num_tokens
    else:
        decodes = min(MIXED_DECODES, num_tokens // 2) if ADAPTERS > 1 else 0
        adapter = torch.where(index < decodes, index % max(ADAPTERS - 1, 1), ADAPTERS - 1)
    return torch.tensor(slot_ids(), device=DEVICE)[adapter].int()


def batch(s: dict, num_tokens: int) -> dict:
    """Inputs of one step: tokens over the adapters in `SLOT_ORDER`, random routing, and where the bound on the
    step's adapters is below the tables' rows the step's slot ranks, made here once as the engine makes them
    once a step (before 7ff1ede the alignment made them in every timed call: rows at fewer tokens than
    adapters timed that launch too)."""
    h, i, k = s["hidden"], s["inter"], s["top_k"]
    x = torch.randn(num_tokens, h, device=DEVICE, dtype=DTYPE)
    logits = torch.randn(num_tokens, s["experts"], device=DEVICE)
    topk_weights, topk_ids = route_topk(logits, k, True)
    slots = token_slots(num_tokens)
    active = ACTIVE or min(num_tokens, ADAPTERS)
    make = slot_ranks if slots.is_cuda else slot_ranks_ref  # (compile_check's launches do not run)
    ranks = make(slots, s["page_table"].shape[0], active)  # (made once a step for all layers, as the engine)
    lora = MoeLora(s["pool"], s["page_table"], slots, s["meta"], active_slots=active, ranks=ranks)
    pairs = num_tokens * k
    return {"x": x, "logits": logits, "topk_weights": topk_weights, "topk_ids": topk_ids, "lora": lora,
            "raw": torch.randn(pairs, 2 * i, device=DEVICE, dtype=DTYPE),
            "act": torch.empty(pairs, i, device=DEVICE, dtype=DTYPE),
            "y": torch.randn(pairs, h, device=DEVICE, dtype=DTYPE)}


# ---------------------------------------------------------------------------------------------
# One row


def lora_step(s: dict, b: dict, config: dict | None = None, with_sum: bool = False) -> None:
    """The whole LoRA work of one layer and step (what ``lora_us`` times).  A config whose down stage
    has ``"sum": true`` runs `moe_lora_down_sum`, which also does the base's sum over the K
    choices; ``with_sum`` adds that sum to the separate pass too (the tuner compares the two so)."""
    plan = plan_moe_lora(b["lora"], b["topk_ids"], config)
    moe_lora_gate_up(plan, b["x"], b["raw"], b["act"])
    if sums_down(plan):
        moe_lora_down_sum(plan, b["act"], b["y"], b["topk_weights"])
        return
    moe_lora_down(plan, b["act"], b["y"], b["topk_weights"])
    if with_sum:
        b["y"].view(-1, s["top_k"], s["hidden"]).sum(dim=1)


def floor_bytes(s: dict, b: dict) -> int:
    """Distinct (adapter, expert) pairs' LoRA weights + the activations the LoRA pass touches."""
    h, i, r, k = s["hidden"], s["inter"], s["rank"], s["top_k"]
    slots = b["lora"].token_slots.long().repeat_interleave(k)
    groups = torch.unique(slots * s["experts"] + b["topk_ids"].reshape(-1).long()).numel()
    weight_elems = r * (h + 2 * i + i + h)  # gate/up A and B, down A and B
    pairs = b["topk_ids"].numel()
    act_elems = b["x"].numel() + pairs * (2 * i + i + 2 * h)
    return (groups * weight_elems + act_elems) * b["x"].element_size()


PATHS = {False: "separate", True: "fused", "down": "fused_down"}  # lora config "fused" -> the path's name
MODE_PATHS = {"": "separate", "all": "fused", "down": "fused_down"}  # `config_mode` -> the path's name
FUSED_KEYS = ("fused", "lora_k", "lora_steps", "down_shrink", "fused_min_tokens", "fused_base")  # the fused keys


def on_path(cfg: dict, fused) -> dict:
    """``cfg`` with the path ``fused`` ("fused" value) at every token count (its "fused_min_tokens" off)."""
    return {**cfg, "fused": fused, "fused_min_tokens": 0}


def measure(s: dict, num_tokens: int, bandwidth: float, read_bw: float) -> dict:
    b = batch(s, num_tokens)
    k, e = s["top_k"], s["experts"]
    args = (b["x"], b["logits"], s["w_gate_up"], s["w_down"], k, True)
    cfg = lora_config(b["lora"], b["topk_ids"])
    base_s = time_graph(lambda: fused_moe(*args), iters=20)
    sum_s = time_graph(lambda: b["y"].view(-1, k, s["hidden"]).sum(dim=1), iters=20)
    sep_s = time_graph(lambda: lora_step(s, b, on_path(cfg, False), with_sum=True), iters=20) - sum_s
    moe_s = {name: time_graph(functools.partial(fused_moe, *args, lora=b["lora"], lora_config=on_path(cfg, mode)),
                              iters=20) for mode, name in PATHS.items()}
    # the separate pass with its plan and gate/up shrink on a side stream (`moe_lora_side`), or on one stream
    side_s = {overlap: time_graph(functools.partial(fused_moe, *args, lora=b["lora"],
                                                    lora_config={**cfg, "fused": False, "overlap": overlap}), iters=20)
              for overlap in (False, True)}
    stack = build_stack(b["lora"], slot_ids())  # the step's adapters' dense stack (`moe_lora_stack`)
    stacked_s = time_graph(functools.partial(fused_moe, *args, lora=b["lora"], stack=stack), iters=20)
    project_s = _stack_projections(s, b, stack)
    path = MODE_PATHS[config_mode(cfg, num_tokens)]
    lora_s = sep_s if path == "separate" else moe_s[path] - base_s
    nbytes = floor_bytes(s, b)
    floor_s, read_floor_s = nbytes / bandwidth, nbytes / read_bw
    flops = 6 * num_tokens * k * s["hidden"] * s["inter"]
    lora_us, base_us = lora_s * 1e6, base_s * 1e6
    return {
        "base_us": round(base_us, 2), "base_tflops": round(flops / base_s / 1e12, 1),
        "lora_path": path,
        "lora_us": round(lora_us, 2), "lora_floor_us": round(floor_s * 1e6, 2),
        "lora_over_floor": round(lora_s / floor_s, 2), "lora_over_base": round(lora_s / base_s, 3),
        "lora_floor_read_us": round(read_floor_s * 1e6, 2), "lora_over_read_floor": round(lora_s / read_floor_s, 2),
        "topk_sum_us": round(sum_s * 1e6, 2),
        "lora_separate_us": round(sep_s * 1e6, 2), "lora_fused_us": round((moe_s["fused"] - base_s) * 1e6, 2),
        "lora_fused_down_us": round((moe_s["fused_down"] - base_s) * 1e6, 2),
        "moe_lora_one_stream_us": round(side_s[False] * 1e6, 2), "moe_lora_overlap_us": round(side_s[True] * 1e6, 2),
        "moe_lora_us": round(moe_s[path] * 1e6, 2),
        "moe_lora_stacked_us": round(stacked_s * 1e6, 2), "lora_stacked_us": round((stacked_s - base_s) * 1e6, 2),
        "stack_projections_us": [round(p * 1e6, 2) for p in project_s],
        **{f"moe_lora_{name}_us": round(seconds * 1e6, 2) for name, seconds in moe_s.items()},
        "meets_target": _meets(num_tokens, lora_us, floor_s * 1e6, base_us),
        "base_block_m": base_config(e, s["hidden"], s["inter"], b["topk_ids"], None)["block_m"],
        "lora_block_m": cfg["block_m"], "lora_k": cfg.get("lora_k", 64),
        "groups_per_expert_load": round(expected_load(num_tokens * k, min(num_tokens, ADAPTERS) * e), 2),
    }


def _stack_projections(s: dict, b: dict, stack) -> tuple[float, float]:
    """Seconds of the stacked path's two shrinks alone (`moe_project`: x by the gate/up A, act by the down A), with
    the launch settings the path takes (`moe_lora_stack.shrink_configs`)."""
    cfg = base_config(s["experts"], s["hidden"], s["inter"], b["topk_ids"], None)
    gate_up_cfg, down_cfg = shrink_configs(cfg)
    align = moe_align(b["topk_ids"], s["experts"], cfg["block_m"])
    z = torch.empty(b["topk_ids"].numel(), stack.a_gu.shape[1], device=DEVICE, dtype=DTYPE)
    dz = torch.empty(b["topk_ids"].numel(), stack.a_d.shape[1], device=DEVICE, dtype=DTYPE)
    return (time_graph(lambda: moe_project(b["x"], stack.a_gu, b["topk_ids"], align, z, gate_up_cfg,
                                           a_div=s["top_k"]), iters=20),
            time_graph(lambda: moe_project(b["act"], stack.a_d, b["topk_ids"], align, dz, down_cfg, a_div=1),
                       iters=20))


def _meets(num_tokens: int, lora_us: float, floor_us: float, base_us: float) -> bool:
    ok = lora_us <= 0.30 * base_us
    if num_tokens == 1:
        ok = ok and lora_us <= 15.0
    if 16 <= num_tokens <= 256:
        ok = ok and lora_us <= 3 * floor_us + 10.0
    return ok


def run(out=None, shapes=tuple(SHAPES), tokens=TOKENS) -> list[dict]:
    """Benchmark every shape and token count; emit one JSON line per row to ``out``; return the rows."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernels_moe needs a CUDA device")
    bandwidth, read_bw = copy_bandwidth(), read_bandwidth()
    rows = []
    for name in shapes:
        try:
            s = setup(name)
        except Exception as exc:  # a broken shape is one error row, not a dead run
            log.exception("setup of %s failed", name)
            rows.append(_emit({"shape": name, "error": repr(exc)}, out))
            continue
        for num_tokens in tokens:
            record = {"shape": name, "tokens": num_tokens}
            try:
                record.update(measure(s, num_tokens, bandwidth, read_bw))
                record["read_gbps"] = round(read_bw / 1e9, 1)
            except Exception as exc:
                log.exception("%s at %d tokens failed", name, num_tokens)
                record["error"] = repr(exc)
            rows.append(_emit(record, out, bandwidth))
        del s
        torch.cuda.empty_cache()
    return rows


def _emit(record: dict, out, bandwidth: float | None = None) -> dict:
    full = {"bench": "kernels_moe", "dtype": "bfloat16", "adapters": ADAPTERS, "active_slots": ACTIVE,
            "slot_order": SLOT_ORDER, "slot_ids": SLOT_IDS, "seed": SEED,
            "rank": SHAPES.get(record.get("shape"), {}).get("rank"),
            "copy_gbps": round(bandwidth / 1e9, 1) if bandwidth else None, **record}
    emit(full, out)
    return full


# ---------------------------------------------------------------------------------------------
# Alignment alone: the routing-side work every MoE call (base) and every LoRA plan pays

ALIGN_SLOTS = (0, 8, 16)  # 0: the base MoE's alignment by expert; else by (slot, expert), tokens round-robin


def align_row(name: str, num_tokens: int, slots: int) -> dict | None:
    """`moe_align` timed alone at ``name``'s shape with the tuned tile height of its kind; None where that
    is LoRA pair mode (block_m 1), which has no alignment."""
    shape = SHAPES[name]
    e, k = shape["experts"], shape["top_k"]
    logits = torch.randn(num_tokens, e, device=DEVICE)
    _, topk_ids = route_topk(logits, k, True)
    extra = {}
    if slots:
        block_m = launch_config("lora", shape_key(shape["hidden"], shape["inter"], e, k),
                                expected_load(topk_ids.numel(), min(num_tokens, slots) * e), config_devices())["block_m"]
        extra = {"token_slots": (torch.arange(num_tokens, device=DEVICE) % slots).int(),
                 "slot_flags": torch.ones(slots, dtype=torch.int32, device=DEVICE)}
    else:
        block_m = base_config(e, shape["hidden"], shape["inter"], topk_ids, None)["block_m"]
    if block_m <= 1:
        return None
    seconds = time_graph(lambda: moe_align(topk_ids, e, block_m, **extra), iters=50)
    return {"row": "align", "shape": name, "tokens": num_tokens, "slots": slots, "block_m": block_m,
            "align_us": round(seconds * 1e6, 2)}


# ---------------------------------------------------------------------------------------------
# The LoRA passes one by one: where a layer's LoRA time goes, for a config and its variants


def split_row(name: str, s: dict, num_tokens: int, overrides: dict) -> dict:
    """Each separate-path LoRA pass timed alone at ``s``'s shape: the shrink, the gate/up pass (the shrink,
    then the expand) and the down pass (`moe_lora_down`, or `moe_lora_down_sum` with the base's top-k sum
    where the config says so; ``topk_sum_us`` times that sum alone), with the tuned entry and ``overrides``
    (``with_path`` paths) set on it; ``moe_lora_us`` / ``base_us``: `fused_moe` end to end with LoRA under
    that config (side stream and all) / without.  A variant that sets ``"fused"`` takes that path at any
    token count (``"fused_min_tokens"`` 0, unless it sets that too)."""
    b = batch(s, num_tokens)
    cfg = lora_config(b["lora"], b["topk_ids"])
    if "fused" in overrides:
        cfg = on_path(cfg, overrides["fused"])
    for path, value in overrides.items():
        cfg = with_path(cfg, path, value)
    plan = plan_moe_lora(b["lora"], b["topk_ids"], cfg)
    if sums_down(plan):
        down = functools.partial(moe_lora_down_sum, plan, b["act"], b["y"], b["topk_weights"])
    else:
        down = functools.partial(moe_lora_down, plan, b["act"], b["y"], b["topk_weights"])
    args = (b["x"], b["logits"], s["w_gate_up"], s["w_down"], s["top_k"], True)
    times = {"shrink": lambda: moe_lora_shrink(plan, b["x"]),
             "gate_up_pass": lambda: moe_lora_gate_up(plan, b["x"], b["raw"], b["act"]),
             "down_pass": down, "all": lambda: lora_step(s, b, cfg),
             "topk_sum": lambda: b["y"].view(-1, s["top_k"], s["hidden"]).sum(dim=1),
             "moe_lora": lambda: fused_moe(*args, lora=b["lora"], lora_config=cfg), "base": lambda: fused_moe(*args)}
    row = {"row": "split", "shape": name, "tokens": num_tokens, "overrides": overrides, "config": copy.deepcopy(cfg)}
    row.update({f"{key}_us": round(time_graph(fn, iters=25) * 1e6, 2) for key, fn in times.items()})
    return row


def overrides_arg(text: str) -> dict:
    """A ``--split`` variant: a JSON object of tuner paths (``"gate_up.num_warps"``, ``"split_k"``) to values."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict) or not value:
        raise argparse.ArgumentTypeError(f"a variant is a non-empty JSON object of overrides, got {text!r}")
    return value


def run_split(out=None, shapes=tuple(SHAPES), tokens=TOKENS, variants=({},)) -> list[dict]:
    """`split_row` per shape, token count and variant (a dict of ``with_path`` overrides; ``{}``: the tuned entry)."""
    rows = []
    for name in shapes:
        s = setup(name)
        for num_tokens in tokens:
            for overrides in variants:
                rows.append(_emit(split_row(name, s, num_tokens, overrides), out))
        del s
        torch.cuda.empty_cache()
    return rows


def run_align(out=None, shapes=tuple(SHAPES), tokens=TOKENS) -> list[dict]:
    """One row per shape, token count and `ALIGN_SLOTS` entry (LoRA pair mode, no alignment, has none)."""
    rows = []
    for name in shapes:
        for num_tokens in tokens:
            for slots in ALIGN_SLOTS:
                record = align_row(name, num_tokens, slots)
                if record is not None:
                    rows.append(_emit(record, out))
    return rows


# ---------------------------------------------------------------------------------------------
# Tuning: coordinate descent over launch-config fields, per shape and token count

BASE_SPACE = [("block_m", [16, 32, 64, 128])] + [
    (f"{stage}.{field}", values) for stage in ("gate_up", "down") for field, values in (
        ("block_n", [32, 64, 128, 256]), ("block_k", [64, 128]), ("num_warps", [4, 8]),
        ("num_stages", [2, 3, 4, 5]), ("group_m", [1, 8, 16]), ("tma", [False, True]))]
LORA_SPACE = [("block_m", [1, 4, 8, 16, 32, 64]),
              # group mode with its shrink loading whole splits (pair mode's loads, one read of A per group)
              ("", [{"block_m": m, "shrink": {"whole_k": True}} for m in (16, 32)]), ("shrink.whole_k", [False, True]),
              # small tiles (pair mode's math over a few pairs of one group) with pair mode's one-warp gate/up
              ("", [{"block_m": m, "gate_up": {"block_n": 128, "num_warps": 1}} for m in (4, 8)]),
              ("split_k", [1, 2, 4, 8, 16, 32]), ("shrink.num_warps", [1, 2, 4, 8]),
              ("shrink.num_stages", [2, 3, 4, 6]), ("gate_up.block_n", [64, 128, 256, 512]),
              ("gate_up.num_warps", [1, 2, 4, 8]), ("gate_up.num_stages", [1, 2, 3]), ("gate_up.maxnreg", [0, 128]),
              # one warp a program (pair mode: its reductions stay in the warp) wants a narrower tile than
              # four do, so the two are tried together too
              ("gate_up", [{"block_n": n, "num_warps": 1} for n in (64, 128, 256)]),
              ("down.block_n", [64, 128, 256, 512, 1024, 2048]),
              ("down.num_warps", [1, 2, 4, 8]), ("down.num_stages", [1, 2, 3]), ("pdl", [False, True]),
              # the down delta inside the top-k sum (K x rank rows a tile: narrower tiles, fewer warps than a
              # group-mode down tile's; one warp won at 256 tokens of 4 adapters), then the down tile again
              ("down", [{"sum": False}] + [{"sum": True, "block_n": n, "num_warps": w}
                                           for n in (64, 128, 256) for w in (1, 2, 4)]),
              ("down.block_n", [64, 128, 256, 512, 1024, 2048]), ("down.num_warps", [1, 2, 4, 8])]


def with_path(entry: dict, path: str, value) -> dict:
    """``entry`` with ``path`` set to ``value``; a dict value is merged into the dict at ``path`` (a joint
    candidate: fields that only make sense together, e.g. the down stage's "sum" with its tile).  Path
    "": ``value``'s fields set in the entry, a stage's dict merged into that stage's."""
    new = copy.deepcopy(entry)
    if not path:
        for key, field in value.items():
            new[key] = {**new.get(key, {}), **field} if isinstance(field, dict) else field
        return new
    *parents, leaf = path.split(".")
    node = new
    for key in parents:
        node = node[key]
    node[leaf] = {**node.get(leaf, {}), **value} if isinstance(value, dict) else value
    return new


def _time_or_inf(fn) -> float:
    try:
        return time_graph(fn, iters=10)
    except Exception:  # an invalid config (e.g. out of shared memory) just loses
        log.debug("config failed", exc_info=True)
        torch.cuda.synchronize()
        return math.inf


def _candidate(best: dict, path: str, value) -> dict | None:
    """`with_path`, tidied: the down stage's "sum": false goes (the default), pair mode and small tiles drop
    the shrink's "whole_k" (group mode's alone), pair mode the "overlap"; None where not worth timing:
    ``best`` itself, or a fused down+sum tile past 256 columns (K x rank rows: it only spills)."""
    new = with_path(best, path, value)
    if new.get("down", {}).get("sum") is False:
        del new["down"]["sum"]
    if new.get("block_m", 1) == 1:  # the side-stream overlap, measured slower in pair mode (not timed here:
        new.pop("overlap", None)  # `lora_step` is one stream)
    if new.get("block_m", 1) < 16:
        new.get("shrink", {}).pop("whole_k", None)
    down = new.get("down", {})
    if new == best or (down.get("sum") and down.get("block_n", 0) > 256):
        return None
    return new


def descend(entry: dict, space, time_fn) -> tuple[dict, float]:
    """One pass of coordinate descent: each field in turn takes its fastest value (`_candidate`s)."""
    best, best_s = entry, _time_or_inf(lambda: time_fn(entry))
    for path, values in space:
        for value in values:
            candidate = _candidate(best, path, value)
            if candidate is None:
                continue
            seconds = _time_or_inf(functools.partial(time_fn, candidate))
            if seconds < best_s:
                best, best_s = candidate, seconds
    return best, best_s


def _base_step(args: tuple, config: dict) -> None:
    fused_experts(*args, config=config)


def _tune_shape(s: dict, tokens, save, stages=("base", "lora"), keep=()) -> None:
    """Tune the ``stages``' configs per token count (the others keep their entries); ``save(kind,
    entries)`` after each count keeps partial work.  ``keep``: the current "lora" entries, merged with
    the tuned ones (`_merged`), so a tune at a few token counts keeps the others' entries.  The "lora"
    search times the separate pass, so it starts from the entry without the fused path's keys
    (`FUSED_KEYS`: those are set by hand from ``--split`` rows) and a tuned entry has none."""
    base, lora = [], []
    for num_tokens in tokens:
        b = batch(s, num_tokens)
        if "base" in stages:
            args = (b["x"], s["w_gate_up"], s["w_down"], b["topk_weights"], b["topk_ids"])
            start = base_config(s["experts"], s["hidden"], s["inter"], b["topk_ids"], None)
            entry, secs = descend(start, BASE_SPACE, functools.partial(_base_step, args))
            base.append((b["topk_ids"].numel() / s["experts"], entry))
            log.info("%s T=%d base %.1f us %s", s["name"], num_tokens, secs * 1e6, entry)
            save("base", _bucketed(base))
        if "lora" in stages:
            start = {k: v for k, v in lora_config(b["lora"], b["topk_ids"]).items() if k not in FUSED_KEYS}
            entry, secs = descend(start, LORA_SPACE, functools.partial(lora_step, s, b, with_sum=True))
            lora.append((expected_load(b["topk_ids"].numel(), min(num_tokens, ADAPTERS) * s["experts"]), entry))
            log.info("%s T=%d lora %.1f us %s", s["name"], num_tokens, secs * 1e6, entry)
            save("lora", _merged(keep, lora))


def _merged(old: list[dict], tuned: list[tuple[float, dict]]) -> list[dict]:
    """``old`` entries (ordered by ``max_load``) with the ``tuned`` ``(load, entry)`` pairs put in: the old
    entries whose loads lie between the lowest and the highest tuned load go; the tuned entries serve
    from the last old entry kept below up to where the old entry holding the highest tuned load ended."""
    new = _bucketed(tuned)
    low, high = min(load for load, _ in tuned), max(load for load, _ in tuned)
    cover = next((e for e in old if e["max_load"] >= high), None)
    if cover is not None:
        new[-1]["max_load"] = cover["max_load"]
    above = [e for e in old if cover is not None and e["max_load"] > cover["max_load"]]
    return [e for e in old if e["max_load"] < low] + new + above


def _bucketed(tuned: list[tuple[float, dict]]) -> list[dict]:
    """Entries ordered by load; each serves loads up to the geometric midpoint to the next."""
    tuned = sorted(tuned, key=lambda item: item[0])
    out = []
    for index, (load, entry) in enumerate(tuned):
        nxt = tuned[index + 1][0] if index + 1 < len(tuned) else None
        out.append({**entry, "max_load": math.sqrt(load * nxt) if nxt else 1e12})
    return out


def tune(shapes=tuple(SHAPES), tokens=TOKENS, stages=("base", "lora")) -> Path:
    """Tune ``stages`` ("base", "lora") for each shape; write ``configs/moe_<device>.json``.
    Entries are read from the current configs (tuned start where tuned before), so the tuned
    launch configs of the stages and shapes not tuned stay as they were."""
    path = CONFIG_DIR / f"moe_{device_key()}.json"
    table = json.loads(path.read_text()) if path.exists() else {}
    for name in shapes:
        s = setup(name)
        key = shape_key(s["hidden"], s["inter"], s["experts"], s["top_k"])

        def save(kind, entries, key=key):  # keep what is done if a later token count or shape fails
            table.setdefault(key, {})[kind] = entries
            path.write_text(json.dumps(table, indent=1) + "\n")
            record_tuned_device(path.with_name("devices.json"))

        _tune_shape(s, tokens, save, stages, table.get(key, {}).get("lora", []))
        del s
        torch.cuda.empty_cache()
    return path


def configure(adapters: int, rank: int | None = None, slot_order: str = "round-robin",
              active: int | None = None, ids: list[int] | None = None) -> None:
    """Set the adapters the tokens spread over, their order (`SLOT_ORDERS`), if given every shape's rank
    (serve.py's setup (b) runs Qwen3-30B-A3B with 16 adapters of rank 8), the bound on a step's adapters
    that picks the tuned entry (a CUDA graph's adapter class: setup (b)'s mixed steps of 5 adapters run the
    graphs of class 16) and each adapter's slot in the tables (``ids``; default 0 .. adapters - 1)."""
    global ADAPTERS, SLOT_ORDER, ACTIVE, SLOT_IDS
    if slot_order not in SLOT_ORDERS:
        raise ValueError(f"slot order must be one of {SLOT_ORDERS}, got {slot_order!r}")
    if ids is not None and (len(ids) != adapters or len(set(ids)) != adapters or min(ids) < 0):
        raise ValueError(f"slot ids must be {adapters} distinct slots >= 0 (one per adapter), got {ids}")
    if active is not None and active < adapters:
        raise ValueError(f"the bound on a step's adapters ({active}) is below the adapters ({adapters})")
    ADAPTERS, SLOT_ORDER, ACTIVE, SLOT_IDS = adapters, slot_order, active, ids
    for shape in SHAPES.values():
        shape["rank"] = rank or shape["rank"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="append JSON lines to this file (default: stdout)")
    parser.add_argument("--tune", action="store_true", help="tune launch configs instead of benchmarking")
    parser.add_argument("--align", action="store_true", help="time the token-to-group alignment alone")
    parser.add_argument("--split", nargs="*", type=overrides_arg, default=None, metavar="JSON",
                        help="time each LoRA pass alone (shrink, gate/up, down) with the tuned entry, then with each "
                             "JSON object of overrides set on it (keys: the tuner's paths, e.g. "
                             "'{\"gate_up.num_warps\": 1}')")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS),
                        help="token counts; with --tune the tuned \"base\" entries of a shape are replaced by "
                             "those of these counts, and the \"lora\" ones merged in (kernels_moe._merged: the "
                             "old entries of other loads stay)")
    parser.add_argument("--stages", nargs="+", default=["base", "lora"], choices=["base", "lora"],
                        help="with --tune: the kernels to tune (the others keep their configs)")
    parser.add_argument("--adapters", type=int, default=ADAPTERS, help="adapters the tokens spread over")
    parser.add_argument("--rank", type=int, help="every adapter's rank (default: the shape's)")
    parser.add_argument("--slot-order", default="round-robin", choices=SLOT_ORDERS,
                        help="the benchmark's tokens' adapters round-robin, sorted into runs (the MoE LoRA kernels "
                             "ran as fast either way at setup (b)'s decode mix), or mixed: a step with a prefill, "
                             "256 decodes round-robin over all adapters but the last, then the last one's prompt")
    parser.add_argument("--active-slots", type=int,
                        help="the bound on a step's adapters that picks the tuned entry (default: --adapters)")
    parser.add_argument("--slot-ids", type=int, nargs="+",
                        help="each adapter's slot in the tables (default 0 .. adapters - 1): the engine's loads and "
                             "evictions scatter the adapters of a step over its table rows, e.g. 2 9 5 14 11")
    args = parser.parse_args()
    if sum([args.tune, args.align, args.split is not None]) > 1:
        parser.error("--tune, --align and --split exclude each other")
    if (args.slot_order != "round-robin" or args.slot_ids) and (args.tune or args.align):
        parser.error("--slot-order and --slot-ids are for the benchmark rows; --tune and --align use round-robin "
                     "tokens over slots 0 .. adapters - 1")
    if args.slot_ids and (len(args.slot_ids) != args.adapters or len(set(args.slot_ids)) != args.adapters
                          or min(args.slot_ids) < 0):
        parser.error(f"--slot-ids takes {args.adapters} distinct slots >= 0 (one per adapter), got {args.slot_ids}")
    configure(args.adapters, args.rank, args.slot_order, args.active_slots, args.slot_ids)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    start = time.time()
    if args.tune:
        log.info("wrote %s", tune(args.shapes, args.tokens, args.stages))
    elif args.align:
        with open(args.out, "a") if args.out else open(sys.stdout.fileno(), "w", closefd=False) as out:
            run_align(out, args.shapes, args.tokens)
    elif args.split is not None:
        with open(args.out, "a") if args.out else open(sys.stdout.fileno(), "w", closefd=False) as out:
            run_split(out, args.shapes, args.tokens, [{}] + args.split)
    else:
        with open(args.out, "a") if args.out else open(sys.stdout.fileno(), "w", closefd=False) as out:
            run(out, args.shapes, args.tokens)
    log.info("done in %.0f s", time.time() - start)


if __name__ == "__main__":
    main()
