"""Paged attention and write_kv: Triton (interpreter on CPU) vs the torch references,
and the references vs torch's scaled_dot_product_attention on contiguous K/V.

Every scenario scatters each sequence's pages over a shuffled pool whose other
pages hold random noise; block-table entries past a context hold garbage page
ids that must never be read; outputs are poisoned with NaN before each call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from unipage.kernels.attention import AttentionConfig, paged_attention_decode, paged_attention_prefill
from unipage.kernels.attention_ref import gather_kv, paged_attention_decode_ref, paged_attention_prefill_ref
from unipage.kernels.kv_write import write_kv, write_kv_ref

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


@dataclass
class Scene:
    pool: torch.Tensor  # [N, P]
    tables: torch.Tensor  # [B, max_blocks] int32
    lengths: torch.Tensor  # [B] int32
    keys: list  # per sequence [L, KVH, D]
    values: list
    block_tokens: int
    num_kv_heads: int


def slots_of(table: torch.Tensor, positions: torch.Tensor, block_tokens: int) -> torch.Tensor:
    return table.long()[positions // block_tokens] * block_tokens + positions % block_tokens


def make_scene(lengths, block_tokens=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=0,
               spare_pages=9, device="cpu") -> Scene:
    """Sequences of ``lengths`` tokens with K/V written to shuffled pages of a noisy pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / block_tokens) for n in lengths]
    num_pages = sum(blocks) + spare_pages
    page_elems = block_tokens * 2 * num_kv_heads * head_dim
    pool = torch.randn(num_pages, page_elems, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.randint(-(2**20), 2**20, (len(lengths), max(blocks, default=0) + 2), generator=gen)
    keys, values = [], []
    for b, n in enumerate(lengths):
        tables[b, : blocks[b]] = torch.tensor(order[: blocks[b]], dtype=torch.long)
        order = order[blocks[b]:]
        keys.append(torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype))
        write_kv_ref(pool, keys[b], values[b], slots_of(tables[b], torch.arange(n), block_tokens))
    return Scene(pool.to(device), tables.to(torch.int32).to(device),
                 torch.tensor(lengths, dtype=torch.int32, device=device),
                 [k.to(device) for k in keys], [v.to(device) for v in values], block_tokens, num_kv_heads)


def varlen(q_lens, device="cpu") -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def sdpa(q, k, v, q_pos, scale) -> torch.Tensor:
    """SDPA over contiguous K/V: ``q [M, H, D]`` at ``q_pos``, ``k, v [L, KVH, D]`` -> ``[M, H, D]`` fp32."""
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close(actual, expected, dtype) -> None:
    assert not actual.isnan().any(), "output has unwritten (NaN) elements"
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


LENGTHS = [1, 3, 4, 5, 7, 8, 9, 40]  # 1, block boundaries +-1 (block_tokens 4), long


# ----------------------------------------------------------------------------- references vs SDPA


def test_decode_reference_matches_sdpa():
    scene = make_scene(LENGTHS, head_dim=32)
    q = torch.randn(len(LENGTHS), 4, 32)
    out = paged_attention_decode_ref(q, scene.pool, scene.tables, scene.lengths, 0.2, 4, 2)
    for b, n in enumerate(LENGTHS):
        expected = sdpa(q[b: b + 1], scene.keys[b], scene.values[b], torch.tensor([n - 1]), 0.2)
        torch.testing.assert_close(out[b: b + 1], expected, atol=1e-5, rtol=1e-5)


