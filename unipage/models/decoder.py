"""One decoder-only model definition for every supported family, on the paged kernels.

Shape legend: T = tokens of the step, B = sequences, H = hidden size,
Q = heads·head_dim, KV = kv_heads·head_dim, I = MLP width, E = experts,
V = vocabulary, L = layers, N = pool pages, P = page_elems.

Per layer (pre-norm residual, as in transformers)::

    x = rmsnorm(h);  qkv = x Wqkv^T (+ LoRA q, k, v);  q/k norm (Qwen3, OLMoE);  rope
    write K, V into the request's KV pages;  a = paged attention over the whole context
    h = h + (a Wo^T + LoRA o)
    x = rmsnorm(h);  h = h + MLP(x)
    MLP = dense: (silu(x Wg^T + LoRA g) * (x Wu^T + LoRA u)) Wd^T + LoRA d
          MoE:   top-k softmax routing, then the fused experts with the paged fused_moe_lora

Families differ only in a `Family` record: q/k norm (none, per head, over the
whole projection), MoE routing renormalisation, and GPT-OSS's extras (attention
sinks, sliding-window layers, biases on o, the router and the experts, the
clamped SwiGLU; YaRN rope comes from the config).  q/k/v biases are read
wherever the checkpoint has them.  Adapter LoRA
deltas are applied per token through its adapter slot (-1: none), reading A
and B from the unified pool's pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unipage.config import ModelConfig
from unipage.errors import CheckpointError
from unipage.kernels import MoeLora, plan_lora_batch
from unipage.kernels.moe_act import SILU, GatedActivation
from unipage.kernels.moe_lora_stack import MoeLoraStack
from unipage.kernels.moe_ranks import SlotRanks, slot_ranks
from unipage.models import rope
from unipage.models.lora_tables import LayerLora, LoraTables
from unipage.models.moe_stacks import MoeStacks
from unipage.models.ops import Ops
from unipage.models.shrink_stack import ShrinkStack, StackedWeight
from unipage.models.weights import Checkpoint


@dataclass(frozen=True)
class Family:
    qk_norm: str  # "none", "head" (RMSNorm per head, Qwen3) or "full" (over the whole projection, OLMoE)
    moe: bool
    renormalize: str | bool  # MoE: renormalise the top-k weights (a bool, or the config key holding it)
    gptoss: bool = False  # sinks, sliding windows, o/router/expert biases, clamped SwiGLU


FAMILIES = {
    "llama": Family("none", False, False),
    "mistral": Family("none", False, False),
    "qwen2": Family("none", False, False),
    "qwen3": Family("head", False, False),
    "qwen3_moe": Family("head", True, "norm_topk_prob"),
    "mixtral": Family("none", True, True),
    "olmoe": Family("full", True, "norm_topk_prob"),
    "gpt_oss": Family("none", True, True, gptoss=True),  # softmax over the top-k logits = renormalised
}


@dataclass
class StepBatch:
    """The tensors of one step, built once by the model runner and shared by every layer (the pieces of the
    mixed-step graphs get placeholders for the fields only the attention reads)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: page * block_tokens + row of each token's KV
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context after this step (prefix + new tokens)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: each sequence's rows in the step's tokens
    max_q_len: int  # largest new-token count of a sequence
    token_slots: torch.Tensor  # [T] int32: adapter slot per token, -1 = none
    logits_rows: torch.Tensor  # [R] int64: token rows whose logits are wanted (the sampling ones)
    any_lora: bool  # some token has an adapter
    group_tokens: int  # tokens of the largest adapter group (the dense LoRA tile height hint)
    active_slots: int  # distinct adapters among the tokens
    window_slot_mapping: torch.Tensor | None = None  # [T] int64, models with full and sliding-window layers
    #   (`ModelConfig.hybrid_kv`): slot_mapping in the sliding layers' own block tables
    window_block_tables: torch.Tensor | None = None  # [B, max_blocks] int32: those tables (-1 before the window)
    num_decodes: int = 0  # leading sequences with one new token (a mixed step's decodes): the decode kernel
    #   attends them, the prefill kernel the rest (`DecoderLM.attend`)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [Q + 2 KV, H]
    b_qkv: torch.Tensor | None  # [Q + 2 KV]
    w_o: torch.Tensor  # [H, Q]
    b_o: torch.Tensor | None  # [H]
    q_norm: torch.Tensor | None  # [D] (per head) or [Q] (full)
    k_norm: torch.Tensor | None
    w_gate_up: torch.Tensor | None = None  # dense [2I, H]
    w_down: torch.Tensor | None = None  # dense [H, I]
    router: torch.Tensor | None = None  # MoE [E, H]
    experts_gate_up: torch.Tensor | None = None  # MoE [E, 2I, H]
    experts_down: torch.Tensor | None = None  # MoE [E, H, I]
    router_bias: torch.Tensor | None = None  # GPT-OSS [E]
    experts_gate_up_bias: torch.Tensor | None = None  # GPT-OSS [E, 2I]
    experts_down_bias: torch.Tensor | None = None  # GPT-OSS [E, H]
    sinks: torch.Tensor | None = None  # GPT-OSS [heads] float32: attention sink logits
    window: int = 0  # sliding-window length of this layer's attention; 0 = full
    qkv_stack: StackedWeight | None = None  # q/k/v's shrink stack (w_qkv, b_qkv: views of it), or None
    o_stack: StackedWeight | None = None  # o's
    moe_stack: MoeLoraStack | None = None  # the experts' MoE LoRA stack (`moe_stacks`), or None


