"""Paged attention with GPT-OSS's attention sinks and sliding window: Triton (interpreter
on CPU) vs the torch references, and the references vs a dense oracle written from
transformers' GPT-OSS eager attention (mask from transformers' own mask functions).

Pages wholly before a sequence's window are made unreadable: every other sequence has
their block-table entries set to -1, the others keep the entries but the pages are
filled with NaN; a kernel that reads either fails.  Outputs are poisoned with NaN.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_kernel_attention import (
    Scene,
    assert_close,
    make_scene,
    poisoned,
    rel_error,
    slots_of,
    varlen,
)
from transformers.masking_utils import (
    causal_mask_function,
    eager_mask,
    sliding_window_causal_mask_function,
)
from unipage.kernels.attention import AttentionConfig, paged_attention_decode, paged_attention_prefill
from unipage.kernels.attention_ref import paged_attention_decode_ref, paged_attention_prefill_ref
from unipage.kernels.kv_write import write_kv

HEADS, KV_HEADS, BT = 4, 2, 4
LENGTHS = [1, 3, 4, 5, 7, 8, 9, 21, 40]  # block boundaries +-1 (block_tokens 4), long
PREFILL_CASES = [(0, 1), (0, 9), (3, 5), (4, 4), (7, 1), (20, 17), (0, 40), (5, 0), (33, 3), (12, 30)]
# (sinks?, window): window 6 < most contexts, 64 > every context
MODES = {"sinks": (True, None), "window": (False, 6), "both": (True, 6), "sinks_wide_window": (True, 64)}


def make_sinks(heads=HEADS, seed=0, device="cpu") -> torch.Tensor:
    return (2 * torch.randn(heads, generator=torch.Generator().manual_seed(seed))).to(device)


def hide_before(scene: Scene, starts: list[int]) -> None:
    """Make the pages wholly before ``starts[b]`` unreadable: table entries -1 (even b) or NaN pages (odd b)."""
    for b, start in enumerate(starts):
        blocks = start // scene.block_tokens
        if b % 2 == 0:
            scene.tables[b, :blocks] = -1
        else:
            scene.pool[scene.tables[b, :blocks].long()] = float("nan")


def window_start(first_query: int, window: int | None) -> int:
    return max(0, first_query - window + 1) if window else 0


# ----------------------------------------------------------------------------- the dense oracle


def eager_oracle(q, k, v, first_pos, scale, sinks=None, window=None) -> torch.Tensor:
    """transformers' GPT-OSS eager attention, fp32: ``q [M, H, D]`` at positions ``first_pos..`` over
    ``k, v [L, KVH, D]`` at positions ``0..L-1``; returns ``[M, H, D]``."""
    rows, heads, dim = q.shape
    if k.shape[0] == 0:
        return torch.zeros(rows, heads, dim)
    mask_fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
    mask = eager_mask(1, rows, k.shape[0], q_offset=first_pos, mask_function=mask_fn, dtype=torch.float32)
    group = heads // k.shape[1]
    query = q.float().transpose(0, 1)[None]  # [1, H, M, D]
    key = k.float().transpose(0, 1)[None].repeat_interleave(group, dim=1)  # [1, H, L, D]
    value = v.float().transpose(0, 1)[None].repeat_interleave(group, dim=1)
    logits = query @ key.transpose(2, 3) * scale + mask
    if sinks is not None:
        logits = torch.cat([logits, sinks.float().view(1, heads, 1, 1).expand(1, heads, rows, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink has no value
    return (probs @ value)[0].transpose(0, 1)


def test_window_convention_is_transformers():
    """Query i sees keys i - W < j <= i in transformers' GPT-OSS sliding-window mask."""
    from transformers import GptOssConfig
    from transformers.masking_utils import create_sliding_window_causal_mask

    cfg = GptOssConfig(sliding_window=3, num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8)
    cfg._attn_implementation = "eager"
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=torch.zeros(1, 7, 16), attention_mask=None,
                                             past_key_values=None, position_ids=torch.arange(7)[None])
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    assert torch.equal(mask[0, 0] == 0, (j <= i) & (j > i - 3))


