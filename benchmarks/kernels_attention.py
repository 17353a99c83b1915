"""GPU benchmark of paged attention and write_kv, one JSON line per row.

    python -m benchmarks.kernels_attention [--out FILE] [--no-sweep]

Rows (bf16, block_tokens 16, pages of every sequence scattered over a shuffled
pool of one layer, the spare pages holding noise):
- ``decode``: 64 sequences x 2,048 tokens of context, for a GPT-OSS-like
  (H 64 / KVH 8 / D 64) and a Llama-8B-like (H 32 / KVH 8 / D 128) layer.
  KV bytes read, achieved bandwidth and its fraction of the measured copy
  bandwidth (target >= 0.70); ``rel_err`` vs the fp32 reference.
- ``decode_sdpa``: torch SDPA on contiguous K/V of the same shape, for scale.
- ``decode_sweep``: the same at other ``num_splits`` / ``block_n``.
  These two run last, until the time budget (``--budget``) is spent.
- ``prefill``: 4 sequences x 1,024 new tokens over a 1,024-token prefix: TFLOP/s
  (causal FLOPs: 4 * H * D per visible (query, key) pair).
- ``prefill_mixed``: a serving step's layout, 252 one-token decodes over 1,100 tokens of
  context then 4 prompts of 960 tokens (what a mixed step of setup b runs), also for a
  Qwen3-30B-A3B-like layer (H 32 / KVH 4 / D 128): ``seconds`` in one prefill launch,
  ``split_seconds`` as the decoder runs it (the decodes on the decode kernel, the prefill
  launch skipping them); ``--mixed-only`` runs these rows alone.
- ``write_kv``: 4,096 tokens written to scattered slots: bandwidth (read + write).

A failing row is written with an ``error`` field and the run goes on.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import sys
import time

import torch

from unipage.kernels.attention import (
    AttentionConfig,
    decode_config,
    default_num_splits,
    paged_attention_decode,
    paged_attention_prefill,
)
from unipage.kernels.attention_ref import paged_attention_decode_ref
from unipage.kernels.kv_write import write_kv

try:
    from benchmarks.timing import copy_bandwidth, emit, time_graph
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from timing import copy_bandwidth, emit, time_graph

SEED = 0
DEVICE = "cuda"
BLOCK_TOKENS = 16
DTYPE = torch.bfloat16
SHAPES = {"gpt-oss": (64, 8, 64), "llama-8b": (32, 8, 128)}  # name -> (H, KVH, D)
MIXED_SHAPES = {**SHAPES, "qwen3-30b-a3b": (32, 4, 128)}
MIXED_DECODES, MIXED_CONTEXT, MIXED_PROMPTS, MIXED_PROMPT = 252, 1100, 4, 960
DECODE_BATCH, DECODE_CONTEXT = 64, 2048
PREFILL_BATCH, PREFILL_NEW, PREFILL_PREFIX = 4, 1024, 1024
WRITE_TOKENS = 4096
log = logging.getLogger("benchmarks.kernels_attention")


def scattered_kv(lengths: list[int], kv_heads: int, head_dim: int, spare: float = 0.25):
    """A noisy pool ``[N, P]`` and block tables ``[B, max_blocks]`` int32 over shuffled pages."""
    blocks = [math.ceil(n / BLOCK_TOKENS) for n in lengths]
    num_pages = int(sum(blocks) * (1 + spare)) + 1
    gen = torch.Generator(device=DEVICE).manual_seed(SEED)
    pool = torch.randn(num_pages, BLOCK_TOKENS * 2 * kv_heads * head_dim, device=DEVICE, dtype=DTYPE,
                       generator=gen)
    order = torch.randperm(num_pages, device=DEVICE, generator=gen).to(torch.int32)
    tables = torch.full((len(lengths), max(blocks)), -1, dtype=torch.int32, device=DEVICE)
    start = 0
    for b, count in enumerate(blocks):
        tables[b, :count] = order[start: start + count]
        start += count
    return pool, tables, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)


def decode_rows(name: str, shape, copy_bw: float, sweep: bool) -> list:
    """Row closures sharing one scattered KV of 64 x 2,048 tokens: default, SDPA, then the sweep."""
    heads, kv_heads, head_dim = shape
    pool, tables, lens = scattered_kv([DECODE_CONTEXT] * DECODE_BATCH, kv_heads, head_dim)
    q = torch.randn(DECODE_BATCH, heads, head_dim, device=DEVICE, dtype=DTYPE)
    scale = head_dim**-0.5
    kv_bytes = DECODE_BATCH * DECODE_CONTEXT * 2 * kv_heads * head_dim * pool.element_size()
    base = {"model": name, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "batch": DECODE_BATCH,
            "context": DECODE_CONTEXT, "block_tokens": BLOCK_TOKENS, "dtype": str(DTYPE), "kv_bytes": kv_bytes}

    def measure(bench, splits, cfg, check=False):
        fn = lambda: paged_attention_decode(q, pool, tables, lens, scale, BLOCK_TOKENS, kv_heads,
                                            num_splits=splits, config=cfg)
        record = {"bench": bench, **base, "num_splits": splits, "block_n": cfg.block_n,
                  "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        if check:
            expected = paged_attention_decode_ref(q.float(), pool.float(), tables, lens, scale, BLOCK_TOKENS, kv_heads)
            record["rel_err"] = round(((fn().float() - expected).norm() / expected.norm()).item(), 6)
        return {**record, **bandwidth_fields(time_graph(fn), kv_bytes, copy_bw)}

    default_cfg = decode_config(head_dim, on_gpu=True)
    splits = default_num_splits(DECODE_BATCH, kv_heads, DECODE_CONTEXT, q.device)
    rows = [lambda: measure("decode", splits, default_cfg, check=True),
            lambda: sdpa_decode_row(q, pool, tables, kv_heads, base, copy_bw)]
    for block_n in (64, 32, 128) if sweep else ():
        cfg = AttentionConfig(block_n=block_n, num_warps=default_cfg.num_warps, num_stages=default_cfg.num_stages)
        for num_splits in (1, 2, 4, 8):
            if (block_n, num_splits) != (default_cfg.block_n, splits):
                rows.append(lambda cfg=cfg, num_splits=num_splits: measure("decode_sweep", num_splits, cfg))
    return rows


def bandwidth_fields(seconds: float, nbytes: int, copy_bw: float) -> dict:
    return {"seconds": seconds, "bandwidth_GBps": round(nbytes / seconds / 1e9, 1),
            "copy_bandwidth_GBps": round(copy_bw / 1e9, 1), "fraction_of_copy": round(nbytes / seconds / copy_bw, 3)}


def sdpa_decode_row(q, pool, tables, kv_heads, base, copy_bw) -> dict:
    """torch SDPA over the same K/V made contiguous: ``[B, KVH, L, D]`` (no paging)."""
    batch, _, head_dim = q.shape
    kv = pool.view(pool.shape[0], 2, BLOCK_TOKENS, kv_heads, head_dim)[tables.long()]  # [B, nb, 2, bt, KVH, D]
    k = kv[:, :, 0].reshape(batch, -1, kv_heads, head_dim).transpose(1, 2).contiguous()
    v = kv[:, :, 1].reshape(batch, -1, kv_heads, head_dim).transpose(1, 2).contiguous()
    qs = q[:, :, None]
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
    return {"bench": "decode_sdpa", **base, **bandwidth_fields(time_graph(fn), base["kv_bytes"], copy_bw)}


def prefill_row(name: str, shape) -> dict:
    heads, kv_heads, head_dim = shape
    total = PREFILL_PREFIX + PREFILL_NEW
    pool, tables, seq_lens = scattered_kv([total] * PREFILL_BATCH, kv_heads, head_dim)
    q = torch.randn(PREFILL_BATCH * PREFILL_NEW, heads, head_dim, device=DEVICE, dtype=DTYPE)
    cu = torch.arange(0, PREFILL_BATCH + 1, device=DEVICE, dtype=torch.int32) * PREFILL_NEW
    fn = lambda: paged_attention_prefill(q, pool, tables, cu, seq_lens, head_dim**-0.5, BLOCK_TOKENS,
                                         kv_heads, max_q_len=PREFILL_NEW)
    seconds = time_graph(fn)
    visible_pairs = PREFILL_BATCH * sum(PREFILL_PREFIX + i + 1 for i in range(PREFILL_NEW))
    flops = 4 * heads * head_dim * visible_pairs
    return {"bench": "prefill", "model": name, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "batch": PREFILL_BATCH, "new_tokens": PREFILL_NEW, "prefix": PREFILL_PREFIX,
            "block_tokens": BLOCK_TOKENS, "dtype": str(DTYPE), "seconds": seconds, "flops": flops,
            "tflops": round(flops / seconds / 1e12, 1)}


def mixed_row(name: str, shape) -> dict:
    heads, kv_heads, head_dim = shape
    lengths = [MIXED_CONTEXT] * MIXED_DECODES + [MIXED_PROMPT] * MIXED_PROMPTS
    q_lens = [1] * MIXED_DECODES + [MIXED_PROMPT] * MIXED_PROMPTS
    pool, tables, seq_lens = scattered_kv(lengths, kv_heads, head_dim)
    q = torch.randn(sum(q_lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), device=DEVICE, dtype=torch.int32)
    scale, d = head_dim**-0.5, MIXED_DECODES
    seconds = time_graph(lambda: paged_attention_prefill(q, pool, tables, cu, seq_lens, scale, BLOCK_TOKENS,
                                                         kv_heads, max_q_len=MIXED_PROMPT))
    out = torch.empty_like(q)

    def split():  # as the decoder runs a mixed step: the leading decodes on the decode kernel
        paged_attention_decode(q[:d], pool, tables[:d], seq_lens[:d], scale, BLOCK_TOKENS, kv_heads, out=out[:d])
        paged_attention_prefill(q, pool, tables, cu, seq_lens, scale, BLOCK_TOKENS, kv_heads, out=out, skip=d)

    split_seconds = time_graph(split)
    pairs = MIXED_DECODES * MIXED_CONTEXT + MIXED_PROMPTS * MIXED_PROMPT * (MIXED_PROMPT + 1) // 2
    flops = 4 * heads * head_dim * pairs
    kv_bytes = sum(lengths) * 2 * kv_heads * head_dim * q.element_size()
    return {"bench": "prefill_mixed", "model": name, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "decodes": MIXED_DECODES, "decode_context": MIXED_CONTEXT, "prompts": MIXED_PROMPTS,
            "prompt_tokens": MIXED_PROMPT, "block_tokens": BLOCK_TOKENS, "dtype": str(DTYPE), "seconds": seconds,
            "flops": flops, "tflops": round(flops / seconds / 1e12, 1), "kv_bytes": kv_bytes,
            "kv_tb_per_s": round(kv_bytes / seconds / 1e12, 2), "split_seconds": split_seconds}


def write_kv_row(name: str, shape, copy_bw: float) -> dict:
    tokens = WRITE_TOKENS
    _, kv_heads, head_dim = shape
    pool, _, _ = scattered_kv([tokens], kv_heads, head_dim)
    k = torch.randn(tokens, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    slots = torch.randperm(pool.shape[0] * BLOCK_TOKENS, device=DEVICE)[:tokens]
    nbytes = 2 * 2 * k.numel() * k.element_size()  # K and V, read and written
    seconds = time_graph(lambda: write_kv(pool, k, v, slots))
    return {"bench": "write_kv", "model": name, "kv_heads": kv_heads, "head_dim": head_dim, "tokens": tokens,
            "block_tokens": BLOCK_TOKENS, "dtype": str(DTYPE), "bytes": nbytes,
            **bandwidth_fields(seconds, nbytes, copy_bw)}


def _attempt(out, label: str, fn, *args):
    """``fn(*args)``, or None after writing a record with an ``error`` field: one failure must not end the run."""
    try:
        return fn(*args)
    except Exception as exc:
        log.exception("row %s failed", label)
        emit({"bench": "paged_attention", "row": label, "seed": SEED, "error": repr(exc)[:500]}, out)
        return None
    finally:
        torch.cuda.empty_cache()


def _safe(out, label: str, row_fn, *args) -> None:
    record = _attempt(out, label, row_fn, *args)
    if record is not None:
        emit({"seed": SEED, **record}, out)


def run(out=None, sweep: bool = True, budget_s: float = 75.0, mixed_only: bool = False) -> None:
    """Decode headline rows first, then prefill, the mixed steps and write_kv, then the SDPA baseline and
    the decode sweep until ``budget_s`` seconds after the start."""
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernels_attention needs a CUDA GPU")
    if mixed_only:
        for name, shape in MIXED_SHAPES.items():
            _safe(out, f"prefill_mixed/{name}", mixed_row, name, shape)
        return
    start = time.monotonic()
    copy_bw = copy_bandwidth()
    emit({"bench": "copy", "seed": SEED, "copy_bandwidth_GBps": round(copy_bw / 1e9, 1)}, out)
    decode = {name: [] for name in SHAPES}
    for name, shape in SHAPES.items():
        decode[name] = _attempt(out, f"decode/{name}/setup", decode_rows, name, shape, copy_bw, sweep) or []
        for row_fn in decode[name][:1]:
            _safe(out, f"decode/{name}/0", row_fn)
    for name, shape in SHAPES.items():
        _safe(out, f"prefill/{name}", prefill_row, name, shape)
        _safe(out, f"write_kv/{name}", write_kv_row, name, shape, copy_bw)
    for name, shape in MIXED_SHAPES.items():
        _safe(out, f"prefill_mixed/{name}", mixed_row, name, shape)
    sweep_start = time.monotonic()
    for number, (name, rows) in enumerate(decode.items(), start=1):
        deadline = sweep_start + (start + budget_s - sweep_start) * number / len(decode)  # equal shares
        for index, row_fn in enumerate(rows[1:], start=1):  # SDPA baseline, then the sweep
            if time.monotonic() > deadline:
                log.info("time budget spent: %d sweep rows of %s skipped", len(rows) - index, name)
                break
            _safe(out, f"decode/{name}/{index}", row_fn)
        rows.clear()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="append JSON lines to this file (default: stdout)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the decode_sweep rows")
    parser.add_argument("--budget", type=float, default=75.0, help="seconds after which the sweep stops")
    parser.add_argument("--mixed-only", action="store_true", help="only the prefill_mixed rows")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.out:
        with open(args.out, "a") as out:
            run(out, sweep=not args.no_sweep, budget_s=args.budget, mixed_only=args.mixed_only)
    else:
        run(sys.stdout, sweep=not args.no_sweep, budget_s=args.budget, mixed_only=args.mixed_only)


if __name__ == "__main__":
    main()
