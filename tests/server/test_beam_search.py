"""Beam search served (vLLM's `use_beam_search`, nanoserve/entrypoints/serving_beam_search.py),
on a real server and the real `openai` client:
- completions (a batch of prompts) and chat give `LLM.beam_search`'s sequences, best first, as
  choices (n is the beam width), streamed or not; usage counts their tokens;
- what a search would not honour (stop, seed, top_p, logprobs, ...) is a 400 naming it, and
  Responses takes no beam search;
- a client that leaves mid-search ends it: no more rounds, nothing left holding KV;
- on the bundled model a chat's search ends at the EOS: finish_reason "stop", no EOS text."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from nanoserve.entrypoints.beam_search import BeamSearch, BeamSearchParams
from nanoserve.entrypoints.bundled import default_model_dir
from tests.server.harness import ServerProcess, post

PROMPTS = [[5, 6, 7, 8, 9], [300, 301, 302]]


def expected(llm, prompts, params: BeamSearchParams) -> list[tuple[str, str]]:
    """Each choice's (text, finish_reason), from LLM.beam_search, as the server writes them."""
    out = []
    for prompt, result in zip(prompts, llm.beam_search(prompts, params)):
        search = BeamSearch(prompt, params, llm.processor.eos_token_ids, llm.config.max_model_len)
        for seq in result.sequences:
            text_ids = search.generated(seq)[1]
            out.append((llm.get_tokenizer().decode(text_ids, skip_special_tokens=True),
                        seq.finish_reason))
    return out


def test_completions_give_llm_beam_search_streamed_or_not(server, ref_llm):
    want = expected(ref_llm, PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6))
    client = server.client()
    out = client.completions.create(model="m", prompt=PROMPTS, n=3, max_tokens=6,
                                    extra_body={"use_beam_search": True})
    assert [(c.text, c.finish_reason) for c in out.choices] == want
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.completion_tokens == 6 * 6 and out.usage.prompt_tokens == 8
    got = {}
    for chunk in client.completions.create(model="m", prompt=PROMPTS, n=3, max_tokens=6,
                                           stream=True, extra_body={"use_beam_search": True}):
        for c in chunk.choices:  # the whole text of a choice in one chunk
            assert c.index not in got
            got[c.index] = (c.text, c.finish_reason)
    assert [got[i] for i in range(6)] == want
    server.wait_idle()


def test_chat_gives_llm_beam_search_with_length_penalty(server, ref_llm):
    messages = [{"role": "user", "content": "Say something."}]
    prompt = ref_llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    params = BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.5)
    out = server.client().chat.completions.create(
        model="m", messages=messages, n=2, max_tokens=5,
        extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [(c.message.content, c.finish_reason) for c in out.choices] == expected(
        ref_llm, [prompt], params)


BAD = [  # (change, param)
    ({"stop": ["x"]}, "stop"), ({"stop_token_ids": [3]}, "stop_token_ids"),
    ({"seed": 1}, "seed"), ({"top_p": 0.5}, "top_p"), ({"top_k": 5}, "top_k"),
    ({"logprobs": 2}, "logprobs"), ({"n": 11}, "n"), ({"length_penalty": "x"}, "length_penalty"),
    ({"length_penalty": float("inf")}, "length_penalty"),
    ({"use_beam_search": 1}, "use_beam_search"),
]


@pytest.mark.parametrize("change, param", BAD, ids=[str(b[0]) for b in BAD])
def test_what_a_search_cannot_honour_is_a_400_naming_it(server, change, param):
    body = {"model": "m", "prompt": [5, 6], "max_tokens": 2, "use_beam_search": True, **change}
    r = post(server, "/v1/completions", json.dumps(body).replace("Infinity", "1e999"))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    good = {k: v for k, v in body.items() if k not in change}
    ok = post(server, "/v1/completions", json.dumps({**good, "n": 2, "use_beam_search": True}))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_a_prompt_the_engine_refuses_is_a_400_as_without_a_search(server):
    body = {"model": "m", "prompt": [[5, 6], [5, 10**6]], "max_tokens": 2, "n": 2,
            "use_beam_search": True}
    r = post(server, "/v1/completions", json.dumps(body))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    server.wait_idle()


def test_responses_take_no_beam_search(server):
    r = post(server, "/v1/responses", json.dumps({"model": "m", "input": "hi",
                                                  "use_beam_search": True}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_leaving_mid_search_ends_it(server):
    """1500 rounds would be 1 + 4 x 1499 tokens (one beam in the first); the client leaves after
    ~1 s, when a few hundred have come."""
    tokens = "nanoserve:generation_tokens_total"
    server.wait_idle()
    before = server.metrics()[tokens]
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 1500, "n": 4, "ignore_eos": True,
            "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up before the answer
        httpx.post(server.base + "/v1/completions", json=body, timeout=1.0)
    seen = [-1.0]  # no new token over 0.5 s: the search has ended

    def still(m: dict) -> bool:
        time.sleep(0.5)
        seen.append(m[tokens])
        return seen[-1] == seen[-2]

    server.wait_until(still)
    assert seen[-1] - before < (1 + 4 * 1499) // 2  # not the whole search: it stopped
    server.wait_idle()  # nothing holds KV
    ok = post(server, "/v1/completions", json.dumps({**body, "max_tokens": 2}))
    assert ok.status_code == 200


def test_a_chat_search_ends_at_the_eos_on_the_bundled_model():
    # 16-token blocks: a round recomputes only each beam's last block, not its whole sequence
    # (14 s of the search at the CPU's default 128, on a 2-core Zen 3 VM)
    s = ServerProcess(default_model_dir(), ["--dtype", "float32", "--max-model-len", "512",
                                            "--block-size", "16"])
    try:
        out = s.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi!"}], n=3, max_tokens=40,
            extra_body={"use_beam_search": True})
        assert "stop" in [c.finish_reason for c in out.choices]
        assert all("<|im_end|>" not in c.message.content for c in out.choices)
        assert out.choices[0].message.content.startswith("Hello")
    finally:
        assert s.stop() == 0
