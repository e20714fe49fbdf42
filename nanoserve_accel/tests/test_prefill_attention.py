"""The C prefill kernel (accel/csrc/attention_prefill.c) against a naive dense attention and the
torch twin: bf16 and fp32 chunks over shuffled block tables whose unread slots are NaN (a read
past a request's context, or of a padding block, would show), GQA groups, head sizes 64 and 128,
chunks after a cached context; bf16 on AMX tiles and on AVX512-BF16 alone, fp32 on AVX-512F.
What it does not take, or finds out of range, goes to the twin, which computes it or names what
is wrong."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import nanoserve_accel as accel
from nanoserve import LLM, SamplingParams
from nanoserve.layers import torch_attention
from nanoserve.layers.attention import get_backend
from nanoserve.utils import cpu
from nanoserve_accel import kernels, paged_attention, plan
from nanoserve_accel.tests.test_paged_attention import poisoned_case
from tests.common.tiny_model import tiny_model_dir

KERNEL = kernels.compile_kernels()
pytestmark = pytest.mark.skipif(not kernels.has_paged_prefill_fp32(KERNEL),
                                reason="the library was not built for AVX-512F here")
TWIN = get_backend("torch")


@dataclasses.dataclass(frozen=True)
class Prefill:
    """The kernel's varlen function, the dtype of its cases and their tolerance."""
    fn: object = None
    dtype: torch.dtype = torch.bfloat16

    def __call__(self, **kwargs) -> torch.Tensor:
        return self.fn(**kwargs)

    @property
    def tol(self) -> dict:
        return dict(atol=2e-2, rtol=2e-2) if self.dtype == torch.bfloat16 else \
            dict(atol=1e-5, rtol=1e-5)


PREFILL = Prefill()


@pytest.fixture(params=["amx", "avx512_bf16", "float32"])
def prefill(request, monkeypatch):
    """The kernel's varlen function: bf16 on AMX tiles (where this CPU has them) or without, or
    fp32 on AVX-512F; the tests make their cases in its dtype."""
    flags = cpu.cpu_flags()
    if request.param == "float32":
        if "avx512f" not in flags:
            pytest.skip("no AVX-512F here")
        fn = paged_attention.with_prefill_kernel(TWIN, KERNEL, plan.Machine.probe(KERNEL))
        return dataclasses.replace(PREFILL, fn=fn.varlen_func, dtype=torch.float32)
    if not kernels.has_paged_prefill(KERNEL):
        pytest.skip("the library was not built for AVX512-BF16 here")
    if request.param == "amx" and not ("amx_bf16" in flags and kernels.has_amx(KERNEL)):
        pytest.skip("no AMX here")
    if request.param == "avx512_bf16":
        monkeypatch.setattr(cpu, "cpu_flags", lambda: flags - {"amx_bf16", "amx_tile"})
    machine = plan.Machine.probe(KERNEL)  # after the flags were faked
    fn = paged_attention.with_prefill_kernel(TWIN, KERNEL, machine).varlen_func
    return dataclasses.replace(PREFILL, fn=fn)


def args(case, **overrides) -> dict:
    lens = case.lens
    cu_q = [0, *itertools.accumulate(chunk for _, chunk in lens)]
    cu_k = [0, *itertools.accumulate(ctx for ctx, _ in lens)]
    return {"q": case.q, "k": case.k_cache, "v": case.v_cache,
            "cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32),
            "cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32),
            "max_seqlen_q": max(chunk for _, chunk in lens),
            "max_seqlen_k": max(ctx for ctx, _ in lens), "causal": True,
            "block_table": case.block_table, **overrides}


# (context incl. the chunk, chunk): whole prompts, chunks after a cached prefix, one-row and
# empty chunks, lengths on and off the kernel's 16- and 32-key steps.
LENS = [(128, 128), (300, 50), (7, 7), (1, 1), (40, 2), (33, 0), (64, 17), (17, 16)]


@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (64, 1), (128, 4), (64, 9)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_kernel_matches_naive_attention(prefill, head_dim, group, block_size):
    case = poisoned_case(LENS, block_size, group, head_dim, prefill.dtype, seed=head_dim + group)
    got = prefill(**args(case))
    assert got.dtype == prefill.dtype and not got.isnan().any()
    torch.testing.assert_close(got, case.expected(), **prefill.tol)


def test_kernel_agrees_with_the_twin(prefill):
    case = poisoned_case(LENS, 16, 3, 64, prefill.dtype, seed=4)
    torch.testing.assert_close(prefill(**args(case)), TWIN.varlen_func(**args(case)),
                               **prefill.tol)


