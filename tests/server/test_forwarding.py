"""Each field at its boundary and on its way to the engine, and what comes back: tests written so
that a realistic bug in the server fails one (scripts/dev/mutate.py plants them: `mutate.py
server`). A request without `model`, `prompt: ["text"]`, `max_tokens` exactly filling
max_model_len, `include_stop_str_in_output`, `include_usage: false`, a stop string completed by
the last allowed token, /metrics against the engine's own counters; and, on the detokenizer
the server streams from, a stream cut mid-character, special tokens, EOS as a stop_reason."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import httpx
import pytest
from transformers import AutoTokenizer

from nanoserve import SamplingParams
from nanoserve.engine.request import FinishReason
from nanoserve.entrypoints.detokenizer import Detokenizer
from nanoserve.sampling_params import RequestOutputKind
from tests.common.tiny_model import VOCAB_SIZE, tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, post

GOOD = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def complete(server, **body) -> dict:
    r = post(server, "/v1/completions", json.dumps({**GOOD, "ignore_eos": True, **body}))
    assert r.status_code == 200, r.text
    return r.json()


def events(server, **body) -> list[str]:
    r = post(server, "/v1/completions", json.dumps({**GOOD, "stream": True, **body}))
    assert r.status_code == 200, r.text
    return [e for e in r.text.split("\n\n") if e]


def test_model_may_be_left_out(server):
    body = {k: v for k, v in GOOD.items() if k != "model"}
    assert post(server, "/v1/completions", json.dumps(body)).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(server, "/v1/chat/completions", json.dumps(chat)).status_code == 200


def test_a_prompt_in_a_list_of_one_is_that_prompt(server):
    for inner in ("The quick brown fox", [5, 17, 3, 250]):
        assert complete(server, prompt=[inner], max_tokens=6)["choices"][0]["text"] == \
            complete(server, prompt=inner, max_tokens=6)["choices"][0]["text"]


def test_max_tokens_may_fill_max_model_len_exactly(server):
    with httpx.stream("POST", server.base + "/v1/completions", timeout=30, json={
            **GOOD, "max_tokens": MAX_MODEL_LEN - 3, "stream": True}) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: {")  # running: then leave (an abort)
    r = post(server, "/v1/completions", json.dumps({**GOOD, "max_tokens": MAX_MODEL_LEN + 1}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # (less: the room)
    server.wait_idle()


def test_usage_is_streamed_only_when_asked(server):
    for options in (None, {"include_usage": False}):
        got = events(server, stream_options=options)
        assert got[-1] == "data: [DONE]"
        assert all("usage" not in json.loads(e[6:]) for e in got[:-1]), (options, got)
    got = events(server, stream_options={"include_usage": True})
    assert json.loads(got[-2][6:])["usage"]["completion_tokens"] == 2
    assert all("usage" not in json.loads(e[6:]) for e in got[:-2])
    both = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's: usage in every chunk
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body, n, lens in (("/v1/completions", GOOD, 2, [3]),
                                ("/v1/completions", {**GOOD, "prompt": [[5, 6, 7], [5, 6, 7, 8]]},
                                 1, [3, 4]),  # a batch: each choice its own prompt's tokens
                                ("/v1/chat/completions", chat, 2, None)):
        r = post(server, path, json.dumps({**body, "n": n, "stream": True, "ignore_eos": True,
                                           "stream_options": both}))
        chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and "[DONE]" not in e]
        lens = lens or [chunks[-1]["usage"]["prompt_tokens"]]  # (the chat's rendered prompt)
        made = {0: [], 1: []}  # each choice's completion_tokens, chunk by chunk
        for chunk in chunks[:-1]:
            [choice] = chunk["choices"]
            made[choice["index"]].append(chunk["usage"]["completion_tokens"])
            assert chunk["usage"]["prompt_tokens"] == lens[choice["index"] // n]
        assert all(counts == sorted(counts) and counts[-1] == 2 for counts in made.values())
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": sum(lens), "completion_tokens": 4, "total_tokens": sum(lens) + 4}


def stop_at_the_last_token(ref_llm, n: int, spanning: bool) -> tuple[list[int], str, str]:
    """A prompt, its greedy n-token text, and a stop string that only the n-th token's text
    completes (it occurs nowhere earlier): within that token's text, or (spanning) starting in
    the text before it, so that its start was streamable a step before it was known."""
    rng = random.Random(3)
    for _ in range(50):
        prompt = rng.choices(range(3, VOCAB_SIZE), k=8)
        [out] = ref_llm.generate([prompt], greedy(n), use_tqdm=False)
        text, before = out.text, ref_llm.tokenizer.decode(out.token_ids[:-1])
        if "\ufffd" in text or not text.startswith(before) or len(text) - len(before) < 1:
            continue
        last = len(text) - len(before)
        for size in range(last + 1, len(text) + 1) if spanning else range(1, last + 1):
            if text.find(stop := text[-size:]) == len(text) - size and stop.strip():
                return prompt, text, stop
    raise AssertionError("no prompt in 50 gives such a stop string")


@pytest.mark.parametrize("spanning", [False, True])
def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(server, ref_llm, spanning):
    prompt, text, stop = stop_at_the_last_token(ref_llm, 10, spanning)
    for include, want in ((False, text[:-len(stop)]), (True, text)):
        choice = complete(server, prompt=prompt, max_tokens=10, stop=[stop],
                          include_stop_str_in_output=include)["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == \
            (want, "stop", stop), include
        streamed = [json.loads(e[6:])["choices"][0] for e in events(
            server, prompt=prompt, max_tokens=10, stop=[stop], ignore_eos=True,
            include_stop_str_in_output=include)[:-1]]
        assert "".join(c["text"] for c in streamed) == want
        assert streamed[-1]["finish_reason"] == "stop"


def test_metrics_count_what_the_engine_counted(server, ref_llm):
    """Two requests for one unseen prompt: /metrics moves by exactly the engine's numbers."""
    prompt = random.Random(11).choices(range(3, VOCAB_SIZE), k=40)  # two full blocks of 16
    bm = ref_llm.scheduler.block_manager
    queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
    for _ in range(2):
        ref_llm.generate([prompt], greedy(5), use_tqdm=False)
    want_queries, want_hits = bm.prefix_cache_queries - queries, bm.prefix_cache_hits - hits
    assert want_hits == 32
    before = server.wait_idle()
    for _ in range(2):
        complete(server, prompt=prompt, max_tokens=5)
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after.get("nanoserve:" + name, 0) - before.get("nanoserve:" + name, 0)

    assert delta("prefix_cache_queries_total") == want_queries
    assert delta("prefix_cache_hits_total") == want_hits
    assert delta("prompt_tokens_total") == 80 and delta("generation_tokens_total") == 10
    assert delta('request_success_total{finished_reason="length"}') == 2
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_time_per_output_token_seconds_count"):
        assert delta(name) == 2, name
    assert delta("num_preemptions_total") == 0


