"""§4 for a server: DELTA outputs, incremental detokenization and stop strings (engine level).

- DELTA outputs of running requests, step by step, join to exactly `generate()`'s text and tokens,
  one `finished` output each; an aborted DELTA request's last output says "abort".
- Multi-byte characters (emoji, Vietnamese) fed one token at a time never come out as U+FFFD.
- Stop strings (vLLM's semantics): the text is cut before the stop string (or after it with
  include_stop_str_in_output), finish_reason "stop", stop_reason the string; a stop string that
  spans two tokens never leaks into the streamed text (the holdback), and its KV blocks are freed.
- n != 1, bad `stop` values, and stop strings without a tokenizer are ValueErrors naming the field.
"""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.request import FinishReason, Request, RequestStatus
from nanoserve.entrypoints.detokenizer import Detokenizer
from nanoserve.sampling_params import RequestOutputKind
from tests.common.tiny_model import tiny_model_dir

DELTA = RequestOutputKind.DELTA
PROMPTS = ["Hello there, my friend", [5, 17, 3, 250, 8, 41], "Xin chào các bạn 🇻🇳"]
MAX_STEPS = 500  # every loop below is bounded


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_model_dir(), num_kv_blocks=64, block_size=4, dtype="float32",
               max_model_len=128)


def run_deltas(llm: LLM, ids: list[str]) -> dict[str, list]:
    """Step until every request in `ids` finished; all outputs, per request."""
    outs: dict[str, list] = {i: [] for i in ids}
    for _ in range(MAX_STEPS):
        if all(o and o[-1].finished for o in outs.values()):
            break
        for o in llm.step():
            outs[o.request_id].append(o)
    else:
        raise AssertionError("requests did not finish")
    return outs


def all_free(llm: LLM) -> bool:
    bm = llm.scheduler.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.has_unfinished_requests()


def test_delta_outputs_join_to_generate(llm):
    refs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    ids = [llm.add_request(p, greedy(output_kind=DELTA)) for p in PROMPTS]
    outs = run_deltas(llm, ids)
    for rid, ref in zip(ids, refs):
        got = outs[rid]
        assert [o.finished for o in got] == [False] * (len(got) - 1) + [True]
        assert "".join(o.text for o in got) == ref.text
        assert [t for o in got for t in o.token_ids] == ref.token_ids
        assert got[-1].finish_reason == "length" and got[-2].finish_reason is None
    assert all_free(llm)


def test_generate_ignores_a_delta_output_kind(llm):
    """generate() returns one whole output per prompt whatever output_kind says."""
    [ref] = llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)
    [out] = llm.generate([PROMPTS[0]], greedy(output_kind=DELTA), use_tqdm=False)
    assert out.text == ref.text and out.token_ids == ref.token_ids and out.finished


def test_abort_of_a_delta_request(llm):
    rid = llm.add_request(PROMPTS[1], greedy(60, output_kind=DELTA))
    got = []
    for _ in range(5):
        got += llm.step()
    assert llm.abort(rid)
    got += llm.step()
    assert got[-1].finished and got[-1].finish_reason == "abort"
    [ref] = llm.generate([PROMPTS[1]], greedy(60), use_tqdm=False)
    tokens = [t for o in got for t in o.token_ids]
    assert tokens == ref.token_ids[:len(tokens)] and 4 <= len(tokens) < 60
    assert all_free(llm)


@pytest.mark.parametrize("text", ["Chúc mừng năm mới! Hà Nội mùa thu 🍂",
                                  "😀👩‍👩‍👧‍👦🇻🇳 ok", "Tiếng Việt có dấu: ầ ẩ ẫ ậ ừ ữ ự"])
def test_multibyte_characters_never_come_out_broken(llm, text):
    """A real tokenizer's byte-level pieces, fed one token per step."""
    ids = llm.tokenizer.encode(text)
    req = Request("x", [1], greedy(len(ids), output_kind=DELTA))
    detok = Detokenizer(llm.tokenizer, req.sampling_params)
    pieces = []
    for i, t in enumerate(ids):
        req.token_ids.append(t)
        if i == len(ids) - 1:
            req.status = RequestStatus.FINISHED
        detok.update(req)
        pieces.append(detok.output(req)[0])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == llm.tokenizer.decode(ids, skip_special_tokens=True) == text
    assert sum(p == "" for p in pieces) >= 1  # some tokens were an incomplete character


def split_stop(llm: LLM, ref) -> tuple[str, int, int]:
    """A 4-character stop string made of the end of token k and the start of token k+1, whose
    first occurrence in the reference text is there: (stop, its start, k)."""
    dec = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for k in range(2, len(ref.token_ids) - 2):
        head, nxt = dec(ref.token_ids[:k + 1]), dec(ref.token_ids[:k + 2])
        b = len(head)
        stop = ref.text[b - 2:b + 2]
        if (ref.text.startswith(nxt) and len(nxt) >= b + 2 and len(dec(ref.token_ids[k:k + 1]))
                >= 2 and "\ufffd" not in stop and ref.text.find(stop) == b - 2):
            return stop, b - 2, k
    pytest.skip("no token boundary usable for a split stop string in this output")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(llm, include):
    [ref] = llm.generate([PROMPTS[0]], greedy(40), use_tqdm=False)
    stop, start, k = split_stop(llm, ref)
    want = ref.text[:start + len(stop) if include else start]
    params = greedy(40, stop=["never-in-the-text", stop], include_stop_str_in_output=include)
    [out] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert (out.text, out.finish_reason, out.stop_reason) == (want, "stop", stop)
    assert out.token_ids == ref.token_ids[:k + 2]  # up to the token that completed it
    # Streamed: every prefix of the stream is a prefix of the answer, so no part of the stop
    # string (beyond what include keeps) is ever sent.
    rid = llm.add_request(PROMPTS[0], greedy(40, stop=stop, include_stop_str_in_output=include,
                                                 output_kind=DELTA))
    sent = ""
    for o in run_deltas(llm, [rid])[rid]:
        sent += o.text
        assert want.startswith(sent)
    assert sent == want and o.stop_reason == stop and o.finish_reason == "stop"
    assert all_free(llm)


