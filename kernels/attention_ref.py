"""Torch references of the paged attention kernels (`attention`): the same signatures and checks, fp32
attention per sequence over its pages gathered (`gather_kv`, `attend_ref`)."""

from __future__ import annotations

import torch
from unipage.kernels.attention import (AttentionConfig, _check_common, _check_lengths, _check_sinks_window,
                                       _check_skip, _output)
from unipage.kernels.common import cdiv


def gather_kv(pool: torch.Tensor, block_table: torch.Tensor, length: int, block_tokens: int,
              num_kv_heads: int, *, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[length - start, KVH, D]`` of positions ``[start, length)`` of one sequence, read through
    ``block_table [max_blocks]`` (entries before ``start // block_tokens`` are not read)."""
    head_dim = pool.shape[1] // (2 * block_tokens * num_kv_heads)
    first = start // block_tokens
    pages = block_table[first: cdiv(length, block_tokens)].long()
    kv = pool.view(pool.shape[0], 2, block_tokens, num_kv_heads, head_dim)[pages]  # [n, 2, bt, KVH, D]
    skip = start - first * block_tokens
    k = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[skip: length - first * block_tokens]
    v = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[skip: length - first * block_tokens]
    return k, v


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, *,
               k_start: int = 0, sinks: torch.Tensor | None = None, sliding_window: int | None = None
               ) -> torch.Tensor:
    """fp32 GQA attention of ``q [M, H, D]`` at positions ``q_pos [M]`` over ``k, v [L, KVH, D]`` at
    positions ``k_start + j``, visible when ``q_pos - W < k_start + j <= q_pos`` (W = sliding_window, no
    lower bound when None/0); ``sinks [H]`` adds ``exp(sinks[h])`` to each softmax denominator.
    Returns ``[M, H, D]`` fp32, zeros when L = 0."""
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] == 0:
        return torch.zeros(rows, heads, head_dim, dtype=torch.float32, device=q.device)
    qg = q.float().view(rows, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("mkgd,lkd->kgml", qg, k.float()) * scale
    k_pos = k_start + torch.arange(k.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]  # [M, L]
    if sliding_window:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more column per row, dropped after the softmax
        sink = sinks.float().view(kv_heads, heads // kv_heads, 1, 1).expand(-1, -1, rows, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("kgml,lkd->mkgd", probs, v.float()).reshape(rows, heads, head_dim)


def _window_start(first_query: int, sliding_window: int | None) -> int:
    """First key position in the window of the query at ``first_query``."""
    return max(0, first_query - sliding_window + 1) if sliding_window else 0


def paged_attention_decode_ref(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, block_tokens: int, num_kv_heads: int,
                               *, num_splits: int | None = None,
                               config: AttentionConfig | None = None,
                               out: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                               sliding_window: int | None = None) -> torch.Tensor:
    """Torch reference of `paged_attention_decode` (num_splits and config are ignored)."""
    _check_common(q, pool, block_tables, scale, block_tokens, num_kv_heads)
    _check_lengths("context_lens", context_lens, q.shape[0])
    window = _check_sinks_window(sinks, sliding_window, q)
    out = _output(out, q, contiguous=True)
    for b, length in enumerate(context_lens.tolist()):
        start = _window_start(length - 1, window)
        k, v = gather_kv(pool, block_tables[b], length, block_tokens, num_kv_heads, start=start)
        q_pos = torch.tensor([length - 1], device=q.device)
        out[b] = attend_ref(q[b: b + 1], k, v, q_pos, scale, k_start=start, sinks=sinks,
                            sliding_window=window)[0].to(q.dtype)
    return out


def paged_attention_prefill_ref(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_tokens: int,
                                num_kv_heads: int, *, max_q_len: int | None = None,
                                config: AttentionConfig | None = None,
                                out: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                                sliding_window: int | None = None, skip: int = 0) -> torch.Tensor:
    """Torch reference of `paged_attention_prefill` (max_q_len and config are ignored)."""
    _check_common(q, pool, block_tables, scale, block_tokens, num_kv_heads)
    _check_lengths("seq_lens", seq_lens, block_tables.shape[0])
    _check_skip(skip, block_tables.shape[0], q.shape[0])
    window = _check_sinks_window(sinks, sliding_window, q)
    out = _output(out, q, contiguous=False)
    starts = cu_seqlens_q.tolist()
    if starts[skip] != skip:
        raise ValueError(f"the first skip={skip} sequences must have one new token each, got query offsets "
                         f"{starts[:skip + 1]}")
    for b, length in enumerate(seq_lens.tolist()):
        if b < skip:
            continue
        lo, hi = starts[b], starts[b + 1]
        start = _window_start(length - (hi - lo), window)
        k, v = gather_kv(pool, block_tables[b], length, block_tokens, num_kv_heads, start=start)
        q_pos = torch.arange(length - (hi - lo), length, device=q.device)
        out[lo:hi] = attend_ref(q[lo:hi], k, v, q_pos, scale, k_start=start, sinks=sinks,
                                sliding_window=window).to(q.dtype)
    return out
