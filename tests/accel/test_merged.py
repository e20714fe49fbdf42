"""Merged projections (accel/merged.py): q, k, v and gate, up as one linear each compute what the
plain decoder's separate linears compute, for Llama, Qwen2 (biases) and Qwen3 (q/k norms)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from nanoserve.accel.merged import MergedAttention, MergedMLP, merge_projections, merged_linear
from nanoserve.models.decoder import DecoderForCausalLM
from tests.common.helpers import bind_kv_cache, run_step

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_merged_linear_stacks_outputs_and_refuses_mixed_biases():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 4), nn.Linear(8, 6)
    x = torch.randn(3, 8)
    merged = merged_linear(a, b)
    torch.testing.assert_close(merged(x), torch.cat([a(x), b(x)], dim=-1))
    assert merged_linear(a, nn.Linear(8, 6, bias=False)) is None


@pytest.mark.parametrize("config", [LlamaConfig(**SMALL), Qwen2Config(**SMALL),
                                    Qwen3Config(head_dim=8, **SMALL)], ids=lambda c: c.model_type)
def test_merged_model_computes_what_the_plain_one_does(config):
    torch.manual_seed(0)
    plain = DecoderForCausalLM(config).eval()
    merged = copy.deepcopy(plain)
    merge_projections(merged)
    assert {type(layer.self_attn) for layer in merged.model.layers} == {MergedAttention}
    assert {type(layer.mlp) for layer in merged.model.layers} == {MergedMLP}
    logits = []
    for model in (plain, merged):
        bind_kv_cache(model, num_blocks=8, block_size=4)
        # a decode at 6 cached tokens, then a 5-token prefill chunk after 2 cached ones
        logits.append(run_step(model, [9, 3, 5, 7, 9, 11], [([0, 1], 6, 1), ([2, 3], 2, 5)], 4))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
