"""Test helpers: run a model without the engine by building AttentionMetadata by hand."""

from __future__ import annotations

import torch

from nanoserve.layers.attention import Attention, AttentionMetadata, select_backend


def bind_kv_cache(
    model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> None:
    """Give every Attention module of `model` its own zeroed paged K and V cache."""
    backend = select_backend(torch.device("cpu"), torch.float32, "torch")
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        attn.bind(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), backend)


def _table(rows: list[list[int]]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32).view(
        len(rows), width
    )


def make_metadata(
    seqs: list[tuple[list[int], int, int]], block_size: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for one step. `seqs`: (block_table, num_cached, num_new) per
    request, decodes (num_new == 1) first, as the ModelRunner orders them. The new tokens
    of request i are at positions num_cached .. num_cached + num_new - 1."""
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes][2] == 1:
        num_decodes += 1
    if any(new == 1 for _, _, new in seqs[num_decodes:]):
        raise ValueError("decode rows (num_new == 1) must come first")
    positions, slots = [], []
    for table, cached, new in seqs:
        for pos in range(cached, cached + new):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    decodes, prefills = seqs[:num_decodes], seqs[num_decodes:]
    cu_q, cu_k = [0], [0]
    for _, cached, new in prefills:
        cu_q.append(cu_q[-1] + new)
        cu_k.append(cu_k[-1] + cached + new)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=num_decodes,
        decode_context_lens=torch.tensor([c + 1 for _, c, _ in decodes], dtype=torch.int32),
        decode_block_tables=_table([t for t, _, _ in decodes]),
        num_prefill_tokens=cu_q[-1],
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        max_seqlen_q=max((n for _, _, n in prefills), default=0),
        max_seqlen_k=max((c + n for _, c, n in prefills), default=0),
        prefill_block_tables=_table([t for t, _, _ in prefills]),
    )
    return meta, torch.tensor(positions, dtype=torch.int64)


def run_step(
    model, token_ids: list[int], seqs: list[tuple[list[int], int, int]], block_size: int
) -> torch.Tensor:
    """One forward over the flattened new tokens of `seqs`; returns logits [num_tokens, V]."""
    meta, positions = make_metadata(seqs, block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids, dtype=torch.int64), positions, meta)
        return model.compute_logits(hidden)
