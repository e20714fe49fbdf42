"""The SiLU-gated feed-forward block (SwiGLU) of Llama, Qwen2 and Qwen3."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); names match HF checkpoints."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
