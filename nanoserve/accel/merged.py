"""§1 on a CPU, fewer calls: q, k and v read the same input, and so do gate and up. The fast path
merges each group's weights into one linear, as vLLM's QKVParallelLinear and
MergedColumnParallelLinear do: one GEMM call over a wider weight where the plain decoder makes
three (two). Small GEMMs are dominated by their per-call cost and by threads waiting out the end
of a narrow one (k and v have few output columns). The math per output column is unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models.decoder import DecoderAttention, GatedMLP, apply_rotary


def merged_linear(*linears: nn.Linear) -> nn.Linear | None:
    """One linear computing all of `linears` side by side; None if their biases differ in kind."""
    if len({lin.bias is None for lin in linears}) > 1:
        return None
    first = linears[0]
    merged = nn.Linear(first.in_features, sum(lin.out_features for lin in linears),
                       bias=first.bias is not None, dtype=first.weight.dtype,
                       device=first.weight.device).requires_grad_(False)
    with torch.no_grad():
        merged.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if first.bias is not None:
            merged.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return merged


class MergedAttention(DecoderAttention):
    """DecoderAttention.forward with q, k, v from one GEMM (`qkv_proj`)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.heads(self.qkv_proj(x), cos, sin)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.view(x.shape[0], self.num_heads * self.head_dim))

    def heads(self, qkv: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The merged rows [n, q | k | v] -> q, k [n, heads, head_dim] with RoPE, and v."""
        n = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim).contiguous()  # the cache write's
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class MergedMLP(GatedMLP):
    """GatedMLP.forward with gate and up from one GEMM (`gate_up_proj`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def merge_projections(model: nn.Module) -> None:
    """Each DecoderAttention and GatedMLP of `model` becomes its merged twin, in place: the same
    module with its class swapped, so every other attribute (norms, attention, o_proj) stays."""
    for module in list(model.modules()):
        if type(module) is DecoderAttention:
            group = (module.q_proj, module.k_proj, module.v_proj)
            if (qkv := merged_linear(*group)) is not None:
                module.__class__, module.qkv_proj = MergedAttention, qkv
                module.qkv_sizes = [lin.out_features for lin in group]
                del module.q_proj, module.k_proj, module.v_proj
        elif type(module) is GatedMLP:
            if (gate_up := merged_linear(module.gate_proj, module.up_proj)) is not None:
                module.__class__, module.gate_up_proj = MergedMLP, gate_up
                del module.gate_proj, module.up_proj
