"""§5: attention over the paged KV cache.

`AttentionMetadata` tells attention where each request of the flattened batch ends. Rows are
    [ decode rows: one new token per request | prefill rows: chunks of >= 2 tokens ]
where "decode" just means one new token this step (a one-token prefill chunk takes that path,
correctly). Both calls are flash-attn's where it can run, else the torch twins (torch_attention)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.layers import torch_attention


@dataclass
class AttentionMetadata:
    """Where each flattened token belongs. Built by ModelRunner, read by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset)
    num_decode_tokens: int  # the first rows of the batch, one per decoding request
    decode_context_lens: torch.Tensor  # [num_decodes] int32: KV length incl. the new token
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    num_prefill_tokens: int  # the remaining rows
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32: prefill chunk boundaries
    cu_seqlens_k: torch.Tensor  # [num_prefills + 1] int32: KV length incl. the chunk
    max_seqlen_q: int
    max_seqlen_k: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V into its cache slot (an indexed copy, no custom kernel)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    varlen_func: Callable[..., torch.Tensor]  # flash_attn_varlen_func
    with_kvcache: Callable[..., torch.Tensor]  # flash_attn_with_kvcache
    store_kvcache: Callable[..., None] = store_kvcache


class Attention(nn.Module):
    """Paged attention for one layer. The cache and backend are bound by the ModelRunner."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)  # [blocks, block_size, kv_heads, head_dim]
        self.backend: AttentionBackend | None = None

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend) -> None:
        if backend.name == "flash-attn" and k_cache.numel():  # fail at start-up, not mid-step
            torch_attention.check_flash_attn_limits(k_cache.dtype, self.head_dim, k_cache.shape[1])
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]."""
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd > 0:
            out[:nd] = self.backend.with_kvcache(
                q[:nd].unsqueeze(1), self.k_cache, self.v_cache, causal=True,
                cache_seqlens=meta.decode_context_lens, block_table=meta.decode_block_tables,
                softmax_scale=self.scale).squeeze(1)
        if meta.num_prefill_tokens > 0:
            out[nd:] = self.backend.varlen_func(
                q[nd:], self.k_cache, self.v_cache,
                cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                softmax_scale=self.scale, causal=True, block_table=meta.prefill_block_tables)
        return out


def get_backend(name: str) -> AttentionBackend:
    """The kernels config.resolve_attention_backend chose: flash-attn's, or the torch twins."""
    if name == "flash-attn":
        import flash_attn

        return AttentionBackend(name, flash_attn.flash_attn_varlen_func,
                                flash_attn.flash_attn_with_kvcache)
    return AttentionBackend("torch", torch_attention.flash_attn_varlen_func,
                            torch_attention.flash_attn_with_kvcache)