def test_prefill_reference_matches_sdpa():
    q_lens = [1, 5, 4, 9, 17]
    scene = make_scene([1, 9, 8, 20, 40])
    q = torch.randn(sum(q_lens), 4, 16)
    cu = varlen(q_lens)
    out = paged_attention_prefill_ref(q, scene.pool, scene.tables, cu, scene.lengths, 0.3, 4, 2)
    for b, n in enumerate(scene.lengths.tolist()):
        rows = slice(cu[b], cu[b + 1])
        expected = sdpa(q[rows], scene.keys[b], scene.values[b], torch.arange(n - q_lens[b], n), 0.3)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference_and_skips(dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim, bt = 11, 4, 2, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(tokens, kv_heads, dim)  # strided views
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(12 * bt, generator=gen)[:tokens]
    slots[[2, 7]] = -1
    pool = torch.randn(12, bt * 2 * kv_heads * dim, generator=gen).to(dtype)
    expected = pool.clone()
    write_kv_ref(expected, k, v, slots)
    write_kv(pool, k, v, slots)
    assert torch.equal(pool, expected)
    page, row = slots[0] // bt, slots[0] % bt
    assert torch.equal(pool[page].view(2, bt, kv_heads, dim)[1, row], v[0])


def test_write_kv_then_read_back():
    scene = make_scene([13, 6], dtype=torch.float16)
    pool = scene.pool.clone()
    new_k = torch.randn(6, 2, 16, dtype=torch.float16)
    new_v = torch.randn(6, 2, 16, dtype=torch.float16)
    write_kv(pool, new_k, new_v, slots_of(scene.tables[1], torch.arange(6), 4))
    k0, v0 = gather_kv(pool, scene.tables[0], 13, 4, 2)
    k1, v1 = gather_kv(pool, scene.tables[1], 6, 4, 2)
    assert torch.equal(k0, scene.keys[0]) and torch.equal(v0, scene.values[0])
    assert torch.equal(k1, new_k) and torch.equal(v1, new_v)


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_matches_reference(dtype, head_dim, num_splits):
    scene = make_scene(LENGTHS, head_dim=head_dim, dtype=dtype, seed=head_dim)
    q = torch.randn(len(LENGTHS), 4, head_dim).to(dtype)
    out = poisoned(q.shape, dtype)
    got = paged_attention_decode(q, scene.pool, scene.tables, scene.lengths, 0.25, 4, 2, num_splits=num_splits,
                                 out=out)
    assert got is out
    expected = paged_attention_decode_ref(q, scene.pool, scene.tables, scene.lengths, 0.25, 4, 2)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("heads,kv_heads,block_tokens,block_n", [(8, 1, 4, 32), (4, 4, 32, 16), (6, 2, 8, 16)])
def test_decode_group_and_tile_shapes(heads, kv_heads, block_tokens, block_n):
    """MQA (G=8), MHA (G=1), tiles smaller than a page, and a non-power-of-two group (G=3)."""
    lengths = [1, block_tokens - 1, block_tokens + 1, 70]
    scene = make_scene(lengths, block_tokens=block_tokens, num_kv_heads=kv_heads, seed=5)
    q = torch.randn(len(lengths), heads, 16)
    out = poisoned(q.shape, torch.float32)
    paged_attention_decode(q, scene.pool, scene.tables, scene.lengths, 0.25, block_tokens, kv_heads,
                           num_splits=2, config=AttentionConfig(block_n=block_n), out=out)
    expected = paged_attention_decode_ref(q, scene.pool, scene.tables, scene.lengths, 0.25, block_tokens, kv_heads)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_empty_context_gives_zeros(num_splits):
    scene = make_scene([5, 1, 9])
    lengths = scene.lengths.clone()
    lengths[1] = 0
    q = torch.randn(3, 4, 16)
    out = paged_attention_decode(q, scene.pool, scene.tables, lengths, 0.25, 4, 2, num_splits=num_splits,
                                 out=poisoned(q.shape, torch.float32))
    assert torch.equal(out[1], torch.zeros(4, 16))
    assert_close(out, paged_attention_decode_ref(q, scene.pool, scene.tables, lengths, 0.25, 4, 2), torch.float32)


def test_decode_strided_query():
    scene = make_scene([6, 21], head_dim=16)
    qkv = torch.randn(2, (4 + 2 * 2) * 16)
    q = qkv[:, : 4 * 16].view(2, 4, 16)
    out = paged_attention_decode(q, scene.pool, scene.tables, scene.lengths, 0.25, 4, 2)
    assert_close(out, paged_attention_decode_ref(q, scene.pool, scene.tables, scene.lengths, 0.25, 4, 2),
                 torch.float32)


# ----------------------------------------------------------------------------- prefill


PREFILL_CASES = [  # (prefix already in the pool, new tokens)
    (0, 1), (0, 9), (3, 5), (4, 4), (7, 1), (20, 17), (0, 40), (5, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_prefill_matches_reference(dtype, head_dim):
    q_lens = [new for _, new in PREFILL_CASES]
    scene = make_scene([p + n for p, n in PREFILL_CASES], head_dim=head_dim, dtype=dtype, seed=head_dim + 1)
    q = torch.randn(sum(q_lens), 4, head_dim).to(dtype)
    cu = varlen(q_lens)
    out = poisoned(q.shape, dtype)
    got = paged_attention_prefill(q, scene.pool, scene.tables, cu, scene.lengths, 0.2, 4, 2, out=out)
    assert got is out
    expected = paged_attention_prefill_ref(q, scene.pool, scene.tables, cu, scene.lengths, 0.2, 4, 2)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("heads,kv_heads,block_tokens,cfg", [
    (8, 1, 4, AttentionConfig(block_n=16, block_m=16)),  # 2 tokens x 8 heads per tile
    (4, 4, 32, AttentionConfig(block_n=16, block_m=32)),  # tiles smaller than a page
    (6, 2, 8, AttentionConfig(block_n=32, block_m=16)),  # G=3 padded to 4
])
def test_prefill_group_and_tile_shapes(heads, kv_heads, block_tokens, cfg):
    cases = [(0, 3), (block_tokens, block_tokens + 1), (33, 30)]
    q_lens = [n for _, n in cases]
    scene = make_scene([p + n for p, n in cases], block_tokens=block_tokens, num_kv_heads=kv_heads, seed=7)
    q = torch.randn(sum(q_lens), heads, 16)
    cu = varlen(q_lens)
    out = poisoned(q.shape, torch.float32)
    paged_attention_prefill(q, scene.pool, scene.tables, cu, scene.lengths, 0.2, block_tokens, kv_heads,
                            max_q_len=max(q_lens), config=cfg, out=out)
    expected = paged_attention_prefill_ref(q, scene.pool, scene.tables, cu, scene.lengths, 0.2, block_tokens,
                                           kv_heads)
    assert_close(out, expected, torch.float32)


MIXED_STEP = [(5, 1)] * 6 + [(0, 13), (2, 0), (9, 1), (3, 21), (4, 1), (0, 0), (7, 1), (0, 8)] + [(6, 1)] * 5


@pytest.mark.parametrize("search, split", [(256, False), (4, False), (4, True), (256, True)])
def test_prefill_of_a_mixed_step(monkeypatch, search, split):
    """A mixed step's layout: one-token decodes around prompts whose rows start off the tile grid, and sequences
    with no new token.  Every row is written (by exactly one program: the output starts as NaN and the rows of a
    program that wrote another sequence's rows would differ).  ``search`` 4: the programs find their sequence
    over several chunks of the sequence starts.  ``split``: the six leading decodes go to the decode kernel and
    the prefill kernel skips them, as the engine does."""
    from unipage.kernels import attention
    monkeypatch.setattr(attention, "SEARCH_SEQS", search)
    q_lens = [n for _, n in MIXED_STEP]
    scene = make_scene([p + n for p, n in MIXED_STEP], seed=12)
    q = torch.randn(sum(q_lens), 4, 16)
    cu = varlen(q_lens)
    out = poisoned(q.shape, torch.float32)
    cfg = AttentionConfig(block_n=16, block_m=16)  # 8 tokens x 2 heads per tile
    skip = 6 if split else 0
    paged_attention_prefill(q, scene.pool, scene.tables, cu, scene.lengths, 0.2, 4, 2, config=cfg, out=out,
                            skip=skip)
    assert out[:skip].isnan().all()
    if split:
        paged_attention_decode(q[:skip], scene.pool, scene.tables[:skip], scene.lengths[:skip], 0.2, 4, 2,
                               out=out[:skip])
    want = paged_attention_prefill_ref(q, scene.pool, scene.tables, cu, scene.lengths, 0.2, 4, 2)
    assert_close(out, want, torch.float32)
    ref_skipped = paged_attention_prefill_ref(q, scene.pool, scene.tables, cu, scene.lengths, 0.2, 4, 2,
                                              out=poisoned(q.shape, torch.float32), skip=skip)
    assert ref_skipped[:skip].isnan().all() and torch.equal(ref_skipped[skip:], want[skip:])


@pytest.mark.parametrize("fn", [paged_attention_prefill, paged_attention_prefill_ref])
def test_prefill_skip_is_checked(fn):
    q_lens = [n for _, n in MIXED_STEP]
    scene = make_scene([p + n for p, n in MIXED_STEP], seed=12)
    q, cu = torch.randn(sum(q_lens), 4, 16), varlen(q_lens)
    for bad in (-1, len(q_lens) + 1, 2.0):
        with pytest.raises(ValueError, match="skip must be an int"):
            fn(q, scene.pool, scene.tables, cu, scene.lengths, 0.2, 4, 2, skip=bad)
    if fn is paged_attention_prefill_ref:  # the kernel cannot see the offsets without a sync: the caller's contract
        with pytest.raises(ValueError, match="must have one new token each"):
            fn(q, scene.pool, scene.tables, cu, scene.lengths, 0.2, 4, 2, skip=7)


def test_chunked_prefill_then_decode_equals_full_attention():
    """Write + attend in chunks of 11, 18 and 1 tokens; compare every row with SDPA over the whole sequence."""
    total, dtype = 30, torch.float16
    scene = make_scene([0], dtype=dtype, seed=3)  # an empty pool with noise
    table = torch.randperm(scene.pool.shape[0])[: math.ceil(total / 4)].to(torch.int32)
    k_all = torch.randn(total, 2, 16).to(dtype)
    v_all = torch.randn(total, 2, 16).to(dtype)
    q_all = torch.randn(total, 4, 16).to(dtype)
    outs, start = [], 0
    for chunk in (11, 18, 1):
        rows = torch.arange(start, start + chunk)
        write_kv(scene.pool, k_all[rows], v_all[rows], slots_of(table, rows, 4))
        seq_lens = torch.tensor([start + chunk], dtype=torch.int32)
        if chunk == 1:
            outs.append(paged_attention_decode(q_all[rows], scene.pool, table[None], seq_lens, 0.25, 4, 2))
        else:
            outs.append(paged_attention_prefill(q_all[rows], scene.pool, table[None], varlen([chunk]), seq_lens,
                                                0.25, 4, 2))
        start += chunk
    expected = sdpa(q_all, k_all, v_all, torch.arange(total), 0.25)
    assert_close(torch.cat(outs), expected, dtype)


def test_prefill_of_one_token_equals_decode():
    scene = make_scene(LENGTHS)
    q = torch.randn(len(LENGTHS), 4, 16)
    decode = paged_attention_decode(q, scene.pool, scene.tables, scene.lengths, 0.25, 4, 2, num_splits=2)
    prefill = paged_attention_prefill(q, scene.pool, scene.tables, varlen([1] * len(LENGTHS)), scene.lengths,
                                      0.25, 4, 2)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- launcher errors


def _decode_args(**overrides):
    scene = make_scene([5, 9])
    args = {"q": torch.randn(2, 4, 16), "pool": scene.pool, "block_tables": scene.tables,
            "context_lens": scene.lengths, "scale": 0.25, "block_tokens": 4, "num_kv_heads": 2}
    return {**args, **overrides}


@pytest.mark.parametrize("overrides,message", [
    ({"q": torch.randn(2, 4, 16, dtype=torch.float16)}, "dtype"),
    ({"q": torch.randn(2, 64)}, "3-D"),
    ({"num_kv_heads": 3}, "divide"),
    ({"block_tokens": 8}, "block_tokens"),
    ({"block_tables": torch.zeros(2, 5, dtype=torch.int64)}, "block_tables"),
    ({"context_lens": torch.tensor([5, 9])}, "context_lens"),
    ({"context_lens": torch.tensor([5], dtype=torch.int32)}, "context_lens"),
    ({"scale": 0.0}, "scale"),
    ({"num_splits": 0}, "num_splits"),
    ({"config": AttentionConfig(block_n=24)}, "block_n"),
    ({"out": torch.empty(2, 4, 8)}, "out"),
    ({"block_tables": torch.zeros(5, 2, dtype=torch.int32).t()}, "contiguous last dim"),
])
def test_decode_rejects_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        paged_attention_decode(**_decode_args(**overrides))


def test_decode_rejects_bad_head_dim_and_pool():
    pool = torch.randn(8, 4 * 2 * 2 * 24)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_decode(torch.randn(1, 4, 24), pool, torch.zeros(1, 2, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 0.2, 4, 2)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention_decode(**_decode_args(pool=torch.randn(256, 9)[:, :8].t()))  # [8, 256] strided


def test_prefill_rejects_bad_arguments():
    scene = make_scene([5, 9])
    q = torch.randn(6, 4, 16)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention_prefill(q, scene.pool, scene.tables, varlen([6]), scene.lengths, 0.25, 4, 2)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention_prefill(q, scene.pool, scene.tables, varlen([3, 3]), scene.lengths.long(), 0.25, 4, 2)
    with pytest.raises(ValueError, match="out"):
        paged_attention_prefill(q, scene.pool, scene.tables, varlen([3, 3]), scene.lengths, 0.25, 4, 2,
                                out=torch.empty(6, 4, 16, dtype=torch.float16))


@pytest.mark.parametrize("fn", [write_kv, write_kv_ref])
def test_write_kv_rejects_bad_arguments(fn):
    pool = torch.randn(8, 4 * 2 * 2 * 16)
    k = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        fn(pool, k, k, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="v shape"):
        fn(pool, k, k[:2], torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtypes"):
        fn(pool, k.half(), k.half(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="page_elems"):
        fn(torch.randn(8, 100), k, k, torch.zeros(3, dtype=torch.int64))


# ----------------------------------------------------------------------------- GPU, real shapes


def rel_error(actual, expected) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


GPU_SHAPES = [(64, 8, 64), (32, 8, 128)]  # GPT-OSS-like, Llama-8B-like


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim", GPU_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_decode_bf16(heads, kv_heads, head_dim, num_splits):
    lengths = [1, 15, 16, 17, 300, 2049, 4000]
    scene = make_scene(lengths, 16, kv_heads, head_dim, torch.bfloat16, seed=11, device="cuda")
    q = torch.randn(len(lengths), heads, head_dim, device="cuda").bfloat16()
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    paged_attention_decode(q, scene.pool, scene.tables, scene.lengths, head_dim**-0.5, 16, kv_heads,
                           num_splits=num_splits, out=out)
    expected = paged_attention_decode_ref(q.float(), scene.pool.float(), scene.tables, scene.lengths,
                                          head_dim**-0.5, 16, kv_heads)
    assert not out.isnan().any()
    assert rel_error(out, expected) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim", GPU_SHAPES)
def test_gpu_prefill_bf16(heads, kv_heads, head_dim):
    cases = [(0, 100), (500, 37), (1000, 300), (15, 1), (0, 513)]
    q_lens = [n for _, n in cases]
    scene = make_scene([p + n for p, n in cases], 16, kv_heads, head_dim, torch.bfloat16, seed=12, device="cuda")
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda").bfloat16()
    cu = varlen(q_lens, "cuda")
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    paged_attention_prefill(q, scene.pool, scene.tables, cu, scene.lengths, head_dim**-0.5, 16, kv_heads, out=out)
    expected = paged_attention_prefill_ref(q.float(), scene.pool.float(), scene.tables, cu, scene.lengths,
                                           head_dim**-0.5, 16, kv_heads)
    assert not out.isnan().any()
    assert rel_error(out, expected) <= 1e-2


@pytest.mark.gpu
def test_gpu_write_kv_bf16():
    scene = make_scene([40, 3], 16, 8, 128, torch.bfloat16, seed=13, device="cuda")
    pool = scene.pool.clone()
    k = torch.randn(200, 8, 128, device="cuda").bfloat16()
    v = torch.randn(200, 8, 128, device="cuda").bfloat16()
    slots = torch.randperm(pool.shape[0] * 16, device="cuda")[:200]
    slots[::7] = -1
    expected = pool.clone()
    write_kv_ref(expected, k, v, slots)
    write_kv(pool, k, v, slots)
    assert torch.equal(pool, expected)


@pytest.mark.gpu
def test_gpu_decode_does_not_recompile_per_step():
    from unipage.kernels import attention

    def compiled_variants() -> int:
        entry = getattr(attention._decode_kernel, "device_caches", {}).get(torch.cuda.current_device())
        cache = entry[0] if isinstance(entry, tuple) else None
        if not isinstance(cache, dict):
            pytest.skip("this Triton version keeps its kernel cache elsewhere")
        return len(cache)

    for step, lengths in enumerate([[5, 70], [6, 71, 300], [7, 300, 1000, 1]]):  # new lengths, widths, splits
        scene = make_scene(lengths, 16, 8, 64, torch.bfloat16, seed=step, device="cuda")
        q = torch.randn(len(lengths), 64, 64, device="cuda").bfloat16()
        paged_attention_decode(q, scene.pool, scene.tables, scene.lengths, 0.125, 16, 8, num_splits=2 + step)
        if step == 0:
            first = compiled_variants()
    assert compiled_variants() == first


# ----------------------------------------------------------------------------- in the decoder


def test_decoder_sends_a_mixed_steps_decodes_to_the_decode_kernel(tmp_path, monkeypatch):
    """A tiny Llama with the Triton attention kernels (interpreter) against the torch set, on steps that mix
    decodes with prompt chunks (a budget of 6 tokens: the short prompt decodes while the long one prefills):
    the same tokens and logits, and the mixed steps' prefill launches skip their leading decodes."""
    import dataclasses

    import transformers as tf

    from unipage import LLM, SamplingParams
    from unipage.config import PoolConfig
    from unipage.kernels import attention
    from unipage.models.ops import TORCH
    from unipage.scheduler import SchedulerConfig

    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96)).save_pretrained(tmp_path)
    skips = []

    def prefill(*args, skip=0, **kwargs):
        skips.append(skip)
        return attention.paged_attention_prefill(*args, skip=skip, **kwargs)

    hybrid = dataclasses.replace(TORCH, attention_prefill=prefill, attention_decode=attention.paged_attention_decode)
    prompts = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [5, 9]]
    runs = []
    for ops in (TORCH, hybrid):
        llm = LLM(str(tmp_path), device="cpu", pool=PoolConfig(num_pages=64), kernels="torch",
                  scheduler=SchedulerConfig(max_num_batched_tokens=6, max_model_len=64))
        llm.engine.model.ops = ops
        runs.append(llm.generate(prompts, SamplingParams(temperature=0), max_tokens=5, return_logits=True))
    for want, got in zip(*runs):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)
    assert any(skips), f"no mixed step skipped its decodes: {skips}"
