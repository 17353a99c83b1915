"""Typed, frozen configuration validated on construction.

Each field's comment doubles as its help text.  A bad value raises
``ValueError`` naming the field and the allowed range.  Nothing here imports
torch: dtypes are names (``"bfloat16"``, ``"float16"``, ``"float32"``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from functools import cached_property

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# LoRA targets, in the order they are laid out in an adapter's buffer.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
DENSE_TARGETS = ATTENTION_TARGETS + DENSE_MLP_TARGETS
# Per-expert targets of an MoE layer: the fused gate/up projection (output
# columns in the base model's gate_up order) and the down projection.
EXPERT_TARGETS = ("experts.gate_up", "experts.down")


def require(cond: bool, name: str, allowed: str, value: object) -> None:
    """Raise ``ValueError("<name> must be <allowed>, got <value>")`` unless ``cond`` (every config's check)."""
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def int_at_least(value: object, low: int) -> bool:
    """An int (not a bool) ``>= low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the base model: what the pool and the adapters must fit."""

    num_layers: int  # decoder layers, >= 1
    hidden_size: int  # model width, >= 1
    num_heads: int  # attention (query) heads, >= 1
    num_kv_heads: int  # key/value heads (GQA), >= 1, divides num_heads
    head_dim: int  # width of one attention head, >= 1
    intermediate_size: int = 0  # dense MLP width; 0 when every layer is MoE
    num_experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    top_k: int = 0  # experts per token, 1..num_experts (MoE only)
    expert_intermediate_size: int = 0  # width of one expert's MLP (MoE only)
    mlp_only_layers: tuple[int, ...] = ()  # MoE models: layers with a dense MLP instead
    gate_up_interleaved: bool = False  # MoE: the checkpoint's fused gate/up columns alternate gate, up
    #   (GPT-OSS); the engine de-interleaves weights and adapters to gate columns first
    sliding_layers: tuple[int, ...] = ()  # layers with sliding-window attention (GPT-OSS: every other one)
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included (>= 1 when it has any)
    dtype: str = "bfloat16"  # weights and pool: bfloat16, float16 or float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, name, "an integer >= 1", value)
        for name in ("intermediate_size", "num_experts", "top_k", "expert_intermediate_size"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, name, "an integer >= 0", value)
        require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 f"a divisor of num_heads={self.num_heads}", self.num_kv_heads)
        require(self.dtype in DTYPE_BYTES, "dtype", f"one of {sorted(DTYPE_BYTES)}", self.dtype)
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(self, "sliding_layers", tuple(sorted(set(self.sliding_layers))))
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        require(not bad, "sliding_layers", f"layer indices in [0, {self.num_layers})", bad)
        require(isinstance(self.sliding_window, int) and (self.sliding_window >= 1) == bool(self.sliding_layers),
                 "sliding_window", ">= 1 when sliding_layers is set, else 0", self.sliding_window)
        if self.num_experts:
            require(1 <= self.top_k <= self.num_experts, "top_k",
                     f"in [1, num_experts={self.num_experts}]", self.top_k)
            require(self.expert_intermediate_size >= 1, "expert_intermediate_size",
                     ">= 1 for an MoE model", self.expert_intermediate_size)
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
            require(not bad, "mlp_only_layers", f"layer indices in [0, {self.num_layers})", bad)
        else:
            require(self.top_k == 0, "top_k", "0 for a dense model (num_experts=0)", self.top_k)
            require(not self.mlp_only_layers, "mlp_only_layers", "empty for a dense model",
                     self.mlp_only_layers)
        if self.num_dense_mlp_layers:
            require(self.intermediate_size >= 1, "intermediate_size",
                     ">= 1 when any layer has a dense MLP", self.intermediate_size)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_dense_mlp_layers(self) -> int:
        return sum(1 for i in range(self.num_layers) if not self.is_moe_layer(i))

    # -- KV groups and pool rows ---------------------------------------------
    # Layers whose KV blocks share one block table form a *KV group*: the
    # full-attention layers, and the sliding-window layers, whose blocks leave
    # the pool once they fall out of the window.  A page id names one slot in
    # every *pool row*; the i-th layer of each group lives in row i, so a page
    # holds one KV block of one group's layers (or one row's adapter buffer).

    @cached_property
    def kv_groups(self) -> tuple[tuple[int, ...], ...]:
        """The full-attention layers, then the sliding-window ones; a single group when only one kind exists."""
        sliding = set(self.sliding_layers)
        full = tuple(i for i in range(self.num_layers) if i not in sliding)
        return tuple(group for group in (full, self.sliding_layers) if group)

    @cached_property
    def pool_rows(self) -> int:
        """Rows of the pool tensor: the largest KV group's layer count."""
        return max(len(group) for group in self.kv_groups)

    @cached_property
    def layer_rows(self) -> tuple[int, ...]:
        """The pool row of each layer (its index inside its KV group)."""
        rows = [0] * self.num_layers
        for group in self.kv_groups:
            for row, layer in enumerate(group):
                rows[layer] = row
        return tuple(rows)

    @property
    def hybrid_kv(self) -> bool:
        """Both full and sliding-window layers: two KV groups, each with its own block table."""
        return len(self.kv_groups) > 1

    def window(self, layer: int) -> int:
        """The attention window of ``layer``; 0 for full attention."""
        return self.sliding_window if layer in self.sliding_layers else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers

    def targets(self, layer: int) -> tuple[str, ...]:
        """The LoRA targets that exist in ``layer``, in buffer order."""
        if self.is_moe_layer(layer):
            return ATTENTION_TARGETS + EXPERT_TARGETS
        return DENSE_TARGETS

    def target_dims(self, target: str, layer: int) -> tuple[int, int]:
        """``(d_in, d_out)`` of a LoRA target in ``layer`` (per expert for experts.*)."""
        if target not in self.targets(layer):
            raise ValueError(f"layer {layer} has no LoRA target {target!r}; "
                             f"it has {list(self.targets(layer))}")
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        i, e = self.intermediate_size, self.expert_intermediate_size
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
            "experts.gate_up": (h, 2 * e), "experts.down": (e, h),
        }[target]

    @classmethod
    def from_hf(cls, hf: dict, dtype: str | None = None) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (Llama, Qwen3, Qwen3-MoE, Mixtral, OLMoE, GPT-OSS)."""
        heads = hf["num_attention_heads"]
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        mlp_only = tuple(hf.get("mlp_only_layers") or ())
        step = hf.get("decoder_sparse_step") or 1
        if num_experts and step > 1:
            mlp_only = tuple(sorted(set(mlp_only) | {i for i in range(hf["num_hidden_layers"])
                                                     if (i + 1) % step != 0}))
        expert_width = hf.get("moe_intermediate_size") or (hf.get("intermediate_size") if num_experts else 0)
        window = int(hf.get("sliding_window") or 0)
        sliding = tuple(i for i, kind in enumerate(hf.get("layer_types") or ()) if kind == "sliding_attention")
        return cls(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=(hf.get("intermediate_size") or 0) if (not num_experts or mlp_only) else 0,
            num_experts=num_experts,
            top_k=(hf.get("num_experts_per_tok") or 0) if num_experts else 0,
            expert_intermediate_size=expert_width or 0,
            mlp_only_layers=mlp_only,
            gate_up_interleaved=hf.get("model_type") == "gpt_oss",
            sliding_layers=sliding if window else (),
            sliding_window=window if sliding else 0,
            dtype=dtype or _hf_dtype(hf),
        )


def _hf_dtype(hf: dict) -> str:
    name = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    return name if name in DTYPE_BYTES else "bfloat16"


@dataclass(frozen=True)
class PoolConfig:
    """The unified page pool: a page is one KV block of every layer of one KV group (see `ModelConfig.kv_groups`)."""

    block_tokens: int = 16  # tokens per KV block, a power of two
    num_pages: int | None = None  # pages in the pool; or give memory_bytes instead
    memory_bytes: int | None = None  # pool byte budget over all pool rows; sets num_pages
    prefix_caching: bool = True  # reuse full KV blocks across requests with the same prefix and adapter

    def __post_init__(self) -> None:
        require(isinstance(self.block_tokens, int) and _is_pow2(self.block_tokens), "block_tokens",
                 "a power of two >= 1", self.block_tokens)
        require((self.num_pages is None) != (self.memory_bytes is None), "num_pages/memory_bytes",
                 "exactly one of the two set", (self.num_pages, self.memory_bytes))
        if self.num_pages is not None:
            require(isinstance(self.num_pages, int) and self.num_pages >= 1, "num_pages",
                     "an integer >= 1", self.num_pages)
        if self.memory_bytes is not None:
            require(isinstance(self.memory_bytes, int) and self.memory_bytes >= 1, "memory_bytes",
                     "an integer >= 1", self.memory_bytes)


@dataclass(frozen=True)
class LoRAConfig:
    """Adapters: limits, tiers and the eviction policy."""

    max_rank: int = 64  # largest LoRA rank accepted, 1..1024
    max_adapters_per_batch: int = 8  # distinct adapters in one step (a kernel grid dimension), >= 1
    host_cache_bytes: int = 8 << 30  # byte budget of the host tier (CPU memory), >= 0
    staging_ring_bytes: int | None = None  # pinned ring adapter loads pass through (CUDA), >= 1 MiB; None:
    #   256 MiB, replaced (while no load holds a slice) by one that holds two of an adapter too large for it,
    #   up to 4 GiB (`unipage.storage`)
    adapter_roots: tuple[str, ...] = ()  # directories adapters may be loaded from; empty = anywhere
    eviction_policy: str = "lru"  # lru, lfu, fifo, size, cost or idle (see unipage.eviction)
    h2d_bytes_per_s: float = 20e9  # host-to-device bandwidth, for the cost-aware policy
    disk_bytes_per_s: float = 2e9  # disk read bandwidth, for the cost-aware policy
    recompute_s_per_token: float = 20e-6  # prefill time of one token, the cost of a lost KV block
    moe_stack_entries: int = 0  # adapters whose expert LoRA MoE models also hold densely beside the pool, for
    #   steps of that many adapters or fewer (`unipage.models.moe_stacks`: about 1 GB an entry for Qwen3-30B-A3B
    #   at max_rank 8); 0 = none

    def __post_init__(self) -> None:
        require(isinstance(self.max_rank, int) and 1 <= self.max_rank <= 1024, "max_rank",
                 "an integer in [1, 1024]", self.max_rank)
        require(isinstance(self.max_adapters_per_batch, int) and self.max_adapters_per_batch >= 1,
                 "max_adapters_per_batch", "an integer >= 1", self.max_adapters_per_batch)
        require(isinstance(self.host_cache_bytes, int) and self.host_cache_bytes >= 0,
                 "host_cache_bytes", "an integer >= 0", self.host_cache_bytes)
        require(self.staging_ring_bytes is None or int_at_least(self.staging_ring_bytes, 1 << 20),
                 "staging_ring_bytes", "None or an integer >= 1 MiB (1048576)", self.staging_ring_bytes)
        require(isinstance(self.moe_stack_entries, int) and self.moe_stack_entries >= 0, "moe_stack_entries",
                "an integer >= 0", self.moe_stack_entries)
        for name in ("h2d_bytes_per_s", "disk_bytes_per_s", "recompute_s_per_token"):
            require(getattr(self, name) > 0, name, "> 0", getattr(self, name))
        roots = tuple(os.path.realpath(os.fspath(r)) for r in self.adapter_roots)
        object.__setattr__(self, "adapter_roots", roots)
        from unipage.eviction import POLICIES  # late: eviction imports nothing from here

        require(self.eviction_policy in POLICIES, "eviction_policy", f"one of {sorted(POLICIES)}",
                 self.eviction_policy)


@dataclass(frozen=True)
class UnipageConfig:
    """Model, pool and LoRA settings together, checked against each other."""

    model: ModelConfig
    pool: PoolConfig = field(default_factory=lambda: PoolConfig(num_pages=1024))
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        require(_is_pow2(self.page_elems) and self.page_elems >= 64, "pool.block_tokens",
                 "such that block_tokens * 2 * num_kv_heads * head_dim is a power of two >= 64",
                 self.pool.block_tokens)
        require(self.num_pages >= 1, "pool.memory_bytes",
                 f">= one page over all pool rows ({self.page_bytes} bytes)", self.pool.memory_bytes)

    @property
    def page_elems(self) -> int:
        """Elements in one page of one pool row: one KV block (K and V) of one layer."""
        m = self.model
        return self.pool.block_tokens * 2 * m.num_kv_heads * m.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all pool rows."""
        return self.page_elems * self.model.pool_rows * self.model.dtype_bytes

    @property
    def num_pages(self) -> int:
        if self.pool.num_pages is not None:
            return self.pool.num_pages
        return self.pool.memory_bytes // self.page_bytes

    def replace(self, **changes) -> "UnipageConfig":
        return dataclasses.replace(self, **changes)
