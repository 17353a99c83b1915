"""Config: validation names the field and the allowed range; Hugging Face configs map over."""

import pytest

from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig

DENSE = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96)


@pytest.mark.parametrize("field, value, message", [
    ("num_layers", 0, "num_layers must be an integer >= 1"),
    ("num_kv_heads", 3, "num_kv_heads must be a divisor of num_heads=4"),
    ("dtype", "int8", "dtype must be one of"),
    ("top_k", 2, "top_k must be 0 for a dense model"),
    ("intermediate_size", 0, "intermediate_size must be >= 1 when any layer has a dense MLP"),
])
def test_model_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**(DENSE | {field: value}))


def test_moe_config_checks():
    moe = dict(DENSE, intermediate_size=0, num_experts=4, top_k=2, expert_intermediate_size=32)
    model = ModelConfig(**moe)
    assert model.targets(0)[-2:] == ("experts.gate_up", "experts.down")
    assert model.target_dims("experts.gate_up", 0) == (64, 64)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\]"):
        ModelConfig(**(moe | {"top_k": 5}))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig(**(moe | {"mlp_only_layers": (7,)}))
    with pytest.raises(ValueError, match="has no LoRA target 'gate_proj'"):
        model.target_dims("gate_proj", 0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_tokens=12, num_pages=4), "block_tokens must be a power of two"),
    (dict(num_pages=4, memory_bytes=1024), "exactly one of the two"),
    (dict(), "exactly one of the two"),
    (dict(num_pages=0), "num_pages must be an integer >= 1"),
])
def test_pool_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_rank=0), r"max_rank must be an integer in \[1, 1024\]"),
    (dict(max_adapters_per_batch=0), "max_adapters_per_batch"),
    (dict(host_cache_bytes=-1), "host_cache_bytes"),
    (dict(staging_ring_bytes=(1 << 20) - 1), r"staging_ring_bytes must be None or an integer >= 1 MiB"),
    (dict(staging_ring_bytes=2.0 * (1 << 30)), "staging_ring_bytes"),
    (dict(eviction_policy="random"), "eviction_policy must be one of"),
    (dict(h2d_bytes_per_s=0), "h2d_bytes_per_s must be > 0"),
])
def test_lora_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_pages_from_a_byte_budget():
    model = ModelConfig(**DENSE, dtype="float16")  # page = 16 * 2 * 2 * 16 = 1024 elements
    config = UnipageConfig(model, PoolConfig(memory_bytes=10 * 1024 * 2 * 2 + 5))
    assert (config.page_elems, config.num_pages) == (1024, 10)
    with pytest.raises(ValueError, match="pool.memory_bytes"):
        UnipageConfig(model, PoolConfig(memory_bytes=100))
    with pytest.raises(ValueError, match="pool.block_tokens"):
        UnipageConfig(ModelConfig(**(DENSE | {"head_dim": 24})), PoolConfig(num_pages=4))


def test_adapter_roots_are_resolved(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert LoRAConfig(adapter_roots=(tmp_path / "link",)).adapter_roots == (str(tmp_path / "real"),)


def test_from_hf_qwen3_moe_and_mixtral():
    qwen = {"num_hidden_layers": 4, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "decoder_sparse_step": 2, "mlp_only_layers": [0],
            "torch_dtype": "bfloat16"}
    model = ModelConfig.from_hf(qwen)
    assert (model.num_experts, model.top_k, model.expert_intermediate_size) == (128, 8, 768)
    assert model.mlp_only_layers == (0, 2) and model.intermediate_size == 6144
    mixtral = {"num_hidden_layers": 2, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
               "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2}
    model = ModelConfig.from_hf(mixtral, dtype="float16")
    assert (model.head_dim, model.num_experts, model.expert_intermediate_size, model.intermediate_size) == \
        (128, 8, 14336, 0)
    assert model.dtype == "float16" and model.mlp_only_layers == ()


def test_sliding_layers_make_kv_groups_and_pool_rows():
    model = ModelConfig(**(DENSE | {"num_layers": 4}), sliding_layers=(2, 0, 0), sliding_window=16)
    assert model.sliding_layers == (0, 2) and model.hybrid_kv
    assert model.kv_groups == ((1, 3), (0, 2)) and model.pool_rows == 2 and model.layer_rows == (0, 0, 1, 1)
    assert [model.window(i) for i in range(4)] == [16, 0, 16, 0]
    plain = ModelConfig(**(DENSE | {"num_layers": 3}))
    assert plain.kv_groups == ((0, 1, 2),) and plain.pool_rows == 3 and not plain.hybrid_kv
    # a page covers one row of every group: with two groups a page is half as large, so twice as many fit
    budget = 64 * UnipageConfig(ModelConfig(**(DENSE | {"num_layers": 4})), PoolConfig(num_pages=1)).page_bytes
    assert UnipageConfig(model, PoolConfig(memory_bytes=budget)).num_pages == 128


@pytest.mark.parametrize("kwargs, message", [
    ({"sliding_layers": (0,), "sliding_window": 0}, "sliding_window"),
    ({"sliding_layers": (), "sliding_window": 8}, "sliding_window"),
    ({"sliding_layers": (9,), "sliding_window": 8}, "sliding_layers"),
])
def test_sliding_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**DENSE, **kwargs)


def test_from_hf_reads_gpt_oss_layer_types():
    hf = {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
          "intermediate_size": 32, "sliding_window": 128,
          "layer_types": ["sliding_attention", "full_attention"] * 2}
    model = ModelConfig.from_hf(hf)
    assert model.sliding_layers == (0, 2) and model.sliding_window == 128 and model.pool_rows == 2
    qwen = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 32, "sliding_window": None, "layer_types": ["full_attention"] * 2}
    assert ModelConfig.from_hf(qwen).sliding_layers == ()