# -- the detokenizer the server streams from ----------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_model_dir(MAX_MODEL_LEN))


def detokenize(tok, steps: list[list[int]], reason: FinishReason, **params) -> tuple:
    """DELTA outputs for the tokens of each step (finished after the last): the joined text,
    each piece, and the final stop_reason; and the text decoded once (FINAL_ONLY)."""
    p = SamplingParams(output_kind=RequestOutputKind.DELTA, **params)
    d, tokens, pieces = Detokenizer(tok, p), [], []
    req = SimpleNamespace(num_prompt_tokens=1, token_ids=[5], is_finished=False,
                          finish_reason=None, output_token_ids=tokens)
    for i, step in enumerate(steps):
        tokens += step
        req.token_ids = [5, *tokens]
        if i == len(steps) - 1:
            req.is_finished, req.finish_reason = True, reason
        d.update(req)
        text, _, stop_reason = d.output(req)
        pieces.append(text)
    once = Detokenizer(tok, SamplingParams(**params)).output(req)[0]
    return "".join(pieces), pieces, stop_reason, once


def test_a_stream_cut_mid_character_keeps_its_tail(tok):
    h, i, c3, a9 = tok.convert_tokens_to_ids(["H", "i", "Ã", "©"])  # "é" is C3 A9
    joined, pieces, _, once = detokenize(tok, [[h, i], [c3], [a9], [c3]], FinishReason.LENGTH)
    assert joined == once == "Hié\ufffd"
    assert pieces[:3] == ["Hi", "", "é"]  # the split character waits until whole


def test_special_tokens_are_not_text(tok):
    h, i = tok.convert_tokens_to_ids(["H", "i"])
    joined, _, _, once = detokenize(tok, [[h, 1], [i, 2], [0]], FinishReason.LENGTH,
                                    ignore_eos=True)
    assert joined == once == "Hi"


def test_eos_is_no_stop_reason_a_stop_token_is(tok):
    h = tok.convert_tokens_to_ids("H")
    assert detokenize(tok, [[h], [tok.eos_token_id]], FinishReason.STOP)[2] is None
    assert detokenize(tok, [[h], [h]], FinishReason.STOP, stop_token_ids=[h])[2] == h
    assert detokenize(tok, [[h], [h]], FinishReason.LENGTH)[2] is None
