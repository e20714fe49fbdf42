"""§1 and §4: the model one step runs. A decoder-only transformer for the Llama family:
Llama/SmolLM2, Mistral, Qwen2, Qwen3.

The variants differ only in a few switches read from the HF config:
  - Qwen2: bias on q/k/v projections;
  - Qwen3: RMSNorm on each head of q and k (before RoPE), explicit `head_dim`;
  - Llama: optional `attention_bias` / `mlp_bias`; all use GQA, RoPE and a SiLU-gated MLP.
Module names equal Hugging Face's, so checkpoint tensors load by name (see loader.py).

Tokens are flattened (§1: one weight read serves every token of the step): every tensor is
[num_tokens, ...] with no batch dimension; where one request ends and the next begins is
known only to attention, via AttentionMetadata.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.layers.attention import Attention, AttentionMetadata
from nanoserve.layers.mlp import GatedMLP
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.rotary import RotaryEmbedding, apply_rotary, rope_theta

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_config(config) -> None:
    """Raise ValueError for configs this decoder would silently compute wrong."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' is")
    # Sliding-window attention would need a different mask; refuse rather than be wrong.
    if getattr(config, "use_sliding_window", False) or (
        model_type == "mistral" and getattr(config, "sliding_window", None) is not None
    ):
        raise ValueError("sliding-window attention is not supported")
    rope_theta(config)  # raises for scaled RoPE variants


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        qwen2 = config.model_type == "qwen2"
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias or qwen2)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias or qwen2)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias or qwen2)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim**-0.5)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q, k, v, meta)  # [n, heads, head_dim]
        return self.o_proj(out.view(n, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Pre-norm residual blocks, as in HF.
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, layers and final norm: HF's `model.` prefix."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(config), config.max_position_embeddings, rope_theta(config)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # One table lookup per step, shared by every layer.
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


class DecoderForCausalLM(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        check_config(config)
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab]; called only on the rows that sample a token."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """Every layer's Attention, in order: the ModelRunner binds a KV cache to each."""
        return [layer.self_attn.attn for layer in self.model.layers]
