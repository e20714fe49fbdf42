"""Rotary position embedding (RoPE), the "default" rope_type of Hugging Face models.

The cos/sin tables are computed once for every position up to `max_position_embeddings`
and then indexed by each token's position: with flattened batches every token carries its
own position, so a table lookup is simpler (and cheaper) than recomputing per step.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_theta(config) -> float:
    """The RoPE base, from `rope_theta` (transformers 4) or `rope_parameters` (transformers 5).

    Raises ValueError for scaled variants (llama3, yarn, linear, dynamic, ...): they change
    the frequencies and are not implemented here.
    """
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE is")
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has neither rope_theta nor rope_parameters['rope_theta']")
    return float(theta)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim] in fp32, shared by all layers."""

    def __init__(self, head_dim: int, max_positions: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.base = head_dim, max_positions, base
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.reset_cache()

    def reset_cache(self, device: torch.device | None = None) -> None:
        """(Re)compute the tables in fp32; the loader calls this after allocating the model."""
        device = device if device is not None else self.cos_cache.device
        dim = self.head_dim
        # Exactly HF's default rope, so that logits match to the last bits in fp32.
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        inv_freq = 1.0 / (self.base ** exponent)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache, self.sin_cache = emb.cos(), emb.sin()

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim] (broadcast over heads)."""
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension (HF's layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim]."""
    return x * cos + rotate_half(x) * sin
