"""§4 (process the step's output): `stop_token_ids` finish a request with "stop" right after
the first generated occurrence of a stop token, on the FakeEngine (every policy) and on a
real LLM (tiny random model, greedy, so the token to stop at is known in advance)."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.request import FinishReason, Request
from tests.common.fake_engine import EOS, FakeEngine, expected_output
from tests.common.tiny_model import tiny_model_dir

PROMPT = [5, 17, 3, 250, 8, 41]
MAX_TOKENS = 12


def first_new_token_after(output: list[int], start: int) -> int:
    """Index of the first token at or after `start` that did not occur earlier in `output`,
    so stopping on it stops exactly there."""
    return next(k for k in range(start, len(output)) if output[k] not in output[:k])


def run_fake(policy: str, params: SamplingParams) -> Request:
    eng = FakeEngine(num_kv_blocks=16, block_size=4, scheduling_policy=policy)
    req = Request("a", PROMPT, params, frozenset({EOS}))
    other = Request("b", [9, 9, 9], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                    frozenset({EOS}))
    for r in (req, other):
        eng.requests[r.request_id] = r
        eng.scheduler.add_request(r)
    eng.run()
    bm = eng.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # The neighbour is unaffected by a's stop tokens.
    assert other.output_token_ids == expected_output([9, 9, 9], MAX_TOKENS)
    return req


@pytest.mark.parametrize("policy", ["fcfs", "priority", "static"])
@pytest.mark.parametrize("ignore_eos", [False, True])  # ignore_eos is about EOS only
def test_stop_token_finishes_right_after_its_first_occurrence(policy, ignore_eos):
    want = expected_output(PROMPT, MAX_TOKENS)
    k = first_new_token_after(want, 3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos,
                            stop_token_ids=[want[k], 998])  # 998: never generated
    req = run_fake(policy, params)
    assert req.output_token_ids == want[:k + 1]  # the stop token itself is kept (vLLM)
    assert req.finish_reason == FinishReason.STOP


def test_stop_tokens_in_the_prompt_do_not_stop_generation():
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            stop_token_ids=[t for t in PROMPT
                                            if t not in expected_output(PROMPT, MAX_TOKENS)])
    req = run_fake("fcfs", params)
    assert req.output_token_ids == expected_output(PROMPT, MAX_TOKENS)
    assert req.finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_stops_unless_ignore_eos(ignore_eos):
    want = expected_output(PROMPT, MAX_TOKENS)
    k = first_new_token_after(want, 2)
    eng = FakeEngine(num_kv_blocks=16, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos)
    req = Request("a", PROMPT, params, frozenset({want[k]}))  # this "model"'s EOS
    eng.scheduler.add_request(req)
    eng.run()
    if ignore_eos:
        assert req.output_token_ids == want and req.finish_reason == FinishReason.LENGTH
    else:
        assert req.output_token_ids == want[:k + 1] and req.finish_reason == FinishReason.STOP


def test_stop_token_ids_on_a_real_llm():
    llm = LLM(tiny_model_dir(), num_kv_blocks=16, block_size=4, max_model_len=64)
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [ref] = llm.generate([PROMPT], free, use_tqdm=False)
    assert ref.finish_reason == "length" and len(ref.token_ids) == MAX_TOKENS
    k = first_new_token_after(ref.token_ids, 2)
    stop = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          stop_token_ids=[ref.token_ids[k]])
    [out] = llm.generate([PROMPT], stop, use_tqdm=False)
    assert out.token_ids == ref.token_ids[:k + 1]
    assert out.finish_reason == "stop"
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
