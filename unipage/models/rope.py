"""Rotary position embeddings as Hugging Face configures them: default and Llama-3 scaling.

``inv_freq [D/2]`` float32; for positions ``p``: ``angles = p * inv_freq``,
``cos/sin = cat(angles, angles).cos()/.sin()`` (``[T, D]``), and a head
vector ``x`` rotates as ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x[D/2:], x[:D/2])``.
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


def inv_freq(hf: dict, head_dim: int) -> torch.Tensor:
    params = rope_parameters(hf)
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    kind = params["rope_type"]
    if kind == "default":
        return freq
    if kind == "llama3":
        return _llama3(freq, params)
    raise CheckpointError(f"rope_type {kind!r} is not supported (supported: default, llama3)")


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


def cos_sin(freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, D]`` in ``dtype`` for ``positions [T]`` (computed in float32)."""
    angles = positions.float()[:, None] * freq.to(positions.device)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by ``cos/sin [T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
