"""GPT-OSS's router in bf16 on the CPU against transformers' `GptOssTopKRouter`: the logits with the bias
rounded once (``F.linear(x, W, b)``), the same experts in the same order, the weights within bf16."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

import engine_support as es
from unipage import LLM
from unipage.config import PoolConfig


def test_router_logits_weights_and_experts_match_transformers(tmp_path):
    from transformers import GptOssForCausalLM

    family = es.gptoss(tmp_path)
    llm = LLM(family.model_dir, device="cpu", dtype="bfloat16", kernels="torch", pool=PoolConfig(num_pages=64))
    model = llm.engine.model
    theirs = GptOssForCausalLM.from_pretrained(family.model_dir, torch_dtype=torch.bfloat16).model
    seen = {}

    def route(logits, top_k, renormalize, bias=None, weight_dtype=None):
        seen["logits"] = logits if bias is None else (logits + bias)  # what the routing kernel ranks
        seen["routed"] = model_ops.route(logits, top_k, renormalize, bias=bias, weight_dtype=weight_dtype)
        return seen["routed"]

    model_ops = model.ops
    model.ops = dataclasses.replace(model_ops, route=route, experts=lambda *a, **kw: None)
    x = torch.randn(64, model.layers[0].router.shape[1], generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(model.layers):
        xb = (x * (i + 1)).to(torch.bfloat16)
        model._moe(layer, xb, None, None, SimpleNamespace(lora=None))
        want_logits, want_scores, want_ids = theirs.layers[i].mlp.router(xb)
        assert torch.equal(seen["logits"], want_logits)  # one rounding, as transformers' F.linear with its bias
        weights, ids = seen["routed"]
        assert torch.equal(ids.long(), want_ids)
        torch.testing.assert_close(weights, want_scores.float(), rtol=8e-3, atol=8e-3)
