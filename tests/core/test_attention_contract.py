"""The torch twins enforce flash-attn 2's argument contract, one test per check.

flash-attn rejects some calls (int64 index tensors, a strided last dimension, fp32, pages
that are not a multiple of 256, head dims over 256) and computes others differently
without a word (a length over `max_seqlen_*` drops keys or queries; a query that sees no
key gives 0 where the twin gives NaN). A CPU test that calls the twins must fail on all
of them. The checks that only flash-attn needs (dtype, page size, head dim) run when the
twins stand in for it (`flash_contract=True`); the others always run.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.layers import torch_attention
from nanoserve.layers.attention import Attention, AttentionBackend
from tests.common.tiny_model import tiny_model_dir

I32 = torch.int32


def paged(block_size=16, num_blocks=4, heads=4, kv_heads=2, dim=16, dtype=torch.float32):
    """A prefill of 5 queries over 20 keys and a decode over 20 keys, in a paged cache."""
    g = torch.Generator().manual_seed(0)
    cache = (num_blocks, block_size, kv_heads, dim)
    return dict(
        q=torch.randn(5, heads, dim, generator=g).to(dtype),
        k=torch.randn(cache, generator=g).to(dtype), v=torch.randn(cache, generator=g).to(dtype),
        cu_seqlens_q=torch.tensor([0, 5], dtype=I32), cu_seqlens_k=torch.tensor([0, 20], dtype=I32),
        max_seqlen_q=5, max_seqlen_k=20, causal=True,
        block_table=torch.tensor([list(range(-(-20 // block_size)))], dtype=I32),
    )


def varlen(args: dict, **overrides) -> torch.Tensor:
    return torch_attention.flash_attn_varlen_func(**{**args, **overrides})


def decode(args: dict, **overrides) -> torch.Tensor:
    call = dict(q=args["q"][-1:].unsqueeze(1), k_cache=args["k"], v_cache=args["v"],
                cache_seqlens=torch.tensor([20], dtype=I32), block_table=args["block_table"],
                causal=True)
    return torch_attention.flash_attn_with_kvcache(**{**call, **overrides})


def test_valid_calls_pass_and_agree():
    args = paged()
    torch.testing.assert_close(decode(args)[0, 0], varlen(args)[-1])


def test_max_seqlen_q_smaller_than_a_chunk_is_an_error():
    with pytest.raises(ValueError, match="max_seqlen_q"):
        varlen(paged(), max_seqlen_q=4)


def test_max_seqlen_k_smaller_than_a_context_is_an_error():
    with pytest.raises(ValueError, match="max_seqlen_k"):
        varlen(paged(), max_seqlen_k=19)


@pytest.mark.parametrize("field", ["cu_seqlens_q", "cu_seqlens_k", "block_table"])
def test_varlen_index_tensors_must_be_int32(field):
    args = paged()
    with pytest.raises(ValueError, match=f"{field} must be int32"):
        varlen(args, **{field: args[field].long()})


@pytest.mark.parametrize("field", ["cache_seqlens", "block_table"])
def test_decode_index_tensors_must_be_int32(field):
    args = paged()
    value = torch.tensor([20]) if field == "cache_seqlens" else args["block_table"].long()
    with pytest.raises(ValueError, match=f"{field} must be int32"):
        decode(args, **{field: value})


@pytest.mark.parametrize("field", ["q", "k", "v"])
def test_last_dimension_must_be_contiguous(field):
    args = paged()
    strided = args[field].transpose(-1, -2).contiguous().transpose(-1, -2)  # same values
    assert strided.stride(-1) != 1
    with pytest.raises(ValueError, match=f"{field} must have a contiguous last dimension"):
        varlen(args, **{field: strided})
    name = {"q": "q", "k": "k_cache", "v": "v_cache"}[field]
    with pytest.raises(ValueError, match=f"{name} must have a contiguous last dimension"):
        decode(args, **{name: strided[-1:].unsqueeze(1) if field == "q" else strided})


def test_page_size_must_be_a_multiple_of_256_when_standing_in_for_flash_attn():
    args = paged(dtype=torch.bfloat16)  # block_size 16: fine for the torch backend itself
    varlen(args), decode(args)
    with pytest.raises(ValueError, match="multiple of 256"):
        varlen(args, flash_contract=True)
    with pytest.raises(ValueError, match="multiple of 256"):
        decode(args, flash_contract=True)
    ok = paged(block_size=256, num_blocks=2, dtype=torch.bfloat16)
    varlen(ok, flash_contract=True), decode(ok, flash_contract=True)


def test_fp32_is_rejected_when_standing_in_for_flash_attn():
    args = paged(block_size=256, num_blocks=2)
    varlen(args), decode(args)  # the torch backend computes fp32 legitimately
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        varlen(args, flash_contract=True)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        decode(args, flash_contract=True)


def test_head_dim_over_256_is_rejected_when_standing_in_for_flash_attn():
    args = paged(block_size=256, num_blocks=2, dim=264, dtype=torch.bfloat16)
    varlen(args)
    with pytest.raises(ValueError, match="head_dim"):
        varlen(args, flash_contract=True)


def test_head_dim_not_a_multiple_of_8_is_refused_when_standing_in_for_flash_attn():
    """flash-attn would pad (copy) the whole paged cache on every call: refuse."""
    args = paged(block_size=256, num_blocks=2, dim=20, dtype=torch.bfloat16)
    varlen(args)
    with pytest.raises(ValueError, match="multiple of 8"):
        decode(args, flash_contract=True)


def test_query_and_cache_dtypes_must_match():
    args = paged()
    with pytest.raises(ValueError, match="dtype"):
        varlen(args, q=args["q"].double())


def test_kv_heads_must_divide_query_heads():
    args = paged(heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        varlen(args)
    with pytest.raises(ValueError, match="num_kv_heads"):
        decode(args)


def test_block_table_narrower_than_a_context_is_an_error():
    args = paged(block_size=4, num_blocks=8)  # 20 keys need 5 blocks of 4
    narrow = args["block_table"][:, :4].contiguous()
    with pytest.raises(ValueError, match="block_table"):
        varlen(args, block_table=narrow)
    with pytest.raises(ValueError, match="block_table"):
        decode(args, block_table=narrow)


def test_decode_needs_one_table_row_and_length_per_query_and_matching_caches():
    """Else the twin would broadcast one length over every query, without a word."""
    args = paged()
    two = torch.tensor([20, 20], dtype=I32)
    with pytest.raises(ValueError, match="one row per query"):
        decode(args, cache_seqlens=two)
    with pytest.raises(ValueError, match="one row per query"):
        decode(args, block_table=args["block_table"].repeat(2, 1))
    with pytest.raises(ValueError, match="do not match"):
        decode(args, v_cache=args["v"][:3])


def test_prefill_query_with_no_visible_key_is_an_error():
    """Causal, 5 queries over 3 keys: the first two see nothing (flash-attn: 0, twin: NaN)."""
    with pytest.raises(ValueError, match="no key"):
        varlen(paged(), cu_seqlens_k=torch.tensor([0, 3], dtype=I32))


def test_decode_with_no_cached_key_is_an_error():
    with pytest.raises(ValueError, match="no key"):
        decode(paged(), cache_seqlens=torch.tensor([0], dtype=I32))


def test_engine_calls_satisfy_flash_attn_contract_on_cpu(monkeypatch):
    """The whole engine (prefill chunks, decodes, preemption) in bf16 with 256-token pages,
    its attention calls checked as flash-attn would check them. Zero-length sequences,
    int64 tables or a short max_seqlen anywhere in the engine would raise here."""
    llm = LLM(tiny_model_dir(), dtype="bfloat16", block_size=256, num_kv_blocks=3,
              max_num_seqs=4, max_num_batched_tokens=300, skip_tokenizer_init=True)
    strict = AttentionBackend(
        "torch",
        lambda *a, **kw: torch_attention.flash_attn_varlen_func(*a, **kw, flash_contract=True),
        lambda *a, **kw: torch_attention.flash_attn_with_kvcache(*a, **kw, flash_contract=True))
    calls = []
    for attn in (m for m in llm.model_runner.model.modules() if isinstance(m, Attention)):
        attn.bind(attn.k_cache, attn.v_cache, strict)
    original = torch_attention.flash_attn_varlen_func

    def counting(*a, **kw):
        calls.append(kw["max_seqlen_k"])
        return original(*a, **kw)

    monkeypatch.setattr(torch_attention, "flash_attn_varlen_func", counting)
    prompts = [[7 + i] * n for i, n in enumerate((300, 40, 260, 5))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [8] * 4
    assert max(calls) > 256  # chunks crossed a page boundary


def test_binding_a_cache_flash_attn_cannot_use_fails_at_start_up():
    """With the real flash-attn the same limits are checked once, when the cache is bound
    (after the weights, which give head_dim), instead of on the first step."""
    backend = AttentionBackend("flash-attn", lambda *a, **kw: None, lambda *a, **kw: None)
    ok = torch.zeros(2, 256, 2, 64, dtype=torch.bfloat16)
    Attention(4, 2, 64, scale=1.0).bind(ok, ok, backend)
    odd = torch.zeros(2, 256, 2, 20, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        Attention(4, 2, 20, scale=1.0).bind(odd, odd, backend)
    Attention(4, 2, 20, scale=1.0).bind(torch.empty(0), torch.empty(0), backend)  # unbinding