def test_oracle_is_transformers_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for n, h in ((5, 4), (12, 2), (12, 2)))
    sinks = make_sinks()
    mask = eager_mask(1, 5, 12, q_offset=7, mask_function=sliding_window_causal_mask_function(4), dtype=torch.float32)
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    expected, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], mask, scaling=0.3)
    torch.testing.assert_close(eager_oracle(q, k, v, 7, 0.3, sinks, 4), expected[0], atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- references vs the oracle


@pytest.mark.parametrize("mode", MODES)
def test_decode_reference_matches_oracle(mode):
    has_sinks, window = MODES[mode]
    sinks = make_sinks() if has_sinks else None
    scene = make_scene(LENGTHS, BT, KV_HEADS, 16, seed=20)
    hide_before(scene, [window_start(n - 1, window) for n in LENGTHS])
    q = torch.randn(len(LENGTHS), HEADS, 16)
    out = paged_attention_decode_ref(q, scene.pool, scene.tables, scene.lengths, 0.3, BT, KV_HEADS, sinks=sinks,
                                     sliding_window=window)
    for b, n in enumerate(LENGTHS):
        expected = eager_oracle(q[b: b + 1], scene.keys[b], scene.values[b], n - 1, 0.3, sinks, window)
        torch.testing.assert_close(out[b: b + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_prefill_reference_matches_oracle(mode):
    has_sinks, window = MODES[mode]
    sinks = make_sinks() if has_sinks else None
    q_lens = [n for _, n in PREFILL_CASES]
    scene = make_scene([p + n for p, n in PREFILL_CASES], BT, KV_HEADS, 16, seed=21)
    hide_before(scene, [window_start(p, window) for p, _ in PREFILL_CASES])
    q = torch.randn(sum(q_lens), HEADS, 16)
    cu = varlen(q_lens)
    out = paged_attention_prefill_ref(q, scene.pool, scene.tables, cu, scene.lengths, 0.3, BT, KV_HEADS,
                                      sinks=sinks, sliding_window=window)
    for b, (prefix, _) in enumerate(PREFILL_CASES):
        rows = slice(cu[b], cu[b + 1])
        expected = eager_oracle(q[rows], scene.keys[b], scene.values[b], prefix, 0.3, sinks, window)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- Triton vs the references


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(dtype, mode, num_splits):
    has_sinks, window = MODES[mode]
    sinks = make_sinks(seed=1) if has_sinks else None
    scene = make_scene(LENGTHS, BT, KV_HEADS, 16, dtype, seed=22)
    hide_before(scene, [window_start(n - 1, window) for n in LENGTHS])
    q = torch.randn(len(LENGTHS), HEADS, 16).to(dtype)
    out = poisoned(q.shape, dtype)
    got = paged_attention_decode(q, scene.pool, scene.tables, scene.lengths, 0.3, BT, KV_HEADS,
                                 num_splits=num_splits, out=out, sinks=sinks, sliding_window=window)
    assert got is out
    expected = paged_attention_decode_ref(q, scene.pool, scene.tables, scene.lengths, 0.3, BT, KV_HEADS,
                                          sinks=sinks, sliding_window=window)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode,window", [("sinks", None), ("window", 5), ("both", 13), ("both", 64)])
def test_prefill_matches_reference(dtype, mode, window):
    """Tiles of 8 tokens: window 5 is narrower than a tile, 13 spans two key blocks, 64 exceeds every context."""
    sinks = make_sinks(seed=2) if mode != "window" else None
    q_lens = [n for _, n in PREFILL_CASES]
    scene = make_scene([p + n for p, n in PREFILL_CASES], BT, KV_HEADS, 16, dtype, seed=23)
    hide_before(scene, [window_start(p, window) for p, _ in PREFILL_CASES])
    q = torch.randn(sum(q_lens), HEADS, 16).to(dtype)
    cu = varlen(q_lens)
    out = poisoned(q.shape, dtype)
    paged_attention_prefill(q, scene.pool, scene.tables, cu, scene.lengths, 0.3, BT, KV_HEADS, out=out,
                            sinks=sinks, sliding_window=window)
    expected = paged_attention_prefill_ref(q, scene.pool, scene.tables, cu, scene.lengths, 0.3, BT, KV_HEADS,
                                           sinks=sinks, sliding_window=window)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("heads,kv_heads,block_tokens,cfg,window", [
    (8, 1, 4, AttentionConfig(block_n=16, block_m=16), 3),  # MQA, 2 tokens x 8 heads per tile
    (4, 4, 32, AttentionConfig(block_n=16, block_m=32), 20),  # key blocks smaller than a page
    (6, 2, 8, AttentionConfig(block_n=32, block_m=16), 17),  # G=3 padded to 4
])
def test_group_and_tile_shapes(heads, kv_heads, block_tokens, cfg, window):
    cases = [(0, 3), (block_tokens, block_tokens + 1), (33, 30), (70, 1)]
    q_lens = [n for _, n in cases]
    sinks = make_sinks(heads, seed=3)
    scene = make_scene([p + n for p, n in cases], block_tokens, kv_heads, 16, seed=24)
    hide_before(scene, [window_start(p, window) for p, _ in cases])  # decode's window starts later: also hidden
    q = torch.randn(sum(q_lens), heads, 16)
    cu = varlen(q_lens)
    args = (scene.pool, scene.tables, cu, scene.lengths, 0.2, block_tokens, kv_heads)
    out = poisoned(q.shape, torch.float32)
    paged_attention_prefill(q, *args, config=cfg, out=out, sinks=sinks, sliding_window=window)
    assert_close(out, paged_attention_prefill_ref(q, *args, sinks=sinks, sliding_window=window), torch.float32)
    q1 = torch.randn(len(cases), heads, 16)
    args = (scene.pool, scene.tables, scene.lengths, 0.2, block_tokens, kv_heads)
    out = poisoned(q1.shape, torch.float32)
    paged_attention_decode(q1, *args, num_splits=2, config=cfg, out=out, sinks=sinks, sliding_window=window)
    assert_close(out, paged_attention_decode_ref(q1, *args, sinks=sinks, sliding_window=window), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sink_only_gives_zeros_and_extreme_sinks(num_splits):
    """An empty context with a sink outputs 0; a huge sink drives the output to 0, a very negative one
    leaves plain attention; each sink counts once however many splits."""
    scene = make_scene([5, 1, 9, 40])
    lengths = scene.lengths.clone()
    lengths[1] = 0
    q = torch.randn(4, HEADS, 16)
    sinks = torch.tensor([0.5, 60.0, -60.0, 3.0])
    args = (scene.pool, scene.tables, lengths, 0.25, BT, KV_HEADS)
    out = paged_attention_decode(q, *args, num_splits=num_splits, out=poisoned(q.shape, torch.float32),
                                 sinks=sinks, sliding_window=7)
    assert torch.equal(out[1], torch.zeros(HEADS, 16))
    assert out[:, 1].abs().max() < 1e-20
    plain = paged_attention_decode_ref(q, *args, sliding_window=7)
    torch.testing.assert_close(out[:, 2], plain[:, 2], atol=1e-6, rtol=1e-6)
    assert_close(out, paged_attention_decode_ref(q, *args, sinks=sinks, sliding_window=7), torch.float32)


@pytest.mark.parametrize("window", [None, 0])
def test_off_is_the_default(window):
    scene = make_scene(LENGTHS)
    q = torch.randn(len(LENGTHS), HEADS, 16)
    args = (scene.pool, scene.tables, scene.lengths, 0.25, BT, KV_HEADS)
    default = paged_attention_decode(q, *args, num_splits=2)
    assert torch.equal(paged_attention_decode(q, *args, num_splits=2, sinks=None, sliding_window=window), default)


def test_chunked_prefill_then_decode_with_pages_freed_behind_the_window():
    """Chunks of 11, 18, 1, 1 tokens; after each, pages wholly behind the next token's window get -1 (as a
    pool would reclaim them); every row must equal the oracle over the whole sequence."""
    total, window, dtype = 31, 9, torch.float16
    sinks = make_sinks(seed=5)
    scene = make_scene([0], dtype=dtype, seed=6)
    table = torch.randperm(scene.pool.shape[0])[: math.ceil(total / BT)].to(torch.int32)
    k_all, v_all, q_all = (torch.randn(total, h, 16).to(dtype) for h in (KV_HEADS, KV_HEADS, HEADS))
    outs, start = [], 0
    for chunk in (11, 18, 1, 1):
        rows = torch.arange(start, start + chunk)
        write_kv(scene.pool, k_all[rows], v_all[rows], slots_of(table, rows, BT))
        seq_lens = torch.tensor([start + chunk], dtype=torch.int32)
        kw = {"sinks": sinks, "sliding_window": window}
        if chunk == 1:
            outs.append(paged_attention_decode(q_all[rows], scene.pool, table[None], seq_lens, 0.25, BT, KV_HEADS,
                                               num_splits=2, **kw))
        else:
            outs.append(paged_attention_prefill(q_all[rows], scene.pool, table[None], varlen([chunk]), seq_lens,
                                                0.25, BT, KV_HEADS, **kw))
        start += chunk
        table[: window_start(start, window) // BT] = -1
    expected = eager_oracle(q_all, k_all, v_all, 0, 0.25, sinks, window)
    assert_close(torch.cat(outs), expected, dtype)


# ----------------------------------------------------------------------------- launcher errors


@pytest.mark.parametrize("fn", [paged_attention_decode, paged_attention_decode_ref])
@pytest.mark.parametrize("kwargs,message", [
    ({"sinks": torch.randn(3)}, "sinks"),
    ({"sinks": torch.randn(4, dtype=torch.float64)}, "sinks"),
    ({"sinks": torch.randn(4, 2)[:, 0]}, "sinks"),
    ({"sliding_window": -1}, "sliding_window"),
    ({"sliding_window": 4.0}, "sliding_window"),
    ({"sliding_window": True}, "sliding_window"),
])
def test_rejects_bad_sinks_and_window(fn, kwargs, message):
    scene = make_scene([5, 9])
    with pytest.raises(ValueError, match=message):
        fn(torch.randn(2, HEADS, 16), scene.pool, scene.tables, scene.lengths, 0.25, BT, KV_HEADS, **kwargs)


@pytest.mark.parametrize("fn", [paged_attention_prefill, paged_attention_prefill_ref])
def test_prefill_rejects_bad_sinks_and_window(fn):
    scene = make_scene([5, 9])
    args = (torch.randn(6, HEADS, 16), scene.pool, scene.tables, varlen([3, 3]), scene.lengths, 0.25, BT, KV_HEADS)
    with pytest.raises(ValueError, match="sinks"):
        fn(*args, sinks=torch.randn(HEADS).half())
    with pytest.raises(ValueError, match="sliding_window"):
        fn(*args, sliding_window=-3)


# ----------------------------------------------------------------------------- GPU, GPT-OSS shape


GPT_OSS = {"heads": 64, "kv_heads": 8, "head_dim": 64, "window": 128}


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_decode_gpt_oss(num_splits, window):
    heads, kv_heads, dim = GPT_OSS["heads"], GPT_OSS["kv_heads"], GPT_OSS["head_dim"]
    lengths = [1, 15, 16, 17, 129, 300, 2049, 4000]
    scene = make_scene(lengths, 16, kv_heads, dim, torch.bfloat16, seed=31, device="cuda")
    hide_before(scene, [window_start(n - 1, window) for n in lengths])
    sinks = make_sinks(heads, seed=7, device="cuda")
    q = torch.randn(len(lengths), heads, dim, device="cuda").bfloat16()
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    paged_attention_decode(q, scene.pool, scene.tables, scene.lengths, dim**-0.5, 16, kv_heads,
                           num_splits=num_splits, out=out, sinks=sinks, sliding_window=window)
    expected = paged_attention_decode_ref(q.float(), scene.pool.float(), scene.tables, scene.lengths, dim**-0.5,
                                          16, kv_heads, sinks=sinks, sliding_window=window)
    assert not out.isnan().any()
    assert rel_error(out, expected) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_prefill_gpt_oss(window):
    heads, kv_heads, dim = GPT_OSS["heads"], GPT_OSS["kv_heads"], GPT_OSS["head_dim"]
    cases = [(0, 100), (500, 37), (1000, 300), (15, 1), (0, 513), (127, 129)]
    q_lens = [n for _, n in cases]
    scene = make_scene([p + n for p, n in cases], 16, kv_heads, dim, torch.bfloat16, seed=32, device="cuda")
    hide_before(scene, [window_start(p, window) for p, _ in cases])
    sinks = make_sinks(heads, seed=8, device="cuda")
    q = torch.randn(sum(q_lens), heads, dim, device="cuda").bfloat16()
    cu = varlen(q_lens, "cuda")
    out = poisoned(q.shape, torch.bfloat16, "cuda")
    paged_attention_prefill(q, scene.pool, scene.tables, cu, scene.lengths, dim**-0.5, 16, kv_heads, out=out,
                            sinks=sinks, sliding_window=window)
    expected = paged_attention_prefill_ref(q.float(), scene.pool.float(), scene.tables, cu, scene.lengths,
                                           dim**-0.5, 16, kv_heads, sinks=sinks, sliding_window=window)
    assert not out.isnan().any()
    assert rel_error(out, expected) <= 1e-2


@pytest.mark.gpu
def test_gpu_window_does_not_recompile_per_value():
    from unipage.kernels import attention

    def variants(kernel) -> int:
        entry = getattr(kernel, "device_caches", {}).get(torch.cuda.current_device())
        cache = entry[0] if isinstance(entry, tuple) else None
        if not isinstance(cache, dict):
            pytest.skip("this Triton version keeps its kernel cache elsewhere")
        return len(cache)

    sinks = make_sinks(64, device="cuda")
    for step, window in enumerate([128, 100, 17, 1, 4096]):
        lengths = [5 + step, 300 + step]
        scene = make_scene(lengths, 16, 8, 64, torch.bfloat16, seed=step, device="cuda")
        q = torch.randn(len(lengths), 64, 64, device="cuda").bfloat16()
        paged_attention_decode(q, scene.pool, scene.tables, scene.lengths, 0.125, 16, 8, num_splits=2,
                               sinks=sinks, sliding_window=window)
        paged_attention_prefill(q, scene.pool, scene.tables, varlen([1, 1], "cuda"), scene.lengths, 0.125, 16, 8,
                                sinks=sinks, sliding_window=window)
        if step == 0:
            first = (variants(attention._decode_kernel), variants(attention._prefill_kernel))
    assert (variants(attention._decode_kernel), variants(attention._prefill_kernel)) == first
