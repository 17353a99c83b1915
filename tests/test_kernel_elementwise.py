"""RMSNorm (+ residual add), rope and silu·up: Triton (interpreter on CPU, fp16/fp32) vs the torch
references, the references vs plain formulas, the launchers' checks; bf16 at model shapes on a GPU."""

from __future__ import annotations

import pytest
import torch

from unipage import kernels as K
from unipage.models import rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = (torch.float32, torch.float16)
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}


def rand(*shape, dtype=torch.float32, seed=0, device=DEVICE) -> torch.Tensor:
    """Random values bounded away from zero (a kernel that skips an element cannot match by luck)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(*shape, generator=gen) + 0.25
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return (x * sign).to(dtype).to(device)


def poison(monkeypatch, *modules) -> None:
    """Outputs allocated by the launchers of ``modules`` (default: `elementwise`) start as NaN instead of
    whatever memory held."""
    import unipage.kernels.elementwise as E

    real_empty, real_like = torch.empty, torch.empty_like

    class Torch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*a, **kw):
            return real_empty(*a, **kw).fill_(float("nan"))

        @staticmethod
        def empty_like(*a, **kw):
            return real_like(*a, **kw).fill_(float("nan"))

    for module in modules or (E,):
        monkeypatch.setattr(module, "torch", Torch())


# -- RMSNorm ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens,width", [(1, 48), (37, 96), (5, 200), (3, 64)])
def test_rms_norm_matches_reference(monkeypatch, dtype, tokens, width):
    poison(monkeypatch)
    x, w = rand(tokens, width, dtype=dtype), rand(width, dtype=dtype, seed=1)
    out = K.rms_norm(x, w, 1e-6)
    assert out.is_contiguous() and out.dtype == dtype
    torch.testing.assert_close(out, K.rms_norm_ref(x, w, 1e-6), **TOL[dtype])


def test_rms_norm_reference_is_the_formula():
    x, w = rand(7, 33, dtype=torch.float64), rand(33, dtype=torch.float64, seed=1)
    expect = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(K.rms_norm_ref(x, w, 1e-5), expect)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
def test_rms_norm_per_head_of_a_strided_qkv_view(monkeypatch, dtype, tokens):
    """Qwen3's q/k norm: [T, heads, D] views of a fused qkv (row stride != heads * D), and the
    whole-projection norm (OLMoE) over a [T, Q] column slice."""
    poison(monkeypatch)
    heads, kv_heads, dim = 3, 2, 32
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    w = rand(dim, dtype=dtype, seed=2)
    for view in (q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)):
        assert tokens == 1 or not view.is_contiguous()
        torch.testing.assert_close(K.rms_norm(view, w, 1e-6), K.rms_norm_ref(view, w, 1e-6), **TOL[dtype])
    wq = rand(heads * dim, dtype=dtype, seed=3)
    torch.testing.assert_close(K.rms_norm(q, wq, 1e-6), K.rms_norm_ref(q, wq, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens,width", [(1, 80), (37, 136)])
def test_add_rms_norm_matches_reference(monkeypatch, dtype, tokens, width):
    poison(monkeypatch)
    h, d = rand(tokens, width, dtype=dtype), rand(tokens, width, dtype=dtype, seed=1)
    w = rand(width, dtype=dtype, seed=2)
    h_before = h.clone()
    total, out = K.add_rms_norm(h, d, w, 1e-6)
    want_total, want = K.add_rms_norm_ref(h, d, w, 1e-6)
    assert torch.equal(h, h_before), "h must not be written"
    assert torch.equal(total, want_total), "the residual sum rounds exactly as torch's add"
    torch.testing.assert_close(out, want, **TOL[dtype])


def test_rms_norm_rejects_bad_inputs():
    x, w = rand(4, 32), rand(32)
    with pytest.raises(ValueError, match="contiguous last dim"):
        K.rms_norm(rand(32, 4).T, w, 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        K.rms_norm(x, rand(16), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        K.rms_norm(x, w.half(), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        K.rms_norm(x.double(), w.double(), 1e-6)
    with pytest.raises(ValueError, match="delta must match"):
        K.add_rms_norm(x, rand(3, 32), w, 1e-6)
    with pytest.raises(ValueError, match=r"\[T, N\] or \[T, heads, N\]"):
        K.rms_norm(rand(2, 2, 2, 32), w, 1e-6)


def test_rms_norm_empty_batch():
    assert K.rms_norm(rand(0, 32), rand(32), 1e-6).shape == (0, 32)


# -- rope ------------------------------------------------------------------
def _cos_sin(tokens, dim, dtype, seed=0):
    freq, _ = rope.frequencies({"rope_theta": 10000.0}, dim)
    positions = torch.randperm(4 * tokens + 3, generator=torch.Generator().manual_seed(seed))[:tokens]
    cos, sin = rope.cos_sin(freq, positions.to(DEVICE), dtype, attention=1.3)
    return cos, sin


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 32), (37, 3, 1, 16), (5, 6, 6, 48)])
def test_rope_matches_reference_on_qkv_views(monkeypatch, dtype, tokens, heads, kv_heads, dim):
    """q and k straight out of a fused qkv (strided rows); head counts and head_dim/2 not powers of two."""
    poison(monkeypatch)
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)
    cos, sin = _cos_sin(tokens, dim, dtype)
    got_q, got_k = K.rope_qk(q, k, cos, sin)
    want_q, want_k = K.rope_qk_ref(q, k, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads", [(2, 4, 1), (7, 6, 3)])
def test_rope_write_kv_matches_rope_then_write(monkeypatch, dtype, tokens, heads, kv_heads):
    """The fused launch against `rope_qk_ref` then `write_kv_ref`: q' the same, the same pool (noise kept
    outside the written rows, a token with slot -1 writing nothing), from strided views of a fused qkv."""
    import unipage.kernels.kv_write as kv_write

    poison(monkeypatch, kv_write)
    dim, block_tokens, pages = 16, 4, 6
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = (t.reshape(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    cos, sin = _cos_sin(tokens, dim, dtype)
    pool = rand(pages, 2 * block_tokens * kv_heads * dim, dtype=dtype, seed=3)
    slots = torch.randperm(pages * block_tokens, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[tokens // 2] = -1
    want_pool = pool.clone()
    want_q = K.rope_write_kv_ref(q, k, v, cos, sin, want_pool, slots.to(DEVICE))
    got_q = K.rope_write_kv(q, k, v, cos, sin, pool, slots.to(DEVICE))
    assert got_q.is_contiguous()
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(pool, want_pool, **TOL[dtype])
    assert not torch.equal(want_pool, rand(pages, 2 * block_tokens * kv_heads * dim, dtype=dtype, seed=3))


def test_rope_write_kv_rejects_bad_inputs():
    q, k, v = rand(3, 2, 16), rand(3, 1, 16), rand(3, 1, 16)
    cos, sin = _cos_sin(3, 16, torch.float32)
    pool, slots = rand(4, 2 * 4 * 16), torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="cos must be"):
        K.rope_write_kv(q, k, v, cos[:2], sin, pool, slots)
    with pytest.raises(ValueError, match="v shape"):
        K.rope_write_kv(q, k, rand(3, 2, 16), cos, sin, pool, slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        K.rope_write_kv(q, k, v, cos, sin, pool, slots.int())


def test_rope_reference_is_a_rotation_of_each_pair():
    """Dimensions i and i + D/2 rotate together by the angle of position · inv_freq[i]."""
    tokens, dim = 5, 16
    q, k = rand(tokens, 2, dim, dtype=torch.float64), rand(tokens, 1, dim, dtype=torch.float64, seed=1)
    freq, _ = rope.frequencies({"rope_theta": 10000.0}, dim)
    positions = torch.arange(tokens) * 3
    cos, sin = rope.cos_sin(freq.double(), positions, torch.float64)
    angle = positions.double()[:, None, None] * freq.double()
    def expect(x):
        x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
        return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)

    got_q, got_k = K.rope_qk_ref(q, k, cos, sin)
    torch.testing.assert_close(got_q, expect(q))
    torch.testing.assert_close(got_k, expect(k))


def test_rope_rejects_bad_inputs():
    q, k = rand(3, 2, 16), rand(3, 1, 16)
    cos, sin = _cos_sin(3, 16, torch.float32)
    with pytest.raises(ValueError, match="cos must be"):
        K.rope_qk(q, k, cos[:2], sin)
    with pytest.raises(ValueError, match="share one dtype"):
        K.rope_qk(q, k, cos.half(), sin.half())
    with pytest.raises(ValueError, match="tokens and head_dim"):
        K.rope_qk(q, rand(3, 1, 8), cos, sin)
    with pytest.raises(ValueError, match="contiguous last dim"):
        K.rope_qk(rand(3, 16, 2).transpose(1, 2), k, cos, sin)


# -- silu · up -------------------------------------------------------------
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 24), (37, 100), (3, 1500)])
def test_silu_mul_matches_reference(monkeypatch, dtype, tokens, inter):
    poison(monkeypatch)
    gate_up = rand(tokens, 2 * inter, dtype=dtype) * 3
    out = K.silu_mul(gate_up)
    assert out.shape == (tokens, inter) and out.is_contiguous()
    torch.testing.assert_close(out, K.silu_mul_ref(gate_up), **TOL[dtype])


def test_silu_mul_strided_rows_and_checks():
    wide = rand(5, 2 * 40 + 8)
    gate_up = wide[:, :80]  # row stride 88
    torch.testing.assert_close(K.silu_mul(gate_up), K.silu_mul_ref(gate_up), **TOL[torch.float32])
    g, u = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(K.silu_mul_ref(gate_up), g * torch.sigmoid(g) * u)
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        K.silu_mul(rand(4, 7))
    with pytest.raises(ValueError, match="contiguous last dim"):
        K.silu_mul(rand(8, 4).T)


# -- GPU: bf16 at model shapes against a float32 reference -------------------
def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 4096])
@pytest.mark.parametrize("tokens", [1, 4096])
def test_gpu_norms_bf16(hidden, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    h, d = rand(tokens, hidden, dtype=torch.bfloat16), rand(tokens, hidden, dtype=torch.bfloat16, seed=1)
    w = rand(hidden, dtype=torch.bfloat16, seed=2)
    assert _rel_err(K.rms_norm(h, w, 1e-5), K.rms_norm_ref(h.float(), w.float(), 1e-5)) <= 1e-2
    total, out = K.add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(total, h + d)
    assert _rel_err(out, K.rms_norm_ref(h.float() + d.float(), w.float(), 1e-5)) <= 1e-2
    assert _rel_err(out, K.add_rms_norm_ref(h, d, w, 1e-5)[1]) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 64), (32, 8, 128), (40, 8, 128)])
@pytest.mark.parametrize("tokens", [1, 4096])
def test_gpu_rope_and_head_norm_bf16(heads, kv_heads, dim, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)
    cos, sin = _cos_sin(tokens, dim, torch.bfloat16)
    got_q, got_k = K.rope_qk(q, k, cos, sin)
    want_q, want_k = K.rope_qk_ref(q.float(), k.float(), cos.float(), sin.float())
    assert _rel_err(got_q, want_q) <= 1e-2 and _rel_err(got_k, want_k) <= 1e-2
    same_q, same_k = K.rope_qk_ref(q, k, cos, sin)  # torch's bf16 expression: within a bf16 ulp
    torch.testing.assert_close(got_q, same_q, atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(got_k, same_k, atol=1e-2, rtol=2 ** -7)
    w = rand(dim, dtype=torch.bfloat16, seed=3)
    assert _rel_err(K.rms_norm(q, w, 1e-6), K.rms_norm_ref(q.float(), w.float(), 1e-6)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [8192, 14336])
def test_gpu_silu_mul_bf16(inter):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gate_up = rand(4096, 2 * inter, dtype=torch.bfloat16) * 3
    assert _rel_err(K.silu_mul(gate_up), K.silu_mul_ref(gate_up.float())) <= 1e-2
    assert _rel_err(K.silu_mul(gate_up), K.silu_mul_ref(gate_up)) <= 1e-2


# -- the decoder with these kernels (interpreter) vs the torch set -------------
def _model_dir(kind: str, root) -> str:
    """A saved random fp32 model: dense, MoE, q/k norm per head (Qwen3) or over the projection (OLMoE)."""
    import transformers as tf

    tiny = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16}
    configs = {"llama": (tf.LlamaConfig, {"intermediate_size": 96}),
               "qwen3": (tf.Qwen3Config, {"intermediate_size": 96}),
               "olmoe": (tf.OlmoeConfig, {"intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2})}
    config, extra = configs[kind]
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config(**tiny, **extra)).save_pretrained(root)
    return str(root)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "olmoe"])
def test_decoder_with_the_elementwise_kernels_matches_the_torch_set(kind, tmp_path):
    """Prefill and decode steps of a tiny model: the torch set vs the same set with the Triton
    rms_norm / add_rms_norm / rope_write_kv / silu_mul (a hybrid only a test builds: on CPU the engine uses TORCH)."""
    import dataclasses

    from unipage import LLM, SamplingParams
    from unipage.config import PoolConfig
    from unipage.models.ops import TORCH

    hybrid = dataclasses.replace(TORCH, rms_norm=K.rms_norm, add_rms_norm=K.add_rms_norm,
                                 rope_write_kv=K.rope_write_kv, silu_mul=K.silu_mul)
    model_dir = _model_dir(kind, tmp_path)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [5]]
    runs = []
    for ops in (TORCH, hybrid):
        llm = LLM(model_dir, device="cpu", pool=PoolConfig(num_pages=64), kernels="torch")
        llm.engine.model.ops = ops
        runs.append(llm.generate(prompts, SamplingParams(temperature=0), max_tokens=4, return_logits=True))
    for want, got in zip(*runs):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)
