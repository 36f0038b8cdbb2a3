"""Rotary position embeddings (rotate-half layout) with the scaling variants in common configs.

Frequencies are computed in float32 the same way Hugging Face does, so positions far into the
context rotate identically to the reference implementation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from folio.layers.fused_ops import fused_ops_for


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, base: float, scaling: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    original_max = scaling.get("original_max_position_embeddings") or max_pos
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    head_dim: int, base: float, scaling: dict[str, Any] | None, max_pos: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin multiplier for a RoPE config."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return _default_inv_freq(head_dim, base), 1.0
    if rope_type == "linear":
        return _default_inv_freq(head_dim, base) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(head_dim, base), scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling, max_pos)
    raise ValueError(f"unsupported RoPE scaling {rope_type!r}; folio knows default, linear, llama3, yarn")


class RotaryEmbedding(nn.Module):
    """Holds inverse frequencies; cos/sin are computed once per step and shared by all layers."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq, multiplier = compute_inv_freq(head_dim, base, scaling, max_position)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.multiplier = multiplier

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, D] (broadcast over heads)."""
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.multiplier != 1.0:
            cos, sin = cos * self.multiplier, sin * self.multiplier
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D]. On CPU the fused op rotates them in place (they are views of
    the layer's own qkv output)."""
    ops = fused_ops_for(q)
    if ops is None or not _rows_of_heads(q) or not _rows_of_heads(k) or cos.dtype != q.dtype:
        return apply_rotary_reference(q, k, cos, sin)
    ops.rotary_(q, k, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))
    return q, k


def _rows_of_heads(x: torch.Tensor) -> bool:
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
