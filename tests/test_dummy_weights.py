"""``load_format="dummy"``: random weights from config.json alone, with exactly a real checkpoint's tensors."""

from __future__ import annotations

import dataclasses
import os
import shutil

import engine_support as es
import pytest
import torch
import transformers as tf

from unipage import LLM, SamplingParams
from unipage.config import ModelConfig, PoolConfig
from unipage.models.decoder import DecoderLM
from unipage.models.dummy import DummyCheckpoint
from unipage.models.ops import TORCH
from unipage.models.weights import Checkpoint, read_config

EXTRA = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"intermediate_size": 96}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"intermediate_size": 96}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"moe_intermediate_size": 32, "num_experts": 4,
                                                             "num_experts_per_tok": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"intermediate_size": 32, "num_local_experts": 4,
                                                         "num_experts_per_tok": 2}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"intermediate_size": 32, "num_experts": 4,
                                                   "num_experts_per_tok": 2}),
}


def _save(family: str, directory) -> str:
    if family == "gpt_oss":
        model = tf.GptOssForCausalLM(es.gptoss_config())
    else:
        config_name, model_name, extra = EXTRA[family]
        model = getattr(tf, model_name)(getattr(tf, config_name)(**es.pf.TINY, **extra))
    model.save_pretrained(directory)
    return str(directory)


def _shapes(model: DecoderLM) -> list:
    def shape(t):
        return None if t is None else (tuple(t.shape), t.dtype)

    layers = [{f.name: shape(v) if isinstance(v := getattr(layer, f.name), torch.Tensor | None) else v
               for f in dataclasses.fields(layer)} for layer in model.layers]
    return [shape(model.embed_tokens), shape(model.lm_head), model.lm_head is model.embed_tokens, shape(model.norm), layers]


@pytest.mark.parametrize("family", [*EXTRA, "gpt_oss"])
def test_dummy_weights_have_the_checkpoints_tensors(family, tmp_path):
    model_dir = _save(family, tmp_path)
    hf = read_config(model_dir)
    config = ModelConfig.from_hf(hf, "float32")
    real = DecoderLM(hf, config, Checkpoint(model_dir, torch.float32, torch.device("cpu")), TORCH)
    dummy = DecoderLM(hf, config, DummyCheckpoint(hf, torch.float32, torch.device("cpu")), TORCH)
    assert _shapes(dummy) == _shapes(real)
    assert dummy.layers[0].w_qkv.std().item() > 0.01  # random, not zeros


def test_llm_generates_from_config_json_alone(tmp_path):
    model_dir = _save("qwen3_moe", tmp_path / "full")
    alone = tmp_path / "config-only"
    os.makedirs(alone)
    shutil.copy(os.path.join(model_dir, "config.json"), alone)
    llm = LLM(alone, device="cpu", pool=PoolConfig(num_pages=64), load_format="dummy")
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0), max_tokens=5)
    assert [len(c.token_ids) for c in out] == [5, 5]
    with pytest.raises(ValueError, match="load_format"):
        LLM(alone, device="cpu", load_format="pickle")
