"""The C decode kernel (accel/csrc/attention.c) against a naive dense attention.

Same cases as the torch twin's tests (shuffled block tables padded with junk ids, GQA),
plus the head sizes the kernel specializes (64, 128) and a generic one, bf16, and a cache
whose every slot outside the requests' contexts is NaN: a read past a request's length, or
of a padding block, would show. Its checks keep C from reading outside the cache.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.layers import torch_attention
from nanoserve.layers.attention import get_backend
from nanoserve_accel import kernels, paged_attention
from tests.common.tiny_model import tiny_model_dir
from tests.core.test_attention import PagedCase

KERNEL = kernels.compile_kernels()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler here")


def decode_fn():
    backend = get_backend("torch")
    return paged_attention.with_decode_kernel(backend, KERNEL).with_kvcache


def poisoned_case(lens, block_size, group, head_dim, dtype, seed=0) -> PagedCase:
    """A PagedCase whose slots that no request may read are NaN."""
    case = PagedCase(lens, block_size, num_kv_heads=2, group=group, seed=seed,
                     head_dim=head_dim)
    readable = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for table, (ctx, _) in zip(case.tables, lens):
        for p in range(ctx):
            readable[table[p // block_size], p % block_size] = True
    for cache in (case.k_cache, case.v_cache):
        cache[~readable] = float("nan")
    case.q, case.k_cache, case.v_cache = (t.to(dtype) for t in (case.q, case.k_cache,
                                                                 case.v_cache))
    return case


def run(case: PagedCase, fn=None, **overrides) -> torch.Tensor:
    args = dict(q=case.q.unsqueeze(1), k_cache=case.k_cache, v_cache=case.v_cache,
                cache_seqlens=torch.tensor([c for c, _ in case.lens], dtype=torch.int32),
                block_table=case.block_table, softmax_scale=case.q.shape[-1]**-0.5, causal=True)
    return (fn or decode_fn())(**{**args, **overrides}).squeeze(1)


LENS = [(1, 1), (5, 1), (16, 1), (17, 1), (40, 1), (300, 1)]


# 64 and 128: the AVX-512 loop nest where the CPU has it (attention_avx512.c), the 8-lane one
# elsewhere; 24: the 8-lane one everywhere. Groups of 5: its V pass takes 4 heads, then 1.
@pytest.mark.parametrize("head_dim", [64, 128, 24])
@pytest.mark.parametrize("group", [1, 3, 5])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_matches_naive_attention_fp32(head_dim, group, block_size):
    case = poisoned_case(LENS, block_size, group, head_dim, torch.float32, seed=head_dim + group)
    torch.testing.assert_close(run(case), case.expected(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (128, 3), (64, 5), (24, 3)])
def test_kernel_matches_naive_attention_bf16(head_dim, group):
    case = poisoned_case(LENS, 16, group, head_dim, torch.bfloat16, seed=1)
    got = run(case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, case.expected(), atol=2e-2, rtol=2e-2)


# Longer than attention.c's SPLIT (512 tokens): split into parts, one task each, then merged.
LONG_LENS = [(1100, 1), (513, 1), (512, 1), (1537, 1), (7, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (128, 1), (24, 3)])
def test_a_long_request_is_split_merged_and_alone_the_same(dtype, head_dim, group):
    case = poisoned_case(LONG_LENS, 16, group, head_dim, dtype, seed=head_dim)
    got = run(case)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, case.expected(), atol=tol, rtol=tol)
    for i in (0, 3):  # alone, a split request gets the bits it gets beside the others
        alone = run(case, q=case.q[i:i + 1].unsqueeze(1), block_table=case.block_table[i:i + 1],
                    cache_seqlens=torch.tensor([case.lens[i][0]], dtype=torch.int32))
        assert torch.equal(alone[0], got[i])


# Fewer parts than two per thread: each part's KV heads are split over tasks (attention.c).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 64), (8, 128), (3, 24)])
def test_a_rows_heads_split_over_threads_give_the_bits_of_a_full_batch(dtype, num_kv_heads,
                                                                       head_dim):
    case = PagedCase(LENS, 16, num_kv_heads=num_kv_heads, group=3, seed=num_kv_heads,
                     head_dim=head_dim)
    case.q, case.k_cache, case.v_cache = (t.to(dtype) for t in (case.q, case.k_cache,
                                                                 case.v_cache))
    got = run(case)  # six rows: no split
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, case.expected(), atol=tol, rtol=tol)
    for i in (0, 4, 5):  # alone: one part, its heads split
        alone = run(case, q=case.q[i:i + 1].unsqueeze(1), block_table=case.block_table[i:i + 1],
                    cache_seqlens=torch.tensor([case.lens[i][0]], dtype=torch.int32))
        assert torch.equal(alone[0], got[i])


@pytest.mark.parametrize("q_scale", [0.0, 300.0])
def test_softmax_of_equal_and_of_far_apart_scores(q_scale):
    """q = 0: every key weighs the same; q x 300: scores hundreds apart, most e^x underflow
    (the kernel's own exp clamps at -87) and one key takes nearly all the weight."""
    case = poisoned_case(LENS, 16, 3, 64, torch.float32, seed=7)
    case.q *= q_scale
    torch.testing.assert_close(run(case), case.expected(), atol=1e-5, rtol=1e-5)


def test_a_head_size_not_a_multiple_of_8_goes_to_the_twin():
    case = PagedCase(LENS, 16, num_kv_heads=2, group=3, seed=3, head_dim=12)
    assert torch.equal(run(case), run(case, torch_attention.flash_attn_with_kvcache))


def test_kernel_agrees_with_the_twin_on_a_clean_cache():
    case = PagedCase(LENS, 16, num_kv_heads=3, group=3, seed=5, head_dim=64)
    torch.testing.assert_close(run(case), run(case, torch_attention.flash_attn_with_kvcache),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad_id", [-1, "the end", 10**6])
def test_block_ids_outside_the_cache_are_an_error(bad_id):
    case = PagedCase(LENS, 16, num_kv_heads=2, group=1, seed=0, head_dim=64)
    num_blocks = case.k_cache.shape[0]
    case.block_table[2, 0] = num_blocks if bad_id == "the end" else bad_id
    # The caches are views of one block more: a read just past their end would not crash.
    k_cache, v_cache = (torch.cat([c, c[:1]])[:num_blocks] for c in (case.k_cache, case.v_cache))
    with pytest.raises(ValueError, match="block ids outside"):
        run(case, k_cache=k_cache, v_cache=v_cache)


def test_shared_twin_checks_still_apply():
    case = PagedCase(LENS, 16, num_kv_heads=2, group=1, seed=0, head_dim=64)
    with pytest.raises(ValueError, match="no key"):
        run(case, cache_seqlens=torch.tensor([0, 5, 16, 17, 40, 300], dtype=torch.int32))
    with pytest.raises(ValueError, match="too few columns"):
        run(case, block_table=case.block_table[:, :2].contiguous())
    with pytest.raises(ValueError, match="one row per query"):
        run(case, block_table=case.block_table[:3].contiguous())


def test_the_kernel_checks_the_lengths_where_the_twin_would_read_them_back(monkeypatch):
    """Per layer the twin's checks run on the shapes only; only a refused call reruns them all,
    to name the bad length."""
    calls, check = [], torch_attention.check_decode_args
    monkeypatch.setattr(torch_attention, "check_decode_args",
                        lambda *a, **kw: calls.append(kw.get("lengths", True)) or check(*a, **kw))
    case = PagedCase(LENS, 16, num_kv_heads=2, group=1, seed=0, head_dim=64)
    run(case)
    assert calls == [False]
    with pytest.raises(ValueError, match="too few columns"):
        run(case, cache_seqlens=torch.tensor([1, 5, 16, 17, 40, 10**4], dtype=torch.int32))
    assert calls == [False, False, True]


@pytest.mark.parametrize("bad_request", [0, 5])
def test_a_bad_length_is_named_and_unread_padding_may_hold_anything(bad_request):
    case = PagedCase(LENS, 16, num_kv_heads=2, group=1, seed=0, head_dim=64)
    lens = torch.tensor([c for c, _ in case.lens], dtype=torch.int32)
    lens[bad_request] = 0
    with pytest.raises(ValueError, match=f"sequence {bad_request}: a query would see no key"):
        run(case, cache_seqlens=lens)
    # The unread padding of a table may hold anything: only the blocks a length needs are read.
    clean = run(case)
    case.block_table[0, 1:] = 10**6  # request 0 has 1 token: block 0 only
    assert torch.equal(run(case), clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_write_is_the_twins_and_refuses_slots_outside_the_cache(dtype):
    backend = get_backend("torch")
    fast = paged_attention.with_decode_kernel(backend, KERNEL).store_kvcache
    torch.manual_seed(0)
    key, value = torch.randn(2, 5, 3, 8).to(dtype)
    slots = torch.tensor([7, 0, 23, 12, 3])
    # K and V caches of 3 blocks of 8 tokens, views of 4: a write just past the end won't crash.
    memory = [torch.randn(2, 4, 8, 3, 8).to(dtype)]
    memory.append(memory[0].clone())
    caches = [(m[0, :3], m[1, :3]) for m in memory]
    backend.store_kvcache(key, value, *caches[0], slots)
    fast(key, value, *caches[1], slots)
    assert torch.equal(memory[0], memory[1])
    before = memory[1].clone()
    for bad in (-1, 24):
        with pytest.raises(ValueError, match=rf"slot_mapping\[2\] = {bad} is outside the cache"):
            fast(key, value, *caches[1], torch.tensor([1, 2, bad, 4, 5]))
        assert torch.equal(memory[1], before)  # nothing written, past the end neither


def test_kernels_are_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))
    builds, run = [], subprocess.run

    def counting_run(cmd, **kwargs):
        if "-o" in cmd:  # a build, not the query of what -march=native means
            builds.append(cmd)
        return run(cmd, **kwargs)

    monkeypatch.setattr(subprocess, "run", counting_run)
    for _ in range(2):  # __wrapped__: past the once-per-process functools.cache
        assert kernels.compile_kernels.__wrapped__("cc") is not None
    assert len(builds) == 1 and len(list(tmp_path.glob("nanoserve-kernels-*.so"))) == 1


def test_an_unwritable_cache_builds_for_this_process_only(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    lib = kernels.compile_kernels.__wrapped__("cc")
    assert lib is not None and not lib._name.startswith(str(tmp_path))


def test_no_compiler_means_the_twin(caplog):
    assert kernels.compile_kernels("no-such-compiler") is None
    assert "no C compiler" in caplog.text


def test_optimized_engine_uses_the_kernel_and_decodes_like_the_eager_one():
    prompts = [[5 + i] * n for i, n in enumerate((3, 40, 17, 90))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(tiny_model_dir(), dtype="float32", enable_fast_paths=not eager, num_kv_blocks=64,
                  block_size=16, skip_tokenizer_init=True)  # several blocks per request
        name = llm.model_runner.backend.name  # (and "+cpu-prefill" where that kernel runs)
        assert name == "torch" if eager else name.startswith("torch+cpu-decode")
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[True] == outs[False]
