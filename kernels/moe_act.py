"""The gated activation of an MoE expert, shared by the base fused MoE and fused_moe_lora.

Per routed pair, with ``g`` the gate half and ``u`` the up half of ``x @ W_gate_up[e].T``
(plus the expert's bias, where the model has one)::

    silu         (Qwen3-MoE, Mixtral, OLMoE):  act = silu(g) · u,   silu(g) = g · sigmoid(g)
    swiglu_clamp (GPT-OSS):                    g' = min(g, limit),  u' = clamp(u, -limit, limit)
                                               act = (u' + 1) · g' · sigmoid(alpha · g')

Computed in float32 in both the kernels and the references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

KINDS = ("silu", "swiglu_clamp")
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): e^x = 2^(x·LOG2E)


@dataclass(frozen=True)
class GatedActivation:
    kind: str = "silu"  # one of KINDS
    alpha: float = 1.702  # swiglu_clamp: sigmoid slope
    limit: float = 7.0  # swiglu_clamp: clamp bound

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"activation kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def code(self) -> int:
        """The kernels' ``ACT`` constexpr."""
        return KINDS.index(self.kind)

    def ref(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``act`` in float32 from ``g``, ``u`` (any float dtype)."""
        g, u = g.float(), u.float()
        if self.kind == "silu":
            return torch.nn.functional.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(-self.limit, self.limit)
        return (u + 1) * g * torch.sigmoid(self.alpha * g)


SILU = GatedActivation()


@triton.jit
def gated_act(g, u, ACT: tl.constexpr, alpha, limit):
    """float32 ``act`` tile from float32 ``g``, ``u`` tiles (``ACT``: `GatedActivation.code`)."""
    # e^-x as 2^(-x·log2 e): ex2 straight away, without exp's range fix-ups (a sum rounding to 1 or to inf
    # past their range either way): 10 instructions an element on sm_90 against 14
    if ACT == 0:
        out = g / (1.0 + tl.exp2(-(g * LOG2E))) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (u + 1.0) * g / (1.0 + tl.exp2(-(g * (alpha * LOG2E))))
    return out
