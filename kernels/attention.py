"""Paged attention (GQA) over KV blocks in the unified pool: decode and prefill.

Shape legend: B = sequences, H = query heads, KVH = key/value heads,
G = H / KVH (query heads per kv head), D = head_dim, T = query tokens of a
prefill batch, N = pages, P = page_elems, bt = block_tokens, S = splits.

KV page layout — see `unipage.kernels.kv_write`: one layer's pool is
``[N, P]``; page ``p`` viewed as ``[2, bt, KVH, D]`` holds K then V of ``bt``
tokens, and token position ``t`` of a sequence is row ``t % bt`` of page
``block_table[t // bt]``.  Block-table entries past a sequence's context are
never read, so they may hold anything (e.g. -1).

Math, for query head ``h`` (kv head ``h // G``) at absolute position ``i``,
with visible keys ``J(i) = {j : lo(i) <= j <= i}``::

    s_j    = scale * q[h] . K[j, h // G]                      for j in J(i)
    out[h] = sum_{j in J(i)} exp(s_j) V[j, h // G] / (sum_{j in J(i)} exp(s_j) + exp(sinks[h]))

``lo(i) = 0`` for full attention; with ``sliding_window = W`` it is
``max(0, i - W + 1)``: the current token and the W - 1 before it, as in
transformers' ``sliding_window_causal_mask_function`` (``j > i - W``).
``exp(sinks[h])`` is the attention sink (GPT-OSS): one learnt logit per query
head that joins the softmax as an extra column whose probability is dropped
(it has no value); without ``sinks`` that term is 0.  The key weights then
sum to less than 1, so a head may attend to "nothing".  Keys before ``lo`` of
a sequence's first query are never read: their block-table entries may
already name freed pages (or -1).

Decode: one query per sequence at position ``context_lens[b] - 1``.
Prefill (chunked, varlen): the queries of sequence ``b`` are rows
``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of ``q``; with ``q_len`` of them and
``seq_lens[b]`` context tokens in all (prefix + new, all already written
with `write_kv`), query ``i`` sits at position ``seq_lens[b] - q_len + i``.
A sequence with no context gets zeros (with or without sinks).

Kernels: fp32 accumulation, online softmax in base 2 (``scale * log2(e)``
folded into the scores).  One program serves all G query heads of one kv
head, so each K/V tile is read once per group.  Decode splits a context into
``num_splits`` ranges (flash-decoding): each program writes a normalised
partial and its log-sum-exp, and a second kernel merges them.  Prefill tiles
``BLOCK_M`` rows = ``BLOCK_M / G`` query tokens x the G heads of one kv head;
keys below the tile's first query position need no causal mask, so the key
loop runs unmasked up to there and masked over the diagonal.  A tile holds
tokens of one sequence, and ``cdiv(T, BLOCK_Q) + B`` programs per kv head
cover the rows (`_prefill_tile`) however the T tokens split into sequences:
a step of a few prompts beside many one-token decodes runs at most B programs
with nothing to do, not B x the longest prompt's tiles.  Per-step values
(lengths, block-table width, split count) are runtime arguments that Triton
does not specialise on, so a new length never recompiles (decode has two
compiled variants per shape: one split, several splits).

Sinks join the online softmax as a first "key" of logit ``sinks[h]`` and value
0 (``m = sinks[h] * log2(e)``, ``l = 1`` before the first tile); with decode
splits only the merge kernel does this, so each sink counts once.  With a
window the key loop starts at the ``BLOCK_N`` block holding ``lo`` of the
tile's first query (decode: the splits share out that block and those after
it); rows below ``lo`` in that block are masked before their block-table
entry is loaded.  A prefill tile's keys from there up to the block boundary
at or after ``lo`` of its last query get the window and causal masks; later
keys need none up to the diagonal.  The window is a runtime argument like the
lengths; sinks and window are constexpr flags, each adding compiled variants
only when used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from unipage.kernels.common import cdiv, next_pow2, num_sms
from unipage.kernels.kv_write import kv_block_tokens
from unipage.kernels.launch import launch

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the same, readable inside kernels
MIN_SPLIT_TOKENS = 256  # a decode split shorter than this costs more to merge than it saves
SEARCH_SEQS = 256  # prefill: sequence starts a program compares with its first row per loop step


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Launch parameters; `decode_config` / `prefill_config` pick defaults."""

    block_n: int = 64  # keys per loop iteration, power of two >= 16
    block_m: int = 128  # prefill: query rows (tokens x G heads) per program, power of two >= 16
    num_warps: int = 4
    num_stages: int = 2


