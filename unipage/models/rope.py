"""Rotary position embeddings as Hugging Face configures them: default, Llama-3 and YaRN scaling.

``inv_freq [D/2]`` float32 and an attention factor ``m`` (1 except YaRN); for
positions ``p``: ``angles = p * inv_freq``, ``cos/sin = m · cat(angles,
angles).cos()/.sin()`` (``[T, D]``), and a head vector ``x`` rotates as
``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``.
"""

from __future__ import annotations

import math

import torch

from unipage.errors import CheckpointError


def rope_parameters(hf: dict) -> dict:
    """transformers v5 ``rope_parameters`` or v4 ``rope_theta`` + ``rope_scaling``, as one dict."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def frequencies(hf: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [D/2] float32, attention factor)`` of the checkpoint's rope."""
    params = rope_parameters(hf)
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    kind = params["rope_type"]
    if kind == "default":
        return freq, 1.0
    if kind == "llama3":
        return _llama3(freq, params), 1.0
    if kind == "yarn":
        return _yarn(freq, params, head_dim, float(params["rope_theta"]))
    raise CheckpointError(f"rope_type {kind!r} is not supported (supported: default, llama3, yarn)")


def _llama3(freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, a smooth ramp between the bands."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > context / low, freq / factor, freq)
    ramp = (context / wavelen - low) / (high - low)
    smooth = (1 - ramp) * scaled / factor + ramp * scaled
    between = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(between, smooth, scaled)


def _yarn(freq: torch.Tensor, params: dict, head_dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that rotate fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), more than ``beta_fast`` times kept, a linear ramp between;
    cos/sin scaled by ``0.1 ln(factor) + 1`` unless the config names the factor."""
    factor, context = float(params["factor"]), params["original_max_position_embeddings"]
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if high == low else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    scaled = freq / factor * (1 - keep) + freq * keep
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _mscale(factor, mscale) / _mscale(factor, mscale_all)
        else:
            attention = _mscale(factor, 1.0)
    return scaled, float(attention)


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def cos_sin(freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
            attention: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, D]`` in ``dtype`` for ``positions [T]`` (computed in float32, scaled by ``attention``)."""
    angles = positions.float()[:, None] * freq.to(positions.device)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return (emb.cos() * attention).to(dtype), (emb.sin() * attention).to(dtype)
