"""The torch twins of flash-attn's paged kernels against a naive dense attention.

Random paged caches, shuffled (non-contiguous) block tables padded with junk ids, several
requests of different lengths, chunks that start mid-request, and GQA groups 1 and 3.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.layers import torch_attention
from nanoserve.layers.attention import Attention, get_backend
from tests.common.helpers import make_inputs

HEAD_DIM = 8


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [lq, H, D]; k, v [lk, Hkv, D] -> [lq, H, D]: explicit softmax(QK^T)V, with the
    causal mask aligned bottom-right (the lq queries are the last lq of the lk tokens)."""
    lq, num_heads, dim = q.shape
    lk, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / dim**0.5
    visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


class PagedCase:
    """Random requests (context_len, chunk_len) laid out in a shuffled paged cache."""

    def __init__(self, lens: list[tuple[int, int]], block_size: int, num_kv_heads: int,
                 group: int, seed: int, head_dim: int = HEAD_DIM) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.block_size, self.lens = block_size, lens
        needed = [-(-ctx // block_size) for ctx, _ in lens]
        num_blocks = sum(needed) + 3  # spare blocks stay random junk that must be ignored
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        self.tables = []
        for n in needed:
            self.tables.append(ids[:n])
            ids = ids[n:]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen)
        self.v_cache = torch.randn(shape, generator=gen)
        total_q = sum(chunk for _, chunk in lens)
        self.q = torch.randn(total_q, num_kv_heads * group, head_dim, generator=gen)
        # Pad every table row to the same width with junk ids, as the ModelRunner does.
        width = max(needed) + 2
        self.block_table = torch.tensor(
            [t + [rng.randrange(num_blocks) for _ in range(width - len(t))] for t in self.tables],
            dtype=torch.int32,
        )

    def dense(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's keys and values, read slot by slot (the slow obvious way)."""
        ctx = self.lens[i][0]
        slots = [(self.tables[i][p // self.block_size], p % self.block_size) for p in range(ctx)]
        k = torch.stack([self.k_cache[b, o] for b, o in slots])
        v = torch.stack([self.v_cache[b, o] for b, o in slots])
        return k, v

    def expected(self) -> torch.Tensor:
        outs, start = [], 0
        for i, (_, chunk) in enumerate(self.lens):
            outs.append(naive_attention(self.q[start:start + chunk], *self.dense(i)))
            start += chunk
        return torch.cat(outs)


def run_varlen(case: PagedCase) -> torch.Tensor:
    cu_q, cu_k = [0], [0]
    for ctx, chunk in case.lens:
        cu_q.append(cu_q[-1] + chunk)
        cu_k.append(cu_k[-1] + ctx)
    return torch_attention.flash_attn_varlen_func(
        case.q, case.k_cache, case.v_cache,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        max_seqlen_q=max(c for _, c in case.lens), max_seqlen_k=max(c for c, _ in case.lens),
        softmax_scale=HEAD_DIM**-0.5, causal=True, block_table=case.block_table,
    )


def run_decode(case: PagedCase) -> torch.Tensor:
    out = torch_attention.flash_attn_with_kvcache(
        case.q.unsqueeze(1), case.k_cache, case.v_cache,
        cache_seqlens=torch.tensor([c for c, _ in case.lens], dtype=torch.int32),
        block_table=case.block_table, softmax_scale=HEAD_DIM**-0.5, causal=True,
    )
    return out.squeeze(1)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_varlen_prefill_chunks(group, block_size):
    # whole prompts (chunk == context), chunks starting mid-request, a 1-token chunk
    lens = [(7, 7), (20, 6), (1, 1), (33, 33), (16, 1), (9, 4)]
    case = PagedCase(lens, block_size, num_kv_heads=2, group=group, seed=block_size + group)
    torch.testing.assert_close(run_varlen(case), case.expected(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode(group, block_size):
    lens = [(1, 1), (5, 1), (16, 1), (17, 1), (40, 1)]
    case = PagedCase(lens, block_size, num_kv_heads=2, group=group, seed=block_size * group)
    torch.testing.assert_close(run_decode(case), case.expected(), atol=1e-5, rtol=1e-5)


def test_decode_takes_sdpa_output_in_any_memory_layout(monkeypatch):
    """CUDA's SDPA kernels return [batch, Hkv, group, D] laid out as [batch, group, Hkv, D]
    (seen on an H200: the twin's `view` of it raised); the CPU's is contiguous. Here SDPA's
    output comes back in the CUDA layout on the CPU: the same values must come out."""
    sdpa = torch_attention.F.scaled_dot_product_attention

    def cuda_like(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch_attention.F, "scaled_dot_product_attention", cuda_like)
    case = PagedCase([(5, 1), (17, 1), (40, 1)], 4, num_kv_heads=2, group=3, seed=7)
    torch.testing.assert_close(run_decode(case), case.expected(), atol=1e-5, rtol=1e-5)


def test_varlen_without_block_table_matches_paged():
    """Packed dense K/V (no cache) is the same computation as the paged one."""
    case = PagedCase([(6, 6), (11, 3)], 4, num_kv_heads=1, group=3, seed=7)
    dense = [case.dense(i) for i in range(2)]
    out = torch_attention.flash_attn_varlen_func(
        case.q, torch.cat([k for k, _ in dense]), torch.cat([v for _, v in dense]),
        cu_seqlens_q=torch.tensor([0, 6, 9], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 6, 17], dtype=torch.int32),
        max_seqlen_q=6, max_seqlen_k=11, causal=True,
    )
    torch.testing.assert_close(out, case.expected(), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(
        st.integers(1, 30).flatmap(lambda ctx: st.tuples(st.just(ctx), st.integers(1, ctx))),
        min_size=1, max_size=5,
    ),
    block_size=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([1, 3]),
    seed=st.integers(0, 1000),
)
def test_varlen_random(lens, block_size, group, seed):
    case = PagedCase(lens, block_size, num_kv_heads=2, group=group, seed=seed)
    torch.testing.assert_close(run_varlen(case), case.expected(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
def test_attention_layer_mixed_batch(group):
    """The Attention module: store new K/V by slot, then decode and prefill rows in one call."""
    block_size, num_kv_heads = 4, 2
    seqs = [([5, 2], 6, 1), ([7], 2, 1), ([0, 3, 6], 4, 7), ([1, 4], 0, 5)]  # decodes first
    meta = make_inputs([(t, c, [0] * n) for t, c, n in seqs], block_size).attn_metadata
    gen = torch.Generator().manual_seed(group)
    shape = (8, block_size, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    n = meta.slot_mapping.numel()
    q = torch.randn(n, num_kv_heads * group, HEAD_DIM, generator=gen)
    k = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen)
    attn = Attention(num_kv_heads * group, num_kv_heads, HEAD_DIM, scale=HEAD_DIM**-0.5)
    attn.bind(k_cache, v_cache, get_backend("torch"))
    out = attn(q, k, v, meta)
    start = 0
    for table, cached, new in seqs:
        # the request's keys: what was cached before, then this step's new ones
        slots = [(table[p // block_size], p % block_size) for p in range(cached + new)]
        keys = torch.stack([k_cache[b, o] for b, o in slots])
        values = torch.stack([v_cache[b, o] for b, o in slots])
        torch.testing.assert_close(keys[cached:], k[start:start + new])
        expected = naive_attention(q[start:start + new], keys, values)
        torch.testing.assert_close(out[start:start + new], expected, atol=1e-5, rtol=1e-5)
        start += new
