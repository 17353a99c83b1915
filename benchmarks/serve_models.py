"""Model shapes, config.json files and adapters for `benchmarks/serve.py`, and the decode step's HBM floor.

Shapes are the public config.json values of each model (random weights:
``load_format="dummy"``); ``tiny=True`` keeps each family's structure at toy
width for the CPU test.  ``layers`` cuts the depth to fit a smaller GPU (the
profile's name then says so: a cut model is not the real one).
"""

from __future__ import annotations

import os

import torch

from unipage.config import ATTENTION_TARGETS, DENSE_TARGETS, ModelConfig
from unipage.peft_write import write_random_adapter

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
GPTOSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
               "original_max_position_embeddings": 4096, "truncate": False, "rope_theta": 150000.0}
SHAPES = {  # key -> (transformers config class, its fields at the real shape)
    "gpt-oss-20b": ("GptOssConfig", {
        "vocab_size": 201088, "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "attention_bias": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "rope_scaling": GPTOSS_ROPE}),
    "llama3-8b": ("LlamaConfig", {
        "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "rope_scaling": LLAMA3_ROPE}),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", {
        "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "rope_theta": 1000000.0}),
    "llama-1b": ("LlamaConfig", {  # Llama-3.2-1B
        "vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 8192, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "tie_word_embeddings": True, "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}}),
}
TINY = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 96}
TINY_MOE = {"gpt-oss-20b": {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
            "qwen3-30b-a3b": {"moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2}}


def model_key(shape: str, tiny: bool, layers: int | None) -> str:
    """The name profiles and records use: the shape, marked when it is not the real model."""
    key = f"{shape}-tiny" if tiny else shape
    return f"{key}-L{layers}" if layers else key


def hf_config(shape: str, tiny: bool = False, layers: int | None = None):
    """The transformers config object of ``shape`` (optionally tiny and/or cut to ``layers``)."""
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {sorted(SHAPES)}")
    cls_name, fields = SHAPES[shape]
    fields = dict(fields)
    if tiny:
        fields.update(TINY, **TINY_MOE.get(shape, {}))
    if layers:
        fields["num_hidden_layers"] = layers
    if shape == "gpt-oss-20b":  # alternating sliding / full attention, as in the real config
        fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(fields["num_hidden_layers"])]
    return getattr(transformers, cls_name)(**fields)


def write_model_dir(root: str, shape: str, tiny: bool = False, layers: int | None = None) -> str:
    """A directory holding only ``config.json`` (for ``load_format="dummy"``)."""
    path = os.path.join(root, model_key(shape, tiny, layers))
    os.makedirs(path, exist_ok=True)
    hf_config(shape, tiny, layers).to_json_file(os.path.join(path, "config.json"))
    return path


def lora_targets(kind: str) -> tuple[str, ...]:
    """``attention`` (q, k, v, o) or ``all`` (every linear layer: + the dense MLP or every expert)."""
    if kind not in ("attention", "all"):
        raise ValueError(f"targets must be 'attention' or 'all', got {kind!r}")
    return ATTENTION_TARGETS if kind == "attention" else DENSE_TARGETS + ("experts",)


def write_adapters(root: str, model: ModelConfig, count: int, rank: int, targets: str, log=None) -> list[str]:
    """``count`` random PEFT adapters (seeds 0..count-1; experts in PEFT's fused ``target_parameters`` format)."""
    paths = []
    for i in range(count):
        path = os.path.join(root, f"a{i}")
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            write_random_adapter(path, model, rank=rank, alpha=2 * rank, targets=lora_targets(targets),
                                 expert_format="fused", seed=i, dtype=getattr(torch, model.dtype))
        paths.append(path)
        if log and (i + 1) % max(1, count // 10) == 0:
            log(f"adapters written: {i + 1}/{count}")
    return paths


def experts_touched(model: ModelConfig, tokens: int) -> float:
    """Expected distinct experts hit by ``tokens`` tokens routed top-k of E uniformly (the simulator's term)."""
    e = model.num_experts
    return e * (1.0 - (1.0 - model.top_k / e) ** tokens) if e and tokens else 0.0


class DecodeFloor:
    """Bytes one decode step must read from HBM: attention, router and touched experts (or the dense
    MLP), lm_head, embedding rows, the LoRA weights of the step's adapters, and the KV it attends to.
    Norms, biases and attention sinks are left out (well under 0.1%)."""

    def __init__(self, hf: dict, model: ModelConfig, targets: str, rank: int) -> None:
        self.model, self.rank = model, rank
        self.targets = lora_targets(targets)
        self.bytes_per = model.dtype_bytes
        layer_types = hf.get("layer_types") or ["full_attention"] * model.num_layers
        self.window = int(hf.get("sliding_window") or 0)
        self.sliding = sum(1 for t in layer_types if t == "sliding_attention")
        self.kv_token = 2 * model.num_kv_heads * model.head_dim  # elements per token per layer
        self.vocab = int(hf["vocab_size"])
        self.lora_dense, self.lora_expert = self._lora_sizes()

    def weights(self, tokens: int) -> float:
        """Elements of base weights read by a step of ``tokens`` decode tokens."""
        m = self.model
        h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        total = (self.vocab + tokens) * h  # lm_head + embedding rows
        for layer in range(m.num_layers):
            total += 2 * h * q + 2 * h * kv
            if m.is_moe_layer(layer):
                total += m.num_experts * h + experts_touched(m, tokens) * 3 * h * m.expert_intermediate_size
            else:
                total += 3 * h * m.intermediate_size
        return total

    def experts(self, per_layer: float) -> float:
        """Elements of ``per_layer`` experts' weights in every MoE layer (`weights` counts `experts_touched`)."""
        m = self.model
        return sum(m.is_moe_layer(i) for i in range(m.num_layers)) * per_layer * 3 * m.hidden_size \
            * m.expert_intermediate_size

    def lora(self, adapter_tokens: list[int]) -> float:
        """Elements of LoRA weights read: each adapter's dense targets, and the experts its tokens touch."""
        return sum(self.lora_dense + experts_touched(self.model, t) * self.lora_expert for t in adapter_tokens)

    def _lora_sizes(self) -> tuple[int, int]:
        """Elements of one adapter's dense targets, and of one expert's targets summed over MoE layers."""
        m, dense, expert = self.model, 0, 0
        for layer in range(m.num_layers):
            for target in m.targets(layer):
                size = self.rank * sum(m.target_dims(target, layer))
                if target.startswith("experts."):
                    expert += size if "experts" in self.targets else 0
                elif target in self.targets:
                    dense += size
        return dense, expert

    def kv(self, contexts: list[int]) -> float:
        full = self.model.num_layers - self.sliding
        reads = sum(full * c + self.sliding * (min(c, self.window) if self.window else c) for c in contexts)
        return reads * self.kv_token

    def bytes(self, contexts: list[int], adapter_tokens: list[int]) -> dict:
        """Bytes by part for a decode step over requests with these contexts and adapters' token counts."""
        b = self.bytes_per
        return {"weights": self.weights(len(contexts)) * b, "lora": self.lora(adapter_tokens) * b,
                "kv": self.kv(contexts) * b}
