"""GPT-OSS expert options of the fused MoE and fused_moe_lora: per-expert biases and the
clamped SwiGLU (`unipage.kernels.moe_act`), under the Triton interpreter against the
references, and the references against a per-token loop written from transformers' formula."""

import pytest
import torch

import test_kernel_fused_moe as base
import test_kernel_fused_moe_lora as lora_tests
from unipage.kernels.fused_moe import fused_experts, fused_experts_ref, route_topk_ref
from unipage.kernels.moe_act import GatedActivation

OAI = GatedActivation("swiglu_clamp", alpha=1.702, limit=1.5)  # a low limit: the clamps bite at test scale


def _biases(dtype, experts, inter, hidden, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 2 * inter, generator=g) * 0.5).to(dtype), \
        (torch.randn(experts, hidden, generator=g) * 0.5).to(dtype)


def _gptoss_expert(x, w_gu, b_gu, w_d, b_d, act: GatedActivation):
    """transformers' GptOssExperts for one token and expert, with gate/up de-interleaved (gate rows first)."""
    inter = w_d.shape[1]
    h = w_gu.float() @ x.float() + b_gu.float()
    gate, up = h[:inter].clamp(max=act.limit), h[inter:].clamp(-act.limit, act.limit)
    return w_d.float() @ ((up + 1) * gate * torch.sigmoid(gate * act.alpha)) + b_d.float()


def test_activation_reference():
    g, u = torch.linspace(-4, 4, 9), torch.linspace(3, -3, 9)
    assert torch.equal(GatedActivation().ref(g, u), torch.nn.functional.silu(g) * u)
    want = (u.clamp(-1.5, 1.5) + 1) * g.clamp(max=1.5) * torch.sigmoid(1.702 * g.clamp(max=1.5))
    torch.testing.assert_close(OAI.ref(g, u), want)
    with pytest.raises(ValueError, match="activation kind"):
        GatedActivation("gelu")


def test_reference_matches_gptoss_loop():
    w_gu, w_d = base._weights(torch.float32, seed=1)
    b_gu, b_d = _biases(torch.float32, base.E, base.I, base.H)
    x, logits = base._inputs(9, torch.float32, seed=1)
    weights, ids = route_topk_ref(logits, base.K, True)
    got = fused_experts_ref(x, w_gu, w_d, weights, ids, gate_up_bias=b_gu, down_bias=b_d, activation=OAI)
    want = torch.zeros_like(got)
    for t in range(9):
        for j in range(base.K):
            e = int(ids[t, j])
            want[t] += float(weights[t, j]) * _gptoss_expert(x[t], w_gu[e], b_gu[e], w_d[e], b_d[e], OAI)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", ["even", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_triton_with_biases_and_clamped_swiglu(num_tokens, dtype, config):
    w_gu, w_d = base._weights(dtype, seed=num_tokens)
    b_gu, b_d = _biases(dtype, base.E, base.I, base.H)
    x, logits = base._inputs(num_tokens, dtype, seed=num_tokens)
    weights, ids = route_topk_ref(logits, base.K, True)
    options = dict(gate_up_bias=b_gu, down_bias=b_d, activation=OAI)
    got = fused_experts(x, w_gu, w_d, weights, ids, config=base.CONFIGS[config], **options)
    want = fused_experts_ref(x, w_gu, w_d, weights, ids, config=base.CONFIGS[config], **options)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    plain = fused_experts_ref(x, w_gu, w_d, weights, ids)
    assert base._rel_err(want, plain) > 0.1  # the options change the output


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mode, num_tokens", [("pair", 1), ("group", 40)])
def test_lora_with_biases_and_clamped_swiglu(mode, num_tokens, dtype):
    c = lora_tests._case(num_tokens, dtype, "identical" if num_tokens == 1 else "uniform", seed=num_tokens)
    b_gu, b_d = _biases(dtype, lora_tests.E, lora_tests.I, lora_tests.H)
    config = lora_tests.PAIR if mode == "pair" else lora_tests.GROUP
    options = dict(gate_up_bias=b_gu, down_bias=b_d, activation=OAI)
    args = (c["x"], c["w_gate_up"], c["w_down"], c["topk_weights"], c["topk_ids"], c["lora"],
            lora_tests.BASE_CONFIG, config)
    got, want = fused_experts(*args, **options), fused_experts_ref(*args, **options)
    lora_tests._close(got, want, dtype)
    no_lora = fused_experts_ref(*args[:5], None, lora_tests.BASE_CONFIG, **options)
    assert base._rel_err(want, no_lora) > 1e-2  # LoRA still applies under the other activation