def _check_config(cfg: AttentionConfig) -> AttentionConfig:
    for name in ("block_n", "block_m"):
        value = getattr(cfg, name)
        if not (value >= 16 and value & (value - 1) == 0):
            raise ValueError(f"config {name} must be a power of two >= 16, got {value}")
    if not (cfg.num_warps in (1, 2, 4, 8, 16) and cfg.num_stages >= 1):
        raise ValueError(f"config num_warps must be a power of two <= 16 and num_stages >= 1, got {cfg}")
    return cfg


def decode_config(head_dim: int, on_gpu: bool) -> AttentionConfig:
    if not on_gpu:  # interpreter: small tiles keep tests fast and cross page boundaries
        return AttentionConfig(block_n=16, block_m=16)
    return AttentionConfig(block_n=64, num_warps=4, num_stages=3 if head_dim <= 64 else 2)


def prefill_config(head_dim: int, on_gpu: bool) -> AttentionConfig:
    if not on_gpu:
        return AttentionConfig(block_n=16, block_m=16)
    return AttentionConfig(block_n=64, block_m=128, num_warps=4 if head_dim <= 64 else 8, num_stages=2)


# ----------------------------------------------------------------------------- shared device code


@triton.jit
def _kv_tile(pool_ptr, table_ptr, n0, start, limit, kvh, offs_n, offs_d, BT: tl.constexpr, KVH: tl.constexpr,
             D: tl.constexpr, LOWER: tl.constexpr):
    """K and V ``[BLOCK_N, D]`` of positions ``pos = n0 + offs_n`` and the mask ``valid [BLOCK_N]``: rows
    outside ``[start, limit)`` read as 0 without touching their block-table entry (``start`` only if LOWER)."""
    pos = n0 + offs_n
    valid = pos < limit
    if LOWER:
        valid = valid & (pos >= start)
    page = tl.load(table_ptr + pos // BT, mask=valid, other=0).to(tl.int64)
    row_off = page * (2 * BT * KVH * D) + (pos % BT) * (KVH * D) + kvh * D
    ptrs = pool_ptr + row_off[:, None] + offs_d[None, :]
    k = tl.load(ptrs, mask=valid[:, None], other=0.0)
    v = tl.load(ptrs + BT * KVH * D, mask=valid[:, None], other=0.0)
    return k, v, pos, valid


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One online-softmax update with log2-domain scores ``s [M, BLOCK_N]`` (masked = -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _scores(q, k, scale_log2, PRECISION: tl.constexpr):
    return tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2


@triton.jit
def _softmax_init(sinks_ptr, head, head_ok, M: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Online-softmax state ``m, l [M]`` before the first key: empty, or the sink as a key of value 0."""
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=head_ok, other=0.0).to(tl.float32) * _LOG2E
        l_i = tl.full([M], 1.0, tl.float32)
    else:
        m_i = tl.full([M], -1.0e30, tl.float32)
        l_i = tl.zeros([M], tl.float32)
    return m_i, l_i


# ----------------------------------------------------------------------------- decode


@triton.jit(do_not_specialize=["stride_table", "num_splits", "window"])
def _decode_kernel(
    q_ptr,  # [B, H, D], last stride 1
    pool_ptr,  # [N, P] contiguous
    table_ptr,  # [B, max_blocks] int32, last stride 1
    ctx_ptr,  # [B] int32
    sinks_ptr,  # [H] fp32 (HAS_SINKS and not SPLIT)
    out_ptr,  # [B, H, D] contiguous (num_splits == 1)
    part_out_ptr,  # [B, H, S, D] fp32 (num_splits > 1)
    part_lse_ptr,  # [B, H, S] fp32, log2 domain
    stride_qb, stride_qh, stride_table, num_splits,
    window,  # int >= 1 (WINDOWED)
    scale_log2,
    H: tl.constexpr, KVH: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr,
    BT: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr, WINDOWED: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    if WINDOWED:  # the query at ctx - 1 sees keys [start, ctx); splits cover whole blocks from start's
        start = tl.maximum(ctx - window, 0)
        first = start // BLOCK_N * BLOCK_N
        split_len = tl.cdiv(tl.cdiv(ctx - first, num_splits), BLOCK_N) * BLOCK_N
        lo = first + split * split_len
    else:
        start = 0
        split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx)
    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + offs_g
    head_ok = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=head_ok[:, None], other=0.0)
    table_ptr += b.to(tl.int64) * stride_table
    if SPLIT:  # the merge adds the sink
        m_i, l_i = _softmax_init(sinks_ptr, head, head_ok, GROUP_P, False)
    else:
        m_i, l_i = _softmax_init(sinks_ptr, head, head_ok, GROUP_P, HAS_SINKS)
    acc = tl.zeros([GROUP_P, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        k, v, _, valid = _kv_tile(pool_ptr, table_ptr, n0, start, hi, kvh, offs_n, offs_d, BT, KVH, D, WINDOWED)
        s = _scores(q, k, scale_log2, PRECISION)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PRECISION)
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    row = b * H + head  # [GROUP_P]
    if SPLIT:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row * num_splits + split, lse, mask=head_ok)
        part = part_out_ptr + (row * num_splits + split)[:, None].to(tl.int64) * D + offs_d[None, :]
        tl.store(part, out, mask=head_ok[:, None])
    else:
        tl.store(out_ptr + row[:, None].to(tl.int64) * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_out_ptr,  # [B, H, S, D] fp32
    part_lse_ptr,  # [B, H, S] fp32, log2 domain
    sinks_ptr,  # [H] fp32 (HAS_SINKS)
    out_ptr,  # [B, H, D] contiguous
    num_splits, H: tl.constexpr, D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    offs_d = tl.arange(0, D)
    # the sink is one more partial, of log-sum-exp sinks[h] and output 0, merged once here
    m, total = _softmax_init(sinks_ptr, row % H + offs_d * 0, offs_d >= 0, D, HAS_SINKS)
    acc = tl.zeros([D], tl.float32)
    for split in range(num_splits):
        lse = tl.load(part_lse_ptr + row * num_splits + split)
        part = tl.load(part_out_ptr + (row * num_splits + split) * D + offs_d)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        total = total * alpha + weight
        acc = acc * alpha + weight * part
        m = m_new
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + row * D + offs_d, out.to(out_ptr.dtype.element_ty))


def _check_common(q, pool, block_tables, scale, block_tokens, num_kv_heads) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [.., H, D], got shape {tuple(q.shape)}")
    heads, head_dim = q.shape[1], q.shape[2]
    if not (num_kv_heads >= 1 and heads % num_kv_heads == 0):
        raise ValueError(f"num_kv_heads {num_kv_heads} must divide the {heads} query heads")
    if not (head_dim >= 16 and head_dim & (head_dim - 1) == 0):
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
    if kv_block_tokens(pool, num_kv_heads, head_dim) != block_tokens:
        raise ValueError(f"pool page of {pool.shape[-1]} elements is not block_tokens {block_tokens} x 2 x "
           f"num_kv_heads {num_kv_heads} x head_dim {head_dim}")
    if q.dtype != pool.dtype:
        raise ValueError(f"q dtype {q.dtype} != pool dtype {pool.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if not (block_tables.dim() == 2 and block_tables.dtype == torch.int32):
        raise ValueError(f"block_tables must be [B, max_blocks] int32, "
                         f"got {tuple(block_tables.shape)} {block_tables.dtype}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite float, got {scale}")


def _check_lengths(name: str, lengths: torch.Tensor, batch: int) -> None:
    if not (lengths.shape == (batch,) and lengths.dtype == torch.int32):
        raise ValueError(f"{name} must be [B={batch}] int32, got {tuple(lengths.shape)} {lengths.dtype}")


def _check_launch(q, pool, block_tables, *lengths) -> None:
    devices = {t.device for t in (q, pool, block_tables, *lengths)}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {devices}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    if q.stride(2) != 1:
        raise ValueError("q needs a contiguous last dim")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables needs a contiguous last dim")
    if not all(t.is_contiguous() for t in lengths):
        raise ValueError("length tensors must be contiguous")


def _check_sinks_window(sinks: torch.Tensor | None, sliding_window: int | None, q: torch.Tensor) -> int:
    """Validate the optional GPT-OSS arguments; returns the window, 0 for full attention."""
    if sinks is not None:
        if not (sinks.shape == (q.shape[1],) and sinks.dtype == torch.float32):
            raise ValueError(f"sinks must be [H={q.shape[1]}] float32, got {tuple(sinks.shape)} {sinks.dtype}")
        if not (sinks.device == q.device and sinks.is_contiguous()):
            raise ValueError(f"sinks must be contiguous on {q.device}, got {sinks.device}")
    window = 0 if sliding_window is None else sliding_window
    if not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
        raise ValueError(f"sliding_window must be None or an int >= 0 (0 = full attention), got {sliding_window!r}")
    return window


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per (sequence, kv head): about four programs per SM, no split under MIN_SPLIT_TOKENS."""
    want = cdiv(4 * num_sms(device), max(1, batch * num_kv_heads))
    return max(1, min(want, max_context // MIN_SPLIT_TOKENS, 64))


def paged_attention_decode(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, block_tokens: int, num_kv_heads: int,
                           *, num_splits: int | None = None, config: AttentionConfig | None = None,
                           out: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                           sliding_window: int | None = None) -> torch.Tensor:
    """One decode step of attention for B sequences; returns ``out [B, H, D]`` (q's dtype).

    q: [B, H, D], last dim contiguous.  pool: [N, P] one layer, contiguous, q's dtype.
    block_tables: [B, max_blocks] int32 page ids.  context_lens: [B] int32, tokens in the
    pool per sequence incl. the current one, <= max_blocks * block_tokens (not checked).
    num_splits: context ranges per sequence (flash-decoding); default from
    `default_num_splits` with ``max_blocks * block_tokens`` (or the window, if smaller) as
    the context bound (no sync).
    out: optional [B, H, D] contiguous, q's dtype, written and returned.
    sinks: optional [H] float32 contiguous, finite: one attention-sink logit per query head.
    sliding_window: optional int W >= 1: the query at position ``i`` sees keys ``i - W < j <= i``;
    None or 0 = full attention.  Block-table entries of pages wholly before the window are not read.
    """
    _check_common(q, pool, block_tables, scale, block_tokens, num_kv_heads)
    batch, heads, head_dim = q.shape
    _check_lengths("context_lens", context_lens, batch)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for B={batch}")
    _check_launch(q, pool, block_tables, context_lens)
    window = _check_sinks_window(sinks, sliding_window, q)
    if num_splits is None:
        max_context = block_tables.shape[1] * block_tokens
        num_splits = default_num_splits(batch, num_kv_heads, min(max_context, window or max_context), q.device)
    if not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits}")
    cfg = _check_config(config or decode_config(head_dim, q.is_cuda))
    out = _output(out, q, contiguous=True)
    if batch == 0:
        return out
    split = num_splits > 1
    part_out = torch.empty((batch, heads, num_splits, head_dim) if split else (1,), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((batch, heads, num_splits) if split else (1,), dtype=torch.float32, device=q.device)
    group = heads // num_kv_heads
    sinks_arg = q if sinks is None else sinks  # never read without sinks
    launch(_decode_kernel, (batch, num_kv_heads, num_splits),
        q, pool, block_tables, context_lens, sinks_arg, out, part_out, part_lse,
        q.stride(0), q.stride(1), block_tables.stride(0), num_splits, window, scale * LOG2E,
        H=heads, KVH=num_kv_heads, GROUP=group, GROUP_P=max(16, next_pow2(group)), D=head_dim,
        BT=block_tokens, BLOCK_N=cfg.block_n, SPLIT=split, PRECISION=_precision(q.dtype),
        HAS_SINKS=sinks is not None, WINDOWED=window > 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        launch(_merge_splits_kernel, (batch * heads,), part_out, part_lse, sinks_arg, out, num_splits,
               H=heads, D=head_dim, HAS_SINKS=sinks is not None, num_warps=1)
    return out


def _check_skip(skip: int, batch: int, tokens: int) -> None:
    if not (isinstance(skip, int) and 0 <= skip <= min(batch, tokens)):
        raise ValueError(f"skip must be an int in [0, min(B={batch}, T={tokens})], got {skip!r}")


def _output(out: torch.Tensor | None, q: torch.Tensor, contiguous: bool) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not (out.shape == q.shape and out.dtype == q.dtype and out.device == q.device):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if not (out.is_contiguous() if contiguous else out.stride(2) == 1):
        raise ValueError("out must be contiguous" if contiguous else "out needs a contiguous last dim")
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # only fp32 inputs read it


# ----------------------------------------------------------------------------- prefill


@triton.jit
def _load_query_rows(q_ptr, q_start, first, end, kvh, stride_qt, stride_qh, offs_m, offs_d,
                     GROUP: tl.constexpr, GROUP_P: tl.constexpr):
    """Rows ``r`` = (token ``first + r // GROUP_P``, head ``kvh * GROUP + r % GROUP_P``) of the sequence whose
    rows of ``q`` start at ``q_start``; tokens from ``end`` on are masked."""
    token = first + offs_m // GROUP_P
    head = kvh * GROUP + offs_m % GROUP_P
    row_ok = (token < end) & (offs_m % GROUP_P < GROUP)
    ptrs = q_ptr + (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    return ptrs, row_ok, token


@triton.jit
def _prefill_tile(cu_q_ptr, num_seqs, num_tokens, skip, BLOCK_Q: tl.constexpr, SEARCH: tl.constexpr):
    """``(b, first, end)``: this program's sequence and its token range ``[first, end)`` (relative to the
    sequence's first row), ``end <= first`` when the program has none.

    Rows from ``skip`` on (the first ``skip`` sequences, one row each, are left out) are cut into tiles of
    BLOCK_Q: program ``p < cdiv(T - skip, BLOCK_Q)`` takes tile ``p``'s rows as far as the sequence holding
    its first row goes, and program ``cdiv(T - skip, BLOCK_Q) + j`` takes sequence ``skip + j``'s rows before
    the first tile boundary at or after its start.  Together they cover every row once, in
    ``cdiv(T - skip, BLOCK_Q) + B - skip`` programs whatever the lengths (a grid of B x the longest
    sequence's tiles would be mostly empty programs when a few prompts share a step with many decodes)."""
    pid = tl.program_id(0)
    aligned = tl.cdiv(num_tokens - skip, BLOCK_Q)
    if pid < aligned:
        row = skip + pid * BLOCK_Q
        count = tl.zeros([SEARCH], tl.int32)  # sequences from skip on starting at or before row, per lane
        for c in range(skip, num_seqs + 1, SEARCH):
            offs = c + tl.arange(0, SEARCH)
            starts = tl.load(cu_q_ptr + offs, mask=offs <= num_seqs, other=num_tokens + 1)
            count += (starts <= row).to(tl.int32)
        b = skip + tl.sum(count) - 1
        lo = row
        hi = row + BLOCK_Q
    else:
        b = skip + pid - aligned
        lo = tl.load(cu_q_ptr + b)
        hi = skip + tl.cdiv(lo - skip, BLOCK_Q) * BLOCK_Q
    q_start = tl.load(cu_q_ptr + b)
    q_end = tl.minimum(tl.load(cu_q_ptr + b + 1), hi)
    return b, lo - q_start, q_end - q_start


@triton.jit(do_not_specialize=["stride_table", "window", "num_seqs", "num_tokens", "skip"])
def _prefill_kernel(
    q_ptr,  # [T, H, D], last stride 1
    pool_ptr,  # [N, P] contiguous
    table_ptr,  # [B, max_blocks] int32, last stride 1
    cu_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    sinks_ptr,  # [H] fp32 (HAS_SINKS)
    out_ptr,  # [T, H, D], last stride 1
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    window,  # int >= 1 (WINDOWED)
    scale_log2,
    num_seqs, num_tokens, skip,  # B, T, leading one-row sequences left out
    KVH: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr, WINDOWED: tl.constexpr, SEARCH: tl.constexpr,
):
    kvh = tl.program_id(1)
    BLOCK_Q = BLOCK_M // GROUP_P  # query tokens per tile
    b, first, end = _prefill_tile(cu_q_ptr, num_seqs, num_tokens, skip, BLOCK_Q, SEARCH)
    if end <= first:
        return
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q_ptrs, row_ok, token = _load_query_rows(q_ptr, q_start, first, end, kvh, stride_qt, stride_qh, offs_m, offs_d,
                                             GROUP, GROUP_P)
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    q_pos = prefix + token  # [BLOCK_M]
    # keys [0, full_end) precede every query of this tile: no mask needed there
    hi = prefix + end
    full_end = tl.minimum((prefix + first) // BLOCK_N * BLOCK_N, hi // BLOCK_N * BLOCK_N)
    table_ptr += b.to(tl.int64) * stride_table
    head = kvh * GROUP + offs_m % GROUP_P
    m_i, l_i = _softmax_init(sinks_ptr, head, offs_m % GROUP_P < GROUP, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if WINDOWED:
        # keys [start, mid): in the window of some but not all queries (start = the first query's window
        # start; from mid on, whole blocks lie in the last query's window too).  Rows below start are
        # not read.  [mid, full_end) then needs no mask, [full_end, hi) the causal one.
        start = tl.maximum(prefix + first - window + 1, 0)
        mid = tl.maximum(tl.cdiv(tl.maximum(hi - window, 0), BLOCK_N), start // BLOCK_N) * BLOCK_N
        for n0 in range(start // BLOCK_N * BLOCK_N, tl.minimum(mid, hi), BLOCK_N):
            k, v, pos, valid = _kv_tile(pool_ptr, table_ptr, n0, start, hi, kvh, offs_n, offs_d, BT, KVH, D, True)
            seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window) & valid[None, :]
            s = tl.where(seen, _scores(q, k, scale_log2, PRECISION), float("-inf"))
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PRECISION)
        full_end = tl.maximum(full_end, mid)
    else:
        mid = 0
    for n0 in range(mid, full_end, BLOCK_N):
        k, v, pos, valid = _kv_tile(pool_ptr, table_ptr, n0, 0, hi, kvh, offs_n, offs_d, BT, KVH, D, False)
        m_i, l_i, acc = _softmax_step(_scores(q, k, scale_log2, PRECISION), v, m_i, l_i, acc, PRECISION)
    for n0 in range(full_end, hi, BLOCK_N):
        k, v, pos, valid = _kv_tile(pool_ptr, table_ptr, n0, 0, hi, kvh, offs_n, offs_d, BT, KVH, D, False)
        causal = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        s = tl.where(causal, _scores(q, k, scale_log2, PRECISION), float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_attention_prefill(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_tokens: int,
                            num_kv_heads: int, *, max_q_len: int | None = None,
                            config: AttentionConfig | None = None, out: torch.Tensor | None = None,
                            sinks: torch.Tensor | None = None, sliding_window: int | None = None,
                            skip: int = 0) -> torch.Tensor:
    """Causal attention of new tokens over their whole context; returns ``out [T, H, D]`` (q's dtype).

    q: [T, H, D], last dim contiguous, the new tokens of B sequences back to back.
    pool: [N, P] one layer, contiguous, q's dtype; the new tokens' K/V already written.
    block_tables: [B, max_blocks] int32.  cu_seqlens_q: [B + 1] int32, row offsets of the
    sequences in q (cu[0] = 0, cu[B] = T).  seq_lens: [B] int32, total context per
    sequence (prefix + new), >= its query count.  max_q_len: the largest query count; not
    needed (the grid follows T and B alone), taken for callers that have it.
    out: optional [T, H, D], last dim contiguous, q's dtype, written and returned.
    sinks: optional [H] float32 contiguous, finite: one attention-sink logit per query head.
    sliding_window: optional int W >= 1: the query at position ``i`` sees keys ``i - W < j <= i``;
    None or 0 = full attention.  Block-table entries of pages wholly before the window of a
    sequence's first new token are not read.
    skip: the first ``skip`` sequences have one new token each (rows ``0 .. skip - 1``) and are left
    out, their rows of ``out`` not written (the engine gives them to `paged_attention_decode`).
    """
    _check_common(q, pool, block_tables, scale, block_tokens, num_kv_heads)
    batch = block_tables.shape[0]
    _check_skip(skip, batch, q.shape[0])
    _check_lengths("seq_lens", seq_lens, batch)
    if not (cu_seqlens_q.shape == (batch + 1,) and cu_seqlens_q.dtype == torch.int32):
        raise ValueError(f"cu_seqlens_q must be [B+1={batch + 1}] int32, "
                         f"got {tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}")
    _check_launch(q, pool, block_tables, seq_lens, cu_seqlens_q)
    window = _check_sinks_window(sinks, sliding_window, q)
    tokens, heads, head_dim = q.shape
    out = _output(out, q, contiguous=False)
    if batch == skip or tokens == 0:
        return out
    cfg = _check_config(config or prefill_config(head_dim, q.is_cuda))
    group = heads // num_kv_heads
    group_p = next_pow2(group)
    block_m = max(cfg.block_m, group_p, 16)
    grid = (cdiv(tokens - skip, block_m // group_p) + batch - skip, num_kv_heads)  # see `_prefill_tile`
    launch(_prefill_kernel, grid,
        q, pool, block_tables, cu_seqlens_q, seq_lens, q if sinks is None else sinks, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), window, scale * LOG2E,
        batch, tokens, skip,
        KVH=num_kv_heads, GROUP=group, GROUP_P=group_p, D=head_dim, BT=block_tokens,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, PRECISION=_precision(q.dtype),
        HAS_SINKS=sinks is not None, WINDOWED=window > 0, SEARCH=SEARCH_SEQS,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
