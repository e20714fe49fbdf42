"""The CPU's candidate sampler (sampler.py) against the plain one: the same probabilities, and so
the same draws, whether the 1024 likeliest tokens suffice (peaked rows) or the whole row is sorted
(a flat row; a top_k above 1024); its greedy pick in C against torch's max."""

from __future__ import annotations

import functools

import pytest
import torch

from nanoserve import LLM
from nanoserve.layers.sampler import Sampler, SamplingMetadata, filtered_probs
from nanoserve.sampling_params import SamplingParams
from nanoserve_accel import kernels
from nanoserve_accel.sampler import c_largest, candidate_probs
from tests.common.tiny_model import tiny_model_dir


def kept(params: SamplingParams, logits: torch.Tensor, filter_) -> dict[int, float]:
    """Token id -> filtered (unnormalised) probability, for the tokens that survive."""
    meta = SamplingMetadata.build([params], [None], logits.shape[-1], logits.device)
    probs, ids = filter_(logits.unsqueeze(0).float(), meta)
    ids = range(probs.shape[1]) if ids is None else ids[0].tolist()
    return {t: float(p) for t, p in zip(ids, probs[0]) if p > 0}


@pytest.mark.parametrize("knobs", [dict(top_p=0.9), dict(top_k=50), dict(top_k=2000),
                                   dict(top_k=40, top_p=0.5), dict(top_p=0.999), dict()])
def test_the_candidates_draw_what_the_whole_sort_draws(knobs):
    vocab = 5000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)) * 6
    logits[2] *= 1e-3  # nearly flat (no exact ties, which topk and sort break apart): top-p
    # needs most of the vocabulary
    params = [SamplingParams(temperature=0.9, seed=3, **knobs)] * 4

    def tokens(filter_) -> list:
        sampler = Sampler(0)
        sampler.filter = filter_
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        return [sampler(logits, params, gens)[0] for _ in range(6)]

    assert tokens(candidate_probs) == tokens(filtered_probs)
    for row in (0, 2):  # peaked: from the candidates; flat: the whole sort
        assert kept(params[0], logits[row], candidate_probs) == pytest.approx(
            kept(params[0], logits[row], filtered_probs))


def test_the_fast_path_swaps_it_in_on_a_cpu():
    def filter_of(**kwargs):
        llm = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=8, skip_tokenizer_init=True,
                  **kwargs)
        return llm.model_runner.sampler.filter

    assert filter_of() is candidate_probs
    assert filter_of(enable_fast_paths=False) is filtered_probs
    sampler = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=8,
                  skip_tokenizer_init=True).model_runner.sampler
    if kernels.compile_kernels() is not None:
        assert sampler.largest.func is c_largest


@pytest.mark.skipif(kernels.compile_kernels() is None, reason="no C compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9])
@pytest.mark.parametrize("vocab", [49152, 49157, 21])  # whole vectors, a partial last one, less
def test_the_c_greedy_pick_is_torchs_max(dtype, rows, vocab):
    """The same token as torch's max(dim=-1), the first of tied maxima (-0 and +0 tie); NaN rows
    flagged."""
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    logits[0, 19] = logits[0, 7] = logits[0].max() + 1  # a tie: the first wins
    if rows > 1:
        logits[1, vocab // 2] = float("nan")
        logits[2] = float("-inf")  # all -inf: token 0, as torch
        logits[3, -1] = float("inf")
        logits[4:8] = -logits[4:8].abs() - 1  # zeros the largest
        logits[4, 3], logits[4, -1] = -0.0, 0.0  # -0 first: it wins, as torch
        logits[5, -1] = -0.0
        logits[6, 0], logits[6, 5] = 0.0, -0.0
        logits[7, -1] = float("nan") if dtype == torch.float32 else float("-nan")
        logits[8, -1] = logits[8].max() + 1  # in the partial last vector
    pick = functools.partial(c_largest, kernels.compile_kernels())
    top, tokens = pick(logits)
    expected_top, expected_tokens = logits.max(dim=-1)
    nan = expected_top.isnan()
    assert torch.equal(top.isnan(), nan)
    assert torch.equal(tokens[~nan], expected_tokens[~nan]) and tokens[0] == 7
    if rows > 1:
        assert tokens[4:7].tolist() == [3, vocab - 1, 0] and nan[7]
    assert torch.equal(top[~nan], expected_top[~nan].float())
    strided = logits.t().contiguous().t()  # not contiguous: torch's own
    assert torch.equal(pick(strided)[1][~nan], expected_tokens[~nan])
