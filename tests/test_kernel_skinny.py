"""The skinny linear (`kernels.skinny`): Triton interpreter at tiny shapes against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from unipage.kernels import skinny
from unipage.kernels.skinny import linear, skinny_linear, skinny_linear_ref


def operands(rows, n, k, bias=True, dtype=torch.float16, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


def assert_matches(y, x, w, b):
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[y.dtype]
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("swap", [False, True])
def test_matches_reference(rows, split_k, swap):
    x, w, b = operands(rows, 72, 200)  # 72 columns: a partial tile of 32; K 200: partial tiles of 32
    y = skinny_linear(x, w, b, {"block_n": 32, "block_k": 32, "split_k": split_k, "swap": swap})
    assert y.shape == (rows, 72) and y.dtype == x.dtype
    assert_matches(y, x, w, b)
    torch.testing.assert_close(y, skinny_linear_ref(x, w, b), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("split_k", [1, 2])
def test_no_bias_even_k_and_strided_x(split_k):
    base, w, _ = operands(8, 48, 128, bias=False, seed=1)
    x = torch.cat([base, base], dim=1)[:, :128]  # rows strided (256 apart), columns contiguous
    y = skinny_linear(x, w, None, {"block_n": 16, "block_k": 64, "split_k": split_k})
    assert_matches(y, x, w, None)


def test_split_k_is_deterministic_and_resets_its_counters():
    x, w, b = operands(16, 64, 256, seed=2)
    cfg = {"block_n": 16, "block_k": 32, "split_k": 4}
    first = skinny_linear(x, w, b, cfg)
    assert torch.equal(skinny._counters[x.device][:4], torch.zeros(4, dtype=torch.int32))
    assert torch.equal(skinny_linear(x, w, b, cfg), first)
    assert_matches(first, x, w, b)


def test_linear_dispatch(monkeypatch):
    x, w, b = operands(4, 40, 64, seed=3)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # no entry (the CPU has none): F.linear itself
    entry = skinny.SKINNY | {"max_tokens": 4, "block_n": 16, "block_k": 16}
    monkeypatch.setattr(skinny, "tuned_config", lambda n, k, dtype, device: entry if (n, k) == (40, 64) else None)
    calls = []
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(a[3]) or skinny_linear(*a))
    assert torch.equal(linear(x, w, b), skinny_linear(x, w, b, entry)) and calls == [entry]
    x5 = torch.cat([x, x[:1]])
    assert torch.equal(linear(x5, w, b), F.linear(x5, w, b))  # more rows than max_tokens
    assert torch.equal(linear(x[:, :32], w[:, :32], b), F.linear(x[:, :32], w[:, :32], b))  # no entry
    assert torch.equal(linear(x.float(), w.float(), b.float()), F.linear(x.float(), w.float(), b.float()))
    b2 = torch.stack([b, b], 1)[:, 0]  # a strided bias: F.linear takes it, the kernel does not
    assert torch.equal(linear(x, w, b2), F.linear(x, w, b2))
    monkeypatch.setattr(skinny, "ENABLED", False)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert calls == [entry]  # only the first call took the kernel


def test_tuned_config_lookup(monkeypatch, tmp_path):
    """The first of the device's config keys with an entry for the weight wins, overlaid on `SKINNY`."""
    path = tmp_path / "skinny.json"
    path.write_text('{"tuned": {"gpu_a": {"bfloat16/32x2880": {"split_k": 8, "max_tokens": 16}},'
                    ' "gpu_b": {"bfloat16/32x2880": {"split_k": 2, "max_tokens": 8}, "float16/64x64": {}}}}')
    monkeypatch.setattr(skinny, "CONFIG_PATH", path)
    monkeypatch.setattr(skinny, "config_devices", lambda device: ("gpu_b", "gpu_a"))
    skinny.reload_configs()
    try:
        cuda = torch.device("cuda", 0)
        assert skinny.tuned_config(32, 2880, torch.bfloat16, cuda) == skinny.SKINNY | {"split_k": 2, "max_tokens": 8}
        assert skinny.tuned_config(32, 2880, torch.float16, cuda) is None
        assert skinny.tuned_config(64, 64, torch.float16, cuda) == skinny.SKINNY
        assert skinny.tuned_config(32, 2880, torch.bfloat16, torch.device("cpu")) is None
    finally:
        skinny.reload_configs()


def test_bad_input_and_config():
    x, w, b = operands(4, 40, 64)
    with pytest.raises(ValueError, match="x \\[M, K\\] and w \\[N, K\\]"):
        skinny_linear(x, w[:, :32], None)
    with pytest.raises(ValueError, match="at most 64 rows"):
        skinny_linear(torch.zeros(65, 64, dtype=x.dtype), w, None)
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(x.float(), w.float(), None)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(x, w.T.contiguous().T, None)
    with pytest.raises(ValueError, match="bias must be contiguous \\[40\\]"):
        skinny_linear(x, w, b[:39])
    with pytest.raises(ValueError, match="bias must be contiguous"):
        skinny_linear(x, w, torch.stack([b, b], 1)[:, 0])
    with pytest.raises(ValueError, match="2\\*\\*31"):
        skinny_linear(x, torch.zeros(1, 64, dtype=x.dtype).expand(1 << 25, 64), None)
    for bad in ({"block_n": 24}, {"block_k": 8}, {"split_k": 0}, {"max_tokens": 65}, {"swap": 1}):
        with pytest.raises(ValueError, match="skinny_linear"):
            skinny_linear(x, w, b, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("swap", [False, True])
def test_gpu_bf16_projection_shapes(rows, split_k, swap, monkeypatch):
    """GPT-OSS-20B's o with its shrink stack (K 4096), bf16, 50 launches: a split-K race would show."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w, b = operands(rows, 3136, 4096, dtype=torch.bfloat16, seed=4, device="cuda")
    cfg = {"block_n": 64 if swap else 32, "block_k": 256, "split_k": split_k, "swap": swap}
    first = skinny_linear(x, w, b, cfg)
    assert_matches(first, x, w, b)
    real_empty = torch.empty

    class Poisoned:  # every output starts as NaN: a launch that wrote nothing cannot pass for the last one's
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*a, **kw):
            return real_empty(*a, **kw).fill_(float("nan"))

    monkeypatch.setattr(skinny, "torch", Poisoned())
    for _ in range(50):
        assert torch.equal(skinny_linear(x, w, b, cfg), first)
    if split_k > 1:
        assert skinny._counters[x.device].count_nonzero().item() == 0  # every tile's counter back to 0
