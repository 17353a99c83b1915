"""Paged dense LoRA shrink/expand on a GPU: Llama-3.1-8B q/k/v (4096 -> 4096 / 1024 / 1024),
rank 16, 16 adapters, bf16, tokens spread round-robin over the adapters.  ``--targets``
picks another of the model's LoRA calls (o, gate_up, down) to measure or tune;
``--shape qwen3-30b-a3b`` the attention of Qwen3-30B-A3B (2048 -> 4096 / 512 / 512, o
4096 -> 2048) at rank 8, as serving setup b runs it (its MLP is the MoE: `kernels_moe`);
``--shape gpt-oss-20b`` GPT-OSS-20B's (2880 -> 4096 / 512 / 512, o 4096 -> 2880) at rank 32
over 8 adapters, as setup a runs it.

One JSON line per token count: kernel time (CUDA graph, L2 flushed), the HBM
floor (distinct LoRA weights touched + x read + y read and written, over the
copy bandwidth measured in the same run; ``floor_read_us`` / ``x_floor_read``
over the read bandwidth, the true floor of a pass that mostly reads, which
the targets do not use yet), time / floor, the same kernel on
contiguous (unpaged) weights, the other path's time, and the error against an
fp32 reference.  Targets: <= 10 us at 1 token, <= 3x floor at 4096 tokens,
paged within 10 % of contiguous.  A failing row is reported and skipped.

    python -m benchmarks.kernels_lora            # measure
    python -m benchmarks.kernels_lora --tune     # tune launch configs into kernels/configs/lora_dense.json
    python -m benchmarks.kernels_lora --tune --targets down --tokens 256 1024
    python -m benchmarks.kernels_lora --tune --shape qwen3-30b-a3b --targets o --tokens 256 4096
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import traceback
from pathlib import Path
from typing import NamedTuple

import torch

try:
    from benchmarks.timing import copy_bandwidth, emit, read_bandwidth, time_graph
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from timing import copy_bandwidth, emit, read_bandwidth, time_graph
from unipage.adapter_pack import pack_adapter, random_lora_weights
from unipage.config import ModelConfig
from unipage.kernels import lora_meta
from unipage.kernels.common import device_key, record_tuned_device
from unipage.kernels.lora import lora_shrink_expand, lora_shrink_expand_ref
from unipage.kernels.lora_meta import dense_lora_meta, launch_config, plan_lora_batch
from unipage.lora_layout import TargetSpec, build_layout

log = logging.getLogger("benchmarks.kernels_lora")

QKV = ("q_proj", "k_proj", "v_proj")
GROUPS = {"qkv": QKV, "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
TOKENS = (1, 16, 64, 256, 1024, 4096)
ADAPTERS, RANK, SEED = 16, 16, 0
LLAMA_8B = ModelConfig(num_layers=1, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=14336)
QWEN3_30B_A3B = ModelConfig(num_layers=1, hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                            intermediate_size=6144)  # attention only: its MLP is the MoE
GPT_OSS_20B = ModelConfig(num_layers=1, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                          intermediate_size=2880)  # attention only, as for Qwen3


class Shape(NamedTuple):
    label: str
    model: ModelConfig
    rank: int
    page_elems: int  # one KV block of 16 tokens
    calls: tuple[str, ...]  # the keys of GROUPS it has
    adapters: int = ADAPTERS  # as its serving setup spreads the tokens


SHAPES = {"llama3-8b": Shape("Llama-3.1-8B", LLAMA_8B, RANK, 16 * 2 * 8 * 128, tuple(GROUPS)),
          "qwen3-30b-a3b": Shape("Qwen3-30B-A3B", QWEN3_30B_A3B, 8, 16 * 2 * 4 * 128, ("qkv", "o")),
          "gpt-oss-20b": Shape("GPT-OSS-20B", GPT_OSS_20B, 32, 16 * 2 * 8 * 64, ("qkv", "o"), adapters=8)}


class Setup:
    """Both pools (adapters at shuffled pages among noise, and consecutive), tables and metadata."""

    def __init__(self, dtype=torch.bfloat16, adapters=None, seed=SEED, device="cuda", targets=QKV,
                 shape="llama3-8b"):
        gen = torch.Generator().manual_seed(seed)
        spec = SHAPES[shape]
        adapters = spec.adapters if adapters is None else adapters
        self.dtype, self.adapters, self.device, self.targets = dtype, adapters, torch.device(device), targets
        self.model_name, self.rank, page_elems = spec.label, spec.rank, spec.page_elems
        layout = build_layout(spec.model, [tuple(TargetSpec(t, (self.rank,)) for t in targets)])
        pages = layout.num_pages(page_elems)
        packed = [pack_adapter(layout, random_lora_weights(layout, gen, std=0.02), page_elems, dtype)[0]
                  for _ in range(adapters)]
        total = adapters * pages + 256
        ids = torch.randperm(total, generator=gen)[: adapters * pages].view(adapters, pages)
        self.pool = torch.randn(total, page_elems, generator=gen).to(dtype)
        self.flat_pool = torch.zeros(adapters * pages, page_elems, dtype=dtype)
        for slot, buf in enumerate(packed):
            self.pool[ids[slot]] = buf
            self.flat_pool[slot * pages: (slot + 1) * pages] = buf
        self.pool, self.flat_pool = self.pool.to(device), self.flat_pool.to(device)
        self.table = ids.to(torch.int32).to(device)
        self.flat_table = torch.arange(adapters * pages, dtype=torch.int32).view(adapters, pages).to(device)
        self.meta = dense_lora_meta([layout] * adapters, 0, targets, device=device)
        entries = [layout.layers[0].targets[(t, -1)] for t in targets]
        self.weight_bytes = sum(e.a.rows * e.a.cols for e in entries) * 2
        self.weight_bytes += sum(s.b.rows * s.b.cols for e in entries for s in e.slices) * 2

    def inputs(self, tokens: int, seed: int = SEED):
        gen = torch.Generator(device=self.device).manual_seed(seed)
        slots = (torch.arange(tokens, dtype=torch.int32) % self.adapters).to(self.device)
        x = torch.randn(tokens, self.meta.d_in, device=self.device, generator=gen).to(self.dtype)
        y = torch.randn(tokens, self.meta.out_cols, device=self.device, generator=gen).to(self.dtype) * 0.01
        return slots, x, y

    def floor_bytes(self, tokens: int) -> int:
        touched = min(tokens, self.adapters) * self.weight_bytes
        return touched + tokens * self.meta.d_in * 2 + 2 * tokens * self.meta.out_cols * 2


def timed(fn) -> tuple[float, bool]:
    """Seconds per call from a CUDA graph; if capture fails, from eager launches (flag False)."""
    try:
        return time_graph(fn), True
    except RuntimeError as exc:
        log.warning("graph capture failed (%s); timing eager launches", exc)
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(times[3:]), False


def rel_err(setup: Setup, slots, x, y0, batch) -> float:
    """||delta - delta_ref|| / ||delta_ref|| against an fp32 reference over the same pages."""
    meta = setup.meta
    y = lora_shrink_expand(y0.clone(), x, setup.pool, setup.table, slots, meta, batch=batch)
    ref = lora_shrink_expand_ref(y0.float(), x.float(), setup.pool.float(), setup.table, slots, meta)
    delta_ref = ref - y0.float()
    return ((y.float() - y0.float() - delta_ref).norm() / delta_ref.norm()).item()


def measure(setup: Setup, tokens: int, grouped: bool | None = None, config: dict | None = None,
            contiguous: bool = False) -> tuple[float, bool, object]:
    slots, x, y = setup.inputs(tokens)
    batch = plan_lora_batch(slots, setup.adapters, grouped=grouped)
    pool, table = (setup.flat_pool, setup.flat_table) if contiguous else (setup.pool, setup.table)
    seconds, graph = timed(lambda: lora_shrink_expand(y, x, pool, table, slots, setup.meta, batch=batch,
                                                       config=config, contiguous=contiguous))
    return seconds, graph, batch


def row(setup: Setup, tokens: int, bandwidth: float, read_bw: float) -> dict:
    seconds, graph, batch = measure(setup, tokens)
    contiguous, _, _ = measure(setup, tokens, contiguous=True)
    other, _, _ = measure(setup, tokens, grouped=not batch.grouped)
    floor = setup.floor_bytes(tokens) / bandwidth
    slots, x, y = setup.inputs(tokens)
    config = launch_config(setup.meta, batch, setup.dtype, x.device)
    return {
        "bench": "lora_dense_qkv", "model": setup.model_name, "targets": "+".join(setup.targets), "tokens": tokens,
        "adapters": setup.adapters, "rank": setup.rank, "dtype": str(setup.dtype).removeprefix("torch."), "seed": SEED,
        "path": "grouped" if batch.grouped else "gemv",
        "block_m": batch.block_m, "us": seconds * 1e6, "floor_us": floor * 1e6, "x_floor": seconds / floor,
        "contiguous_us": contiguous * 1e6, "paged_over_contiguous": seconds / contiguous,
        "other_path_us": other * 1e6, "graph": graph, "rel_err": rel_err(setup, slots, x, y, batch),
        "copy_gbps": bandwidth / 1e9, "config": config, "read_gbps": read_bw / 1e9,
        "floor_read_us": setup.floor_bytes(tokens) / read_bw * 1e6,
        "x_floor_read": seconds * read_bw / setup.floor_bytes(tokens),
        "targets_met": {"1tok_le_10us": seconds <= 10e-6 if tokens == 1 else None,
                        "le_3x_floor": seconds <= 3 * floor, "paged_within_10pct": seconds <= 1.1 * contiguous},
    }


def run(out=None, tokens=TOKENS, targets=QKV, shape="llama3-8b") -> None:
    """Emit one JSON line per token count to ``out`` (stdout by default); failures become error rows."""
    bandwidth, read_bw = copy_bandwidth(), read_bandwidth()
    emit({"bench": "lora_dense_qkv", "copy_gbps": bandwidth / 1e9, "read_gbps": read_bw / 1e9}, out)
    setup = Setup(targets=targets, shape=shape)
    for count in tokens:
        try:
            emit(row(setup, count, bandwidth, read_bw), out)
        except Exception as exc:  # noqa: BLE001 - one failing row must not end the run; it is reported
            log.error("tokens=%d failed:\n%s", count, traceback.format_exc())
            emit({"bench": "lora_dense_qkv", "tokens": count, "error": repr(exc)}, out)


# ------------------------------------------------------------------ tuning

SEARCH = {  # coordinate descent, in this order, starting from the default config
    "block_k": (64, 128, 256, 512), "split_k": (0, 1, 2, 4, 8, 16, 32, 64), "rows": (32, 64, 128),
    "shrink_warps": (1, 2, 4, 8), "shrink_stages": (1, 2, 3, 4),
    "block_n": (64, 128, 256, 512), "expand_warps": (1, 2, 4, 8), "expand_stages": (1, 2, 3),
}


def tune_one(setup: Setup, tokens: int) -> tuple[str, dict, float]:
    _, _, batch = measure(setup, tokens, config={})
    path = "grouped" if batch.grouped else "gemv"
    best = dict(lora_meta._load_json()["default"][path])
    best_s = measure(setup, tokens, config=best)[0]
    for key, values in SEARCH.items():
        for value in values:
            trial = {**best, key: value}
            try:
                seconds = measure(setup, tokens, config=trial)[0]
            except Exception:  # noqa: BLE001 - a config that fails to compile or run is skipped
                log.warning("tokens=%d %s=%s failed:\n%s", tokens, key, value, traceback.format_exc())
                continue
            if seconds < best_s:
                best, best_s = trial, seconds
    default = lora_meta._load_json()["default"][path]
    return path, {k: v for k, v in best.items() if default.get(k) != v}, best_s


def kept_overrides(old: dict, new: dict) -> dict:
    """A token bucket's new overrides, with the old ones of settings the tuning does not search (e.g. the
    stacked expand's ``stacked_block_n``, set from engine A/B runs): a re-tune must not drop them."""
    return {**{k: v for k, v in old.items() if k not in SEARCH}, **new}


