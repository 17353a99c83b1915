"""A MoE layer's add, norm, router GEMV and routing in one launch (`kernels.norm_route`), Triton
interpreter at tiny shapes, against `add_rms_norm_route_ref` (the three torch steps)."""

from __future__ import annotations

import pytest
import torch
from unipage.kernels import norm_route
from unipage.kernels.norm_route import add_rms_norm_route, add_rms_norm_route_ref


def inputs(tokens, n=600, experts=12, dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    h, delta = rand(tokens, n), rand(tokens, n)
    return h, delta, rand(n) * 0.5 + 1, rand(experts, n), rand(experts) if bias else None


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("top_k,renormalize,bias", [(2, True, True), (4, False, False)])
def test_matches_reference_fp32(tokens, top_k, renormalize, bias):
    """n 600: three chunks of the GEMV, the last partial; 12 experts: padded to 16."""
    h, delta, weight, router, b = inputs(tokens, bias=bias)
    assert norm_route.fits(tokens, router)
    got = add_rms_norm_route(h, delta, weight, 1e-6, router, top_k, renormalize, bias=b)
    want = add_rms_norm_route_ref(h, delta, weight, 1e-6, router, top_k, renormalize, bias=b)
    for g, w in zip(got[:3], want[:3]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], want[3]) and got[3].dtype == torch.int32


def test_fp16_and_weight_rounding():
    h, delta, weight, router, b = inputs(4, dtype=torch.float16, seed=1)
    got = add_rms_norm_route(h, delta, weight, 1e-5, router, 3, True, bias=b, weight_dtype=torch.float16)
    want = add_rms_norm_route_ref(h, delta, weight, 1e-5, router, 3, True, bias=b, weight_dtype=torch.float16)
    assert torch.equal(got[0], want[0])  # the residual sum: one rounding either way
    torch.testing.assert_close(got[1], want[1], rtol=2e-3, atol=2e-3)
    assert torch.equal(got[3], want[3])
    torch.testing.assert_close(got[2], want[2], rtol=2e-3, atol=2e-3)
    assert torch.equal(got[2], got[2].half().float())  # the weights on fp16's grid


def test_large_steps_take_the_three_launches(monkeypatch):
    """Past `MAX_ROUTER_READS` the same results come from add_rms_norm, the router's GEMM and route_topk."""
    h, delta, weight, router, b = inputs(3, seed=2)
    one = add_rms_norm_route(h, delta, weight, 1e-6, router, 2, True, bias=b)
    monkeypatch.setattr(norm_route, "MAX_ROUTER_READS", 3 * router.numel() * 4 - 1)
    assert not norm_route.fits(3, router)
    calls = []
    monkeypatch.setattr(norm_route, "route_topk", lambda *a: calls.append(1) or norm_route.route_topk_ref(*a))
    three = add_rms_norm_route(h, delta, weight, 1e-6, router, 2, True, bias=b)
    assert calls == [1]
    for a, c in zip(one[:3], three[:3]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    assert torch.equal(one[3], three[3])


def test_bad_input():
    h, delta, weight, router, b = inputs(2)
    with pytest.raises(ValueError, match="router must be"):
        add_rms_norm_route(h, delta, weight, 1e-6, router[:, :10], 2, True)
    with pytest.raises(ValueError, match="h and delta"):
        add_rms_norm_route(h, delta[:1], weight, 1e-6, router, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        add_rms_norm_route(h, delta, weight, 1e-6, router, 13, True)
    with pytest.raises(ValueError, match="bias"):
        add_rms_norm_route(h, delta, weight, 1e-6, router, 2, True, bias=b[:3])