def test_the_stop_string_that_ends_first_stops_it(llm):
    """vLLM's: where new text completes two stop strings, the one that ends first wins, not the
    one listed first; of two that end together, the one listed first."""
    ids = llm.tokenizer.encode(" the cat")
    for stop, reason, text in ((["e", "th"], "th", " "), (["he", "e"], "he", " t"),
                               (["cat", "the"], "the", " ")):
        params = greedy(len(ids), stop=stop, output_kind=DELTA)
        req, detok = Request("x", [1], params), Detokenizer(llm.tokenizer, params)
        req.token_ids.extend(ids)  # all in one update: one step's new text
        assert (detok.update(req), detok.text) == (reason, text), stop


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    """vLLM's skip_special_tokens: True (the default) leaves <|im_end|> and the like out of the
    text; False keeps them, in the whole text and streamed."""
    end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = llm.tokenizer.encode("Hi") + [end] + llm.tokenizer.encode(" there")
    for skip, want in ((True, "Hi there"), (False, "Hi<|im_end|> there")):
        params = greedy(len(ids), skip_special_tokens=skip, output_kind=DELTA)
        req, detok = Request("x", [1], params), Detokenizer(llm.tokenizer, params)
        sent = ""
        for t in ids:
            req.token_ids.append(t)
            detok.update(req)
            sent += detok.output(req)[0]
        req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
        assert (detok.text, sent + detok.output(req)[0]) == (want, want)


def test_holdback_while_streaming(llm):
    """Without include, the last max(len(stop)) - 1 characters wait until the request ends."""
    ids = llm.tokenizer.encode(" abcdefghij klmnop")
    params = greedy(len(ids), stop=["zzzzz", "yy"], output_kind=DELTA)
    req, detok = Request("x", [1], params), Detokenizer(llm.tokenizer, params)
    sent = ""
    for t in ids:
        req.token_ids.append(t)
        assert detok.update(req) is None
        sent += detok.output(req)[0]
        assert sent == detok.text[:max(len(detok.text) - 4, 0)]
    req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
    assert sent + detok.output(req)[0] == " abcdefghij klmnop"


def test_stop_token_id_is_the_stop_reason_and_its_text_is_left_out(llm):
    """vLLM's: the token that stopped a request stays in token_ids, its text stays out of the
    text (unless include_stop_str_in_output), whole or streamed."""
    [ref] = llm.generate([PROMPTS[1]], greedy(12), use_tqdm=False)
    k = next(i for i in range(3, 12) if ref.token_ids[i] not in ref.token_ids[:i])
    before, through = llm.generate([PROMPTS[1]] * 2, [greedy(k), greedy(k + 1)], use_tqdm=False)
    for include, text in ((False, before.text), (True, through.text)):
        stop = greedy(12, stop_token_ids=[ref.token_ids[k]], include_stop_str_in_output=include)
        [out] = llm.generate([PROMPTS[1]], stop, use_tqdm=False)
        assert out.finish_reason == "stop" and out.stop_reason == ref.token_ids[k]
        assert out.token_ids == ref.token_ids[:k + 1] and out.text == text
        rid = llm.add_request(PROMPTS[1], greedy(12, stop_token_ids=[ref.token_ids[k]],
                                                 include_stop_str_in_output=include,
                                                 stop=["never in it"], output_kind=DELTA))
        deltas = run_deltas(llm, [rid])[rid]
        assert "".join(o.text for o in deltas) == text


@pytest.mark.parametrize("kw, field", [({"n": 129}, "n"), ({"n": 0}, "n"),
                                       ({"logprobs": -1}, "logprobs"), ({"stop": [""]}, "stop"),
                                       ({"stop": 5}, "stop"), ({"stop": ["a", 3]}, "stop"),
                                       ({"include_stop_str_in_output": 1},
                                        "include_stop_str_in_output"),
                                       ({"output_kind": "delta"}, "output_kind")])
def test_bad_new_sampling_params(kw, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kw)


def test_stop_strings_need_a_tokenizer():
    llm = LLM(tiny_model_dir(), num_kv_blocks=8, block_size=4, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.add_request([5, 6], greedy(stop="x"))
    rid = llm.add_request([5, 6], greedy(4, output_kind=DELTA))  # token deltas still work
    outs = run_deltas(llm, [rid])[rid]
    assert sum(len(o.token_ids) for o in outs) == 4 and all(o.text == "" for o in outs)