def tune(out=None, tokens=TOKENS, targets=QKV, path: Path = lora_meta.CONFIG_PATH, shape="llama3-8b") -> None:
    """Tune each token count's config on this GPU and write the overrides into ``path``."""
    setup = Setup(targets=targets, shape=shape)
    data = json.loads(path.read_text())
    key = lora_meta.shape_key(setup.meta, setup.dtype)
    entry = data.setdefault("tuned", {}).setdefault(device_key("cuda"), {}).setdefault(key, {})
    for count in tokens:
        try:
            kind, overrides, seconds = tune_one(setup, count)
        except Exception as exc:  # noqa: BLE001 - keep tuning the other token counts
            log.error("tuning tokens=%d failed:\n%s", count, traceback.format_exc())
            emit({"bench": "lora_dense_qkv_tune", "tokens": count, "error": repr(exc)}, out)
            continue
        bucket = entry.setdefault(kind, {})
        bucket[str(count)] = kept_overrides(bucket.get(str(count), {}), overrides)
        emit({"bench": "lora_dense_qkv_tune", "shape": key, "tokens": count, "path": kind, "us": seconds * 1e6,
              "overrides": overrides}, out)
        path.write_text(json.dumps(data, indent=2) + "\n")
        record_tuned_device(path.with_name("devices.json"))
    lora_meta.reload_configs()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true", help="tune launch configs and write them to the JSON")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS), help="token counts")
    parser.add_argument("--targets", choices=sorted(GROUPS), default="qkv", help="which LoRA call of the model")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b", help="the model's shape and rank")
    args = parser.parse_args(argv)
    calls = SHAPES[args.shape].calls
    if args.targets not in calls:
        parser.error(f"{args.shape} has no dense {args.targets} LoRA call (its choices: {', '.join(calls)})")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        sys.exit("benchmarks.kernels_lora needs a CUDA GPU")
    (tune if args.tune else run)(tokens=tuple(args.tokens), targets=GROUPS[args.targets], shape=args.shape)


if __name__ == "__main__":
    main()
