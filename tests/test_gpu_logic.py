"""GPU path logic that needs no GPU: backend selection, block-size rules, the CUDA-graph
batch-size ladder and the padding of decode inputs to a captured size."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.cuda_graph import graph_batch_sizes, pad_decode_inputs, padded_batch_size
from nanoserve.engine.model_runner import resolve_block_size
from nanoserve.layers.attention import AttentionMetadata, select_backend


def test_cpu_selects_the_torch_twins():
    assert select_backend(torch.device("cpu"), "auto").name == "torch"
    assert select_backend(torch.device("cpu"), "torch").name == "torch"


def test_forcing_flash_attn_without_it_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend='flash-attn' cannot be used"):
        select_backend(torch.device("cpu"), "flash-attn")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend(torch.device("cpu"), "xformers")


def test_block_size_defaults_and_flash_attn_rule():
    assert resolve_block_size("torch", None) == 16
    assert resolve_block_size("torch", 7) == 7
    assert resolve_block_size("flash-attn", None) == 256
    assert resolve_block_size("flash-attn", 512) == 512
    with pytest.raises(ValueError, match="multiple of 256"):
        resolve_block_size("flash-attn", 16)


def test_graph_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert padded_batch_size(65, sizes) is None


def test_pad_decode_inputs_points_padding_rows_at_the_padding_block():
    n, bs, block_size, padding_block, max_blocks = 3, 8, 4, 10, 5
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 9, 2]), num_decode_tokens=n,
        decode_context_lens=torch.tensor([6, 10, 3], dtype=torch.int32),
        decode_block_tables=torch.tensor([[1, 2, 0], [3, 4, 7], [0, 0, 0]], dtype=torch.int32),
        num_prefill_tokens=0, cu_seqlens_q=torch.zeros(1), cu_seqlens_k=torch.zeros(1),
        max_seqlen_q=0, max_seqlen_k=0, prefill_block_tables=torch.zeros(0, 1))
    ids, pos, slots, lens, tables = pad_decode_inputs(
        torch.tensor([11, 12, 13]), torch.tensor([5, 9, 2]), meta, bs, padding_block,
        block_size, max_blocks)
    assert ids.tolist() == [11, 12, 13] + [0] * 5
    assert pos.tolist() == [5, 9, 2] + [0] * 5
    assert slots.tolist() == [5, 9, 2] + [padding_block * block_size] * 5
    assert lens.tolist() == [6, 10, 3] + [1] * 5
    assert tables.shape == (bs, max_blocks)
    assert tables[0].tolist() == [1, 2, 0, padding_block, padding_block]
    assert (tables[n:] == padding_block).all()
