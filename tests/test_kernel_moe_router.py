"""The fused router (`moe_router.route_linear`): the router GEMM and the routing in one kernel.

CPU runs the kernel under the interpreter at small shapes (fp32/fp16) against the reference (the GEMM,
then `route_topk_ref`); `-m gpu` runs GPT-OSS-20B's and Qwen3-30B-A3B's routers in bf16.
"""

import pytest
import torch

from unipage.kernels import moe_router
from unipage.kernels.fused_moe import route_topk_ref
from unipage.kernels.moe_router import route_linear, route_linear_ref


def _router(num_tokens, hidden, experts, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    weight = torch.randn(experts, hidden, generator=g) / hidden ** 0.5
    bias = torch.randn(experts, generator=g) * 0.1
    return x.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype)


def _spy(monkeypatch):
    launched, real = [], moe_router.launch

    def launch(kernel, grid, *args, **kwargs):
        launched.append(grid)
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(moe_router, "launch", launch)
    return launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, hidden, experts, block_k", [(1, 96, 8, 256), (7, 200, 32, 64),
                                                                  (40, 128, 12, 32)])
def test_fused_router_matches_the_gemm_then_route(monkeypatch, dtype, num_tokens, hidden, experts, block_k):
    """One K step past H (masked), four with a ragged last one, and four even ones; 8, 32 and 12 experts (the
    last padded to 16 columns); 40 tokens are three programs of 16 rows, the last one partly empty."""
    monkeypatch.setitem(moe_router.CONFIG, "block_k", block_k)
    launched = _spy(monkeypatch)
    x, weight, bias = _router(num_tokens, hidden, experts, dtype, seed=num_tokens)
    for kwargs in ({}, {"bias": bias}, {"bias": bias, "weight_dtype": torch.bfloat16}):
        for renormalize in (True, False):
            got_w, got_ids = route_linear(x, weight, 3, renormalize, **kwargs)
            want_w, want_ids = route_linear_ref(x, weight, 3, renormalize, **kwargs)
            assert torch.equal(got_ids, want_ids), kwargs
            tol = 1e-6 if dtype == torch.float32 else 2e-3
            torch.testing.assert_close(got_w, want_w, rtol=tol, atol=tol)
    assert len(launched) == 6 and all(grid == (-(-num_tokens // 16),) for grid in launched)


def test_fused_router_leaves_larger_batches_to_the_gemm(monkeypatch):
    launched = _spy(monkeypatch)
    x, weight, bias = _router(moe_router.FUSED_TOKENS + 1, 64, 8, torch.float32, seed=3)
    got = route_linear(x, weight, 2, True, bias=bias)
    want = route_topk_ref(x @ weight.T, 2, True, bias=bias)
    assert not launched  # (the routing kernel of `fused_moe` ran instead)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], atol=1e-6)
    small = route_linear(x[:4], weight, 2, True, bias=bias)
    assert launched and torch.equal(small[1], want[1][:4])


def test_fused_router_rejects_bad_arguments():
    x, weight, bias = _router(4, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        route_linear(x, weight[:, :32], 2, True)
    with pytest.raises(ValueError, match="weight must be"):
        route_linear_ref(x, weight.half(), 2, True)
    with pytest.raises(ValueError, match="x must be"):
        route_linear(x.t(), weight, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        route_linear(x, weight, 9, True)
    with pytest.raises(ValueError, match="bias must be"):
        route_linear(x, weight, 2, True, bias=bias[:4])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
@pytest.mark.parametrize("hidden, experts, top_k, with_bias", [(2880, 32, 4, True), (2048, 128, 8, False)])
def test_gpu_fused_router_bf16(num_tokens, hidden, experts, top_k, with_bias):
    """GPT-OSS-20B's router (with its bias) and Qwen3-30B-A3B's in bf16.  The kernel sums the logits in
    another order than cuBLAS, so a logit may differ in its last bit: rows whose choices differ must have
    had a near tie at the reference's k-th choice; the others match it, weights to bf16 rounding."""
    x, weight, bias = _router(num_tokens, hidden, experts, torch.bfloat16, seed=num_tokens, device="cuda")
    kwargs = {"bias": bias if with_bias else None, "weight_dtype": torch.bfloat16}
    got_w, got_ids = route_linear(x, weight, top_k, True, **kwargs)
    want_w, want_ids = route_linear_ref(x, weight, top_k, True, **kwargs)
    logits = (x @ weight.T + (bias if with_bias else 0)).float()
    same = (got_ids == want_ids).all(dim=1)
    for row in torch.nonzero(~same).flatten().tolist():
        top = logits[row].sort(descending=True).values
        assert (top[top_k - 1] - top[top_k]).abs() <= 0.02 * top[top_k - 1].abs() + 1e-3, row
    assert same.float().mean() >= 0.9
    torch.testing.assert_close(got_w[same], want_w[same], rtol=1e-2, atol=1e-2)