@pytest.mark.parametrize("q_scale", [0.0, 300.0])
def test_softmax_of_equal_and_of_far_apart_scores(prefill, q_scale):
    case = poisoned_case(LENS, 16, 3, 64, prefill.dtype, seed=7)
    case.q *= q_scale
    # fp32 scores of ~2400 round by ~1e-4 before the exponent: the twin is 1.5e-4 off too.
    tol = dict(atol=1e-3, rtol=1e-3) if q_scale and prefill.dtype == torch.float32 else prefill.tol
    torch.testing.assert_close(prefill(**args(case)), case.expected(), **tol)


def test_one_long_request_is_split_over_threads_and_equals_the_twin(prefill):
    case = poisoned_case([(700, 700)], 16, 3, 64, prefill.dtype, seed=2)
    torch.testing.assert_close(prefill(**args(case)), case.expected(), **prefill.tol)


@pytest.mark.parametrize("change", [
    {"causal": False}, {"flash_contract": True}, {"softmax_scale": 0.3}, "float16", "head 96"])
def test_what_the_kernel_does_not_take_is_the_twins(prefill, change):
    head_dim = 96 if change == "head 96" else 64
    case = poisoned_case(LENS, 16, 3, head_dim, prefill.dtype, seed=1)
    if change == "float16":
        case.q, case.k_cache, case.v_cache = (t.half() for t in (case.q, case.k_cache,
                                                                  case.v_cache))
    overrides = change if isinstance(change, dict) else {}
    if overrides.get("flash_contract"):  # the twin's flash-attn limits: block_size % 256
        with pytest.raises(ValueError, match="block_size|dtype"):  # (fp32: its dtype)
            prefill(**args(case, **overrides))
        return
    got, twin = prefill(**args(case, **overrides)), TWIN.varlen_func(**args(case, **overrides))
    if isinstance(change, str) or overrides.get("causal") is False:
        assert torch.equal(got, twin)  # the twin itself computed it
    else:  # a scale the kernel takes: its own result
        torch.testing.assert_close(got, twin, **prefill.tol)


def test_out_of_range_inputs_are_the_twins_errors(prefill):
    case = poisoned_case(LENS, 16, 3, 64, prefill.dtype, seed=0)
    with pytest.raises(ValueError, match="too few columns"):
        prefill(**args(case, block_table=case.block_table[:, :3].contiguous()))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        prefill(**args(case, max_seqlen_q=100))
    with pytest.raises(ValueError, match="no key"):
        cu_k = args(case)["cu_seqlens_k"].clone()
        cu_k[1:] -= 1  # request 0: 127 keys for a chunk of 128
        prefill(**args(case, cu_seqlens_k=cu_k))
    table = case.block_table.clone()
    table[1, 0] = case.k_cache.shape[0]  # just past the cache: the twin's index error
    with pytest.raises(IndexError):
        prefill(**args(case, block_table=table))


@pytest.mark.parametrize(("dtype", "flag"), [("bfloat16", "avx512_bf16"), ("float32", "avx512f")])
def test_the_engine_takes_the_kernel_for_prefill(monkeypatch, dtype, flag):
    """With the fast path on this CPU (head size 64), prefill chunks run the kernel, and the
    greedy tokens equal those of the same engine with the twin for prefill; a CPU without
    AVX512-BF16 (bf16) or AVX-512F (fp32) does not take it."""
    if dtype == "bfloat16" and not kernels.has_paged_prefill(KERNEL):
        pytest.skip("the library was not built for AVX512-BF16 here")
    calls = []
    monkeypatch.setattr(KERNEL, "paged_prefill", _counting(KERNEL.paged_prefill, calls))
    prompts = [[5 + i, 9, 11 + 2 * i, 3] * (3 + i) for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0)
    settings = dict(dtype=dtype, block_size=4, num_kv_blocks=64,
                    max_num_batched_tokens=24)  # chunks after a cached part, too
    fast = LLM(tiny_model_dir(head_dim=64), **settings)
    if flag not in cpu.cpu_flags():  # a (faked) CPU without it keeps the twin
        assert "cpu-prefill" not in fast.model_runner.backend.name
        return
    assert "cpu-prefill" in fast.model_runner.backend.name
    got = [o.token_ids for o in fast.generate(prompts, params)]
    assert calls
    monkeypatch.setattr(accel, "with_prefill_kernel", lambda backend, lib, machine: backend)
    twin = LLM(tiny_model_dir(head_dim=64), **settings)
    assert "cpu-prefill" not in twin.model_runner.backend.name
    assert got == [o.token_ids for o in twin.generate(prompts, params)]


def _counting(fn, calls):
    def counted(*a):
        calls.append(a)
        return fn(*a)
    return counted


def test_the_twin_is_untouched():
    assert TWIN.varlen_func is torch_attention.flash_attn_varlen_func