class DecoderLM:
    """A causal LM whose KV cache and adapters live in the unified pool."""

    def __init__(self, hf: dict, model: ModelConfig, ckpt: Checkpoint, ops: Ops) -> None:
        kind = hf["model_type"]
        if kind not in FAMILIES:
            raise CheckpointError(f"model_type {kind!r} is not supported; supported: {sorted(FAMILIES)}")
        quant = (hf.get("quantization_config") or {}).get("quant_method")
        if quant:
            raise CheckpointError(f"quantized checkpoints ({quant}) are not supported yet; use a bf16 checkpoint")
        self.family, self.model, self.ops = FAMILIES[kind], model, ops
        self.activation = GatedActivation("swiglu_clamp", float(hf.get("swiglu_alpha", 1.702)),
                                          float(hf.get("swiglu_limit", 7.0))) if self.family.gptoss else SILU
        self.eps = float(hf.get("rms_norm_eps", 1e-6))
        renorm = self.family.renormalize
        self.renormalize = bool(hf.get(renorm, False)) if isinstance(renorm, str) else renorm
        self.scale = model.head_dim ** -0.5
        freq, self.rope_scale = rope.frequencies(hf, model.head_dim)
        self.inv_freq = freq.to(ckpt.device)
        h, vocab = model.hidden_size, hf["vocab_size"]
        self.embed_tokens = ckpt.get("model.embed_tokens.weight", (vocab, h))
        tied = hf.get("tie_word_embeddings", False) or "lm_head.weight" not in ckpt
        self.lm_head = self.embed_tokens if tied else ckpt.get("lm_head.weight", (vocab, h))
        self.norm = ckpt.get("model.norm.weight", (h,))
        self.layers = [self._load_layer(ckpt, i) for i in range(model.num_layers)]
        self.stack: ShrinkStack | None = None  # over the layers' q/k/v and o, once the engine builds one
        self.moe_stacks: MoeStacks | None = None  # the MoE layers' LoRA stacks, if the engine builds them

    # -- weights ---------------------------------------------------------
    def _load_layer(self, ckpt: Checkpoint, i: int) -> LayerWeights:
        m, p = self.model, f"model.layers.{i}"
        h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        attn = f"{p}.self_attn"
        w_qkv = torch.cat([ckpt.get(f"{attn}.{n}.weight", (d, h))
                           for n, d in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))])
        biases = [ckpt.optional(f"{attn}.{n}.bias") for n in ("q_proj", "k_proj", "v_proj")]
        b_qkv = torch.cat(biases) if all(b is not None for b in biases) else None
        norm_dims = {"none": None, "head": (m.head_dim, m.head_dim), "full": (q, kv)}[self.family.qk_norm]
        layer = LayerWeights(
            ckpt.get(f"{p}.input_layernorm.weight", (h,)), ckpt.get(f"{p}.post_attention_layernorm.weight", (h,)),
            w_qkv, b_qkv, ckpt.get(f"{attn}.o_proj.weight", (h, q)), ckpt.optional(f"{attn}.o_proj.bias", (h,)),
            ckpt.get(f"{attn}.q_norm.weight", (norm_dims[0],)) if norm_dims else None,
            ckpt.get(f"{attn}.k_norm.weight", (norm_dims[1],)) if norm_dims else None)
        layer.window = m.window(i)
        if self.family.gptoss:
            self._load_gptoss(ckpt, i, layer)
        elif m.is_moe_layer(i):
            e, inter = m.num_experts, m.expert_intermediate_size
            prefix, layer.experts_gate_up, layer.experts_down = ckpt.expert_weights(p, e, h, inter)
            layer.router = ckpt.get(f"{prefix}.gate.weight", (e, h))
        else:
            inter = m.intermediate_size
            layer.w_gate_up = torch.cat([ckpt.get(f"{p}.mlp.gate_proj.weight", (inter, h)),
                                         ckpt.get(f"{p}.mlp.up_proj.weight", (inter, h))])
            layer.w_down = ckpt.get(f"{p}.mlp.down_proj.weight", (h, inter))
        return layer

    def _load_gptoss(self, ckpt: Checkpoint, i: int, layer: LayerWeights) -> None:
        m, p = self.model, f"model.layers.{i}"
        e, h = m.num_experts, m.hidden_size
        layer.sinks = ckpt.get(f"{p}.self_attn.sinks", (m.num_heads,)).float()
        layer.router = ckpt.get(f"{p}.mlp.router.weight", (e, h))
        layer.router_bias = ckpt.get(f"{p}.mlp.router.bias", (e,))
        (layer.experts_gate_up, layer.experts_gate_up_bias, layer.experts_down,
         layer.experts_down_bias) = ckpt.gptoss_experts(f"{p}.mlp.experts", e, h, m.expert_intermediate_size)

    # -- forward ---------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: StepBatch, pool: torch.Tensor, lora: LoraTables | None,
                block_tokens: int) -> torch.Tensor:
        """Logits ``[R, V]`` float32 of ``batch.logits_rows``; writes the step's KV into ``pool [L, N, P]``."""
        return self.logits(self.hidden_states(batch, pool, lora, block_tokens))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, V]`` float32 from the final norm's output ``[R, H]``."""
        return (hidden @ self.lm_head.T).float()

    @torch.inference_mode()
    def hidden_states(self, batch: StepBatch, pool: torch.Tensor, lora: LoraTables | None,
                      block_tokens: int) -> torch.Tensor:
        """The final norm's output ``[R, H]`` at ``batch.logits_rows``; writes the step's KV into the pool.

        ``pool [L, N, P]`` has one row per layer of a KV group; layer ``i`` uses row ``layer_rows[i]``.
        The pass is the pieces below in order: `embed`, then per layer `attention_in`, `attend`,
        `layer_out` (`unipage.mixed_graphs` replays the pieces between the attentions as CUDA graphs).
        """
        ctx = self.context(batch, lora)
        h, x = self.embed(batch)
        return self.run_layers(0, len(self.layers), h, x, pool, ctx, block_tokens)[1]

    def run_layers(self, start: int, end: int, h: torch.Tensor, x: torch.Tensor, pool: torch.Tensor,
                   ctx: _Context, block_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Layers ``[start, end)`` on the residual stream ``h`` and its input norm ``x``: ``(h, x)`` after them
        (after the last layer, as `layer_out` gives it: None and the final norm of ``ctx.batch.logits_rows``)."""
        for i in range(start, end):
            q = self.attention_in(i, x, pool, ctx)
            attended = self.attend(i, q, pool, ctx.batch, block_tokens)
            h, x = self.layer_out(i, h, attended, pool, ctx, ctx.batch.logits_rows)
        return h, x

    def context(self, batch: StepBatch, lora: LoraTables | None) -> _Context:
        """What every layer of the step shares: rope tables, the LoRA tables if a token has an adapter,
        the dense LoRA plan, the shrink stack, the slot ranks of the MoE LoRA alignment (`slot_ranks`)."""
        if self.model.hybrid_kv and batch.window_block_tables is None:
            raise ValueError("this model mixes full and sliding-window layers: the batch needs window tables")
        cos, sin = rope.cos_sin(self.inv_freq, batch.positions, self.embed_tokens.dtype, self.rope_scale)
        lora_on = batch.any_lora and lora is not None and lora.page_table is not None
        plan = None
        if lora_on and self.ops.plans_lora:
            plan = plan_lora_batch(batch.token_slots, lora.num_slots, group_tokens=batch.group_tokens,
                                   max_groups=batch.active_slots)
        stack = self.stack if lora_on and self.stack is not None and self.stack.covers(batch.input_ids.shape[0]) \
            else None
        ranks, moe_stacks = None, None
        if lora_on and lora.any_moe_lora and self.moe_stacks is not None \
                and self.moe_stacks.covers(batch.input_ids.shape[0], batch.active_slots):
            moe_stacks = self.moe_stacks
        elif lora_on and self.ops.plans_lora and lora.any_moe_lora:  # one launch for every MoE layer
            ranks = slot_ranks(batch.token_slots, lora.page_table.shape[0], batch.active_slots)
        return _Context(batch, cos, sin, lora if lora_on else None, plan, stack, ranks, moe_stacks)

    def embed(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, x)``: the token embeddings ``[T, H]`` and the first layer's input norm of them."""
        h = self.embed_tokens[batch.input_ids]
        return h, self.ops.rms_norm(h, self.layers[0].input_norm, self.eps)

    def attention_in(self, i: int, x: torch.Tensor, pool: torch.Tensor, ctx: _Context) -> torch.Tensor:
        """Layer ``i`` up to its attention: q ``[T, heads, D]`` (contiguous); the step's K and V written."""
        layer, pool_l, layer_lora = self._layer(i, pool, ctx)
        m, tokens = self.model, x.shape[0]
        qkv = self._project(x, layer.w_qkv, layer.b_qkv, pool_l, layer_lora and layer_lora.qkv, ctx, layer.qkv_stack)
        q_width, kv_width = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        norm = self.ops.rms_norm
        if self.family.qk_norm == "full":
            q, k = norm(q, layer.q_norm, self.eps), norm(k, layer.k_norm, self.eps)
        q = q.reshape(tokens, m.num_heads, m.head_dim)
        k = k.reshape(tokens, m.num_kv_heads, m.head_dim)
        v = v.reshape(tokens, m.num_kv_heads, m.head_dim)
        if self.family.qk_norm == "head":
            q, k = norm(q, layer.q_norm, self.eps), norm(k, layer.k_norm, self.eps)
        slot_mapping, _ = _kv_tables(layer, ctx.batch)  # q' new and contiguous; k' and v only into their pages
        return self.ops.rope_write_kv(q, k, v, ctx.cos, ctx.sin, pool_l, slot_mapping)

    def layer_out(self, i: int, h: torch.Tensor, attended: torch.Tensor, pool: torch.Tensor, ctx: _Context,
                  rows: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Layer ``i`` after its attention (``attended [T, heads, D]``): ``(h, x)``, the residual stream and
        the next layer's input norm of it.  After the last layer x is the final norm, of ``rows`` only
        (None: of every row), and h is None."""
        layer, pool_l, layer_lora = self._layer(i, pool, ctx)
        out = attended.reshape(attended.shape[0], -1)
        o = self._project(out, layer.w_o, layer.b_o, pool_l, layer_lora and layer_lora.o, ctx, layer.o_stack)
        # each residual add is fused with the norm after it: x = rmsnorm(h) of the h just formed
        h, x = self.ops.add_rms_norm(h, o, layer.post_norm, self.eps)
        mlp = (self._moe if layer.router is not None else self._mlp)(layer, x, pool_l, layer_lora, ctx)
        if i + 1 < len(self.layers):
            return self.ops.add_rms_norm(h, mlp, self.layers[i + 1].input_norm, self.eps)
        if rows is not None:  # the last residual add and the final norm only for the rows sampled
            h, mlp = h[rows], mlp[rows]
        return None, self.ops.add_rms_norm(h, mlp, self.norm, self.eps)[1]

    def _layer(self, i: int, pool: torch.Tensor, ctx: _Context):
        """Layer ``i``'s weights, its pool row ``[N, P]`` and its LoRA tables (None: no adapter this step)."""
        return (self.layers[i], pool[self.model.layer_rows[i]],
                ctx.lora.layers[i] if ctx.lora is not None else None)

    def _project(self, x, w, bias, pool_l, meta, ctx: _Context, stacked: StackedWeight | None = None) -> torch.Tensor:
        """``x @ w.T (+ bias)`` plus the LoRA delta of ``meta``'s targets (None: the layer has no LoRA
        for them).  ``stacked``: the projection's shrink stack (`shrink_stack`), used in steps that take it."""
        if self._has_lora(meta, ctx) and ctx.stack is not None and stacked is not None:
            out = self.ops.linear(x, stacked.ext, stacked.bias)  # the projection and every entry's h = x @ A.T
            return self.ops.lora_expand_stacked(out[:, :stacked.n], out[:, stacked.n:], ctx.stack.entry_of_slot,
                                                pool_l, ctx.lora.page_table, ctx.batch.token_slots, meta,
                                                rank_block=ctx.stack.rank_block, batch=ctx.plan)
        if self._has_lora(meta, ctx):  # the projection and its delta (`linear_lora`: separate launches or one kernel)
            return self.ops.linear_lora(x, w, bias, pool_l, ctx.lora.page_table, ctx.batch.token_slots, meta,
                                        batch=ctx.plan, early=True)  # (the shrink may start as x's writer drains)
        return self.ops.linear(x, w, bias)  # (the bias in the GEMM's epilogue: one launch, one rounding)

    @staticmethod
    def _has_lora(meta, ctx: _Context) -> bool:
        return ctx.lora is not None and meta is not None and meta.max_rank > 0  # (0: no resident adapter has it)

    def attend(self, i: int, q: torch.Tensor, pool: torch.Tensor, b: StepBatch, block_tokens: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``i``'s paged attention of ``q [T, heads, D]`` over each sequence's context (written to
        ``out`` if given); reads only ``b``'s block tables (the window's too), lengths, ``cu_seqlens_q``,
        ``max_q_len`` and ``num_decodes``."""
        layer, m = self.layers[i], self.model
        pool_l, (_, tables) = pool[m.layer_rows[i]], _kv_tables(layer, b)
        extra = {}
        if layer.sinks is not None:
            extra["sinks"] = layer.sinks
        if layer.window:
            extra["sliding_window"] = layer.window
        decode = self.ops.attention_decode
        if decode is not None and b.max_q_len == 1 and q.shape[0] == b.seq_lens.shape[0]:
            return decode(q, pool_l, tables, b.seq_lens, self.scale, block_tokens, m.num_kv_heads, out=out, **extra)
        skip = b.num_decodes if decode is not None and (out is None or out.is_contiguous()) else 0
        if skip:  # a mixed step's leading decodes: the decode kernel (context splits), the rest the prefill one
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
            decode(q[:skip], pool_l, tables[:skip], b.seq_lens[:skip], self.scale, block_tokens, m.num_kv_heads,
                   out=out[:skip], **extra)
        return self.ops.attention_prefill(q, pool_l, tables, b.cu_seqlens_q, b.seq_lens, self.scale,
                                          block_tokens, m.num_kv_heads, max_q_len=b.max_q_len, out=out,
                                          skip=skip, **extra)

    def _mlp(self, layer: LayerWeights, x, pool_l, layer_lora: LayerLora | None, ctx: _Context):
        meta = layer_lora and layer_lora.gate_up
        gate_up = self.ops.linear(x, layer.w_gate_up, None)
        if self._has_lora(meta, ctx):  # the LoRA expand and the activation in one kernel where that is faster
            shrunk = self.ops.lora_shrink(x, pool_l, ctx.lora.page_table, ctx.batch.token_slots, meta, batch=ctx.plan,
                                          early=True)
            act = self.ops.lora_silu_mul(gate_up, shrunk)
        else:
            act = self.ops.silu_mul(gate_up)
        return self._project(act, layer.w_down, None, pool_l, layer_lora and layer_lora.down, ctx)

    def _moe(self, layer: LayerWeights, x, pool_l, layer_lora: LayerLora | None, ctx: _Context):
        # the router's bias goes into its GEMM (one rounding, as transformers' F.linear); the routing kernel
        # rounds the weights to the model dtype, as transformers does
        logits = self.ops.linear(x, layer.router, layer.router_bias)
        weights, ids = self.ops.route(logits, self.model.top_k, self.renormalize, weight_dtype=x.dtype)
        moe_lora = None
        if ctx.lora is not None and layer_lora.moe.any_lora:
            moe_lora = MoeLora(pool_l, ctx.lora.page_table, ctx.batch.token_slots, layer_lora.moe,
                               ctx.batch.active_slots, ctx.ranks)
        stacked = {"stack": layer.moe_stack} if moe_lora is not None and ctx.moe_stacks is not None else {}
        return self.ops.experts(x, layer.experts_gate_up, layer.experts_down, weights, ids, moe_lora,
                                gate_up_bias=layer.experts_gate_up_bias, down_bias=layer.experts_down_bias,
                                activation=self.activation, **stacked)


def _kv_tables(layer: LayerWeights, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot mapping and block tables of ``layer``'s KV group."""
    if layer.window and batch.window_block_tables is not None:
        return batch.window_slot_mapping, batch.window_block_tables
    return batch.slot_mapping, batch.block_tables


@dataclass
class _Context:
    batch: StepBatch
    cos: torch.Tensor  # [T, D]
    sin: torch.Tensor
    lora: LoraTables | None  # None: no token of the step has an adapter
    plan: object  # LoraBatch of the dense LoRA kernels, or None
    stack: ShrinkStack | None = None  # the model's shrink stack when this step uses it (`_project`)
    ranks: SlotRanks | None = None  # the step's `slot_ranks` for the MoE LoRA alignment, or None
    moe_stacks: MoeStacks | None = None  # the MoE LoRA stacks when this step uses them (`_moe`)
