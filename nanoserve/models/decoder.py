"""§1 and §4: the model one step runs, a decoder-only transformer for the Llama family
(Llama/SmolLM2, Mistral, Qwen2, Qwen3), whose variants differ in a few config switches:
  - Qwen2: bias on q/k/v projections;
  - Qwen3: RMSNorm on each head of q and k (before RoPE), explicit `head_dim`;
  - Llama: optional `attention_bias` / `mlp_bias`; all use GQA, RoPE and a SiLU-gated MLP.
Module names are HF's, but for vLLM's merged `qkv_proj` and `gate_up_proj` (layers/linear.py).
Tokens are flattened (§1: one weight read serves them all): every tensor is [num_tokens, ...];
only attention knows where requests end."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.attention import Attention, AttentionMetadata
from nanoserve.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from nanoserve.utils import divide

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_config(config) -> None:
    """Raise ValueError for configs this decoder would silently compute wrong."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' is")
    # Sliding-window attention would need a different mask; refuse rather than be wrong.
    if getattr(config, "use_sliding_window", False) or (
            model_type == "mistral" and getattr(config, "sliding_window", None) is not None):
        raise ValueError("sliding-window attention is not supported")
    rope_theta(config)  # raises for scaled RoPE variants


def rope_theta(config) -> float:
    """The RoPE base, from `rope_theta` (transformers 4) or `rope_parameters` (transformers 5)."""
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


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """Computed exactly like Hugging Face's LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()  # the mean of squares overflows/loses precision in fp16/bf16
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


class SiluAndMul(nn.Module):
    """The gated MLP's activation on the merged rows [gate | up]: silu(gate) * up."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        tp = dict(tp_size=tp_size, tp_rank=tp_rank, name="intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, **tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class RotaryEmbedding(nn.Module):
    """RoPE, HF's "default" rope_type: fp32 cos/sin tables [max_positions, head_dim] shared by all
    layers. `cos_sin` looks up the step's positions once; each layer rotates q and k with them."""

    def __init__(self, head_dim: int, max_positions: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.base = head_dim, max_positions, base
        self.reset_cache()

    def reset_cache(self, device: torch.device | None = None) -> None:
        """Exactly HF's rope (fp32 logits match to the bit). Plain attributes, not buffers: the
        model's .to(dtype) leaves them fp32; the loader calls this on the model's device."""
        dim = self.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        inv_freq = 1.0 / (self.base ** exponent)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache, self.sin_cache = emb.cos(), emb.sin()

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim] (broadcast over heads)."""
        return (self.cos_cache[positions].to(dtype).unsqueeze(1),
                self.sin_cache[positions].to(dtype).unsqueeze(1))

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [num_tokens, heads, head_dim], rotated as HF's rotate_half."""
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DecoderAttention(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__()
        hidden, self.head_dim = config.hidden_size, head_dim_of(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads = divide(heads, tp_size, "num_attention_heads")  # this rank's heads
        self.num_kv_heads = divide(kv_heads, tp_size, "num_key_value_heads")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = ColumnParallelLinear(
            hidden, [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim],
            qkv_bias, tp_size, tp_rank, name="the q/k/v heads")
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden,
                                        getattr(config, "attention_bias", False), tp_size, tp_rank)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(q, k, cos, sin)
        out = self.attn(q, k, v, meta)  # [n, heads, head_dim]
        return self.o_proj(out.view(n, self.num_heads * d))


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, rotary_emb, tp_size, tp_rank)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            getattr(config, "mlp_bias", False), tp_size, tp_rank)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)  # pre-norm, as in HF
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, layers and final norm: HF's `model.` prefix."""

    def __init__(self, config, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if tp_size == 1 \
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_size, tp_rank)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_theta(config))
        self.layers = nn.ModuleList(DecoderLayer(config, self.rotary_emb, tp_size, tp_rank)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


class DecoderForCausalLM(nn.Module):
    def __init__(self, config, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        check_config(config)
        self.config = config
        self.model = DecoderModel(config, tp_size, tp_rank)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) \
            if tp_size == 1 else ParallelLMHead(config.vocab_size, config.hidden_size, tp_size,
                                                tp_rank)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] (tensor parallel: on rank 0, None elsewhere); called only
        on the rows that sample a token."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
