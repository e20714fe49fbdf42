"""The OpenAI-compatible server (nanoserve/entrypoints/), end to end: a real
`python -m nanoserve.serve` process on 127.0.0.1 (ephemeral port), the real `openai` client and
raw httpx. Every wait is bounded in count and time; speed is never asserted.

- Greedy completions and chat equal `LLM.generate`'s (same model, in this process); streamed
  text joined equals the non-streamed text; usage counts; `echo`; /v1/models, /health, /version,
  /metrics parse.
- Bad inputs: each a 400 (404 for an unknown model) naming the field, and the server keeps serving.
- A client that disconnects mid-stream or mid-answer aborts its request: 0 running, all KV free.
- 64 concurrent clients, mixed lengths, some disconnecting at random points, some bad: every good
  one gets the right greedy tokens, no 5xx, no leaked block, RSS flat over repeated rounds.
- The bundled model streams emoji / Vietnamese without U+FFFD; a stop string never leaks.
- --api-key (401), SIGTERM: in-flight requests finish, then exit 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
from importlib.metadata import version
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoserve import SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.entrypoints.bundled import default_model_dir
from nanoserve.entrypoints.cli_args import chat_template, engine_config, parse_args
from tests.common.tiny_model import VOCAB_SIZE, tiny_model_dir
from tests.server.harness import (
    MAX_MODEL_LEN,
    TINY_CONFIG,  # noqa: F401 (tests/tp imports it from here)
    TINY_FLAGS,
    ServerProcess,
    post,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "reader"))
from trace_page import build_page, read_runs  # noqa: E402


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# -- correct answers ---------------------------------------------------------------------


def test_completions_equal_generate_streamed_or_not(server, ref_llm):
    client = server.client()
    for prompt in ["The quick brown fox", [5, 17, 3, 250, 8, 41]]:
        [ref] = ref_llm.generate([prompt], greedy(20), use_tqdm=False)
        out = client.completions.create(model="m", prompt=prompt, max_tokens=20, temperature=0,
                                        extra_body={"ignore_eos": True})
        choice = out.choices[0]
        assert choice.text == ref.text and choice.finish_reason == "length"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) \
            == (len(ref.prompt_token_ids), 20, len(ref.prompt_token_ids) + 20)
        chunks = list(client.completions.create(
            model="m", prompt=prompt, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
        assert "".join(c.choices[0].text for c in chunks[:-1]) == ref.text
        assert chunks[-2].choices[0].finish_reason == "length"
        assert all(c.usage is None for c in chunks[:-1])  # usage only on the last chunk


def test_echo_puts_each_prompts_text_before_its_completions(server, ref_llm):
    """vLLM's `echo`: the prompt's text (token ids decoded), then the completion; streamed, in
    the choice's first chunk. The usage counts the generated tokens only."""
    client, text, ids = server.client(), "The quick brown fox", [5, 17, 3, 250, 8, 41]
    echoed = {0: text, 1: ref_llm.tokenizer.decode(ids)}
    refs = ref_llm.generate([text, ids], greedy(6), use_tqdm=False)
    for i, prompt in enumerate((text, ids)):
        kw = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True,
              "extra_body": {"ignore_eos": True}}
        out = client.completions.create(**kw)
        assert out.choices[0].text == echoed[i] + refs[i].text
        assert out.usage.completion_tokens == 6
        chunks = [c.choices[0].text for c in client.completions.create(**kw, stream=True)]
        assert chunks[0].startswith(echoed[i]) and "".join(chunks) == echoed[i] + refs[i].text
    batch = [ids, [9, 8, 7]]  # a batch: each choice after its own prompt
    refs = ref_llm.generate(batch, greedy(6), use_tqdm=False)
    out = client.completions.create(model="m", prompt=batch, n=2, max_tokens=6, echo=True,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [
        ref_llm.tokenizer.decode(batch[c.index // 2]) + refs[c.index // 2].text
        for c in out.choices]
    for path, body in (("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "echo": True})):
        r = post(server, path, json.dumps(body))
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_chat_equals_generate_on_the_chat_template(server, ref_llm):
    messages = [{"role": "user", "content": "Tell me about Hanoi"}]
    ids = ref_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    [ref] = ref_llm.generate([ids], greedy(16), use_tqdm=False)
    client = server.client()
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=16,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 16
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=16,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


def test_chat_template_options_as_llm_chat(server, ref_llm):
    """vLLM's add_generation_prompt / continue_final_message / chat_template_kwargs: the server
    renders the messages as LLM.chat does."""
    messages = [{"role": "user", "content": "Tell me about Hanoi"},
                {"role": "assistant", "content": "Hanoi is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"unused": 1}}
    [ref] = ref_llm.chat(messages, greedy(8), use_tqdm=False, **options)
    out = server.client().chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, **options})
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert ref.prompt.endswith("Hanoi is")  # continued, not closed
    for extra, param in [({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs")]:
        body = {"model": "m", "messages": messages, **extra}
        r = post(server, "/v1/chat/completions", json.dumps(body))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_a_batch_of_prompts_is_each_prompts_completions(server, ref_llm):
    """vLLM's (and OpenAI's) batch: prompt i's completion j is choice i * n + j, the usage sums
    the prompts; streamed, the same texts; one prompt refused by the engine refuses the batch,
    and a disconnect aborts every prompt's request."""
    prompts = ["The quick brown fox", "Hello", "A"]
    refs = [o.text for o in ref_llm.generate(prompts, greedy(6), use_tqdm=False)]
    num_prompt = sum(len(ref_llm.tokenizer.encode(p)) for p in prompts)
    client = server.client()
    out = client.completions.create(model="m", prompt=prompts, n=2, max_tokens=6,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [(c.index, c.text) for c in out.choices] == [(i, refs[i // 2]) for i in range(6)]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (num_prompt, 36)
    texts = {}
    for chunk in client.completions.create(model="m", prompt=prompts, n=2, max_tokens=6,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: refs[i // 2] for i in range(6)}
    server.wait_idle()
    before = aborted(server)
    body = {**GOOD, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": MAX_MODEL_LEN - 10,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.base + "/v1/completions",
                                                 json=body) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(6))  # then leave
    server.wait_idle()
    assert aborted(server) == before + 2
    body = {**body, "prompt": [[5, 6, 7], [5, VOCAB_SIZE]], "stream": False}
    r = post(server, "/v1/completions", json.dumps(body))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    # The accepted prompt's request is aborted, not left running. (Its abort is counted once
    # the engine thread has stepped; the gauges may still show the idle server before it.)
    abort_metric = 'nanoserve:request_success_total{finished_reason="abort"}'
    server.wait_until(lambda m: m.get(abort_metric, 0) == before + 3)
    server.wait_idle()


def test_priority_orders_the_waiting_requests():
    """--scheduling-policy priority: a request's `priority` (vLLM's field, smaller first) orders
    the waiting queue (§6.1). One seat: A runs; B (priority 5) then C (-1) wait; C runs next."""
    flags = [*TINY_FLAGS, "--scheduling-policy", "priority", "--max-num-seqs", "1"]
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), flags)
    try:
        done: list[str] = []

        def send(name: str, priority: int, max_tokens: int) -> None:
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "priority": priority}
            r = httpx.post(s.base + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            done.append(name)

        threads = []
        # B and C long enough (200 steps) that the order their answers reach this process's
        # threads is the order the server finished them (with 4 tokens each, a late thread
        # once saw B's answer first)
        for name, priority, max_tokens, waiting in [("A", 0, 1500, 0), ("B", 5, 200, 1),
                                                    ("C", -1, 200, 2)]:
            threads.append(threading.Thread(target=send, args=(name, priority, max_tokens)))
            threads[-1].start()
            s.wait_until(lambda m, w=waiting: (m["nanoserve:num_requests_running"],
                                               m["nanoserve:num_requests_waiting"]) == (1, w))
        for t in threads:
            t.join(120)
        assert done == ["A", "C", "B"]
    finally:
        s.stop()


def test_models_health_metrics(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == ["m"]
    assert models[0].model_dump()["root"] == tiny_model_dir(MAX_MODEL_LEN)
    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/version").json() == {"version": version("nanoserve")}
    m = server.wait_idle()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_count",
                 "request_time_per_output_token_seconds_count"):
        assert "nanoserve:" + name in m
    assert m["nanoserve:time_to_first_token_seconds_count"] >= 1  # earlier tests' requests


def hf_logprobs(tokens: list[int]) -> torch.Tensor:
    """log-softmax of HF's fp32 logits of the server's model, at every position of `tokens`."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(MAX_MODEL_LEN), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def test_logprobs_through_the_client_are_hf_log_softmax(server, ref_llm):
    """Completions (logprobs=3) and chat (logprobs, top_logprobs=2), greedy fp32: each token's
    logprob is HF's, its top entries are HF's most likely tokens."""
    client, prompt = server.client(), [5, 17, 3, 250, 8, 41, 77]
    out = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    [ref] = ref_llm.generate([prompt], greedy(6), use_tqdm=False)
    expected = hf_logprobs(prompt + ref.token_ids)[len(prompt) - 1:-1]
    assert lp.tokens == [ref_llm.tokenizer.decode([t]) for t in ref.token_ids]
    for got, top, token, row in zip(lp.token_logprobs, lp.top_logprobs, ref.token_ids, expected):
        assert got == pytest.approx(float(row[token]), abs=2e-3)
        assert len(top) == 3  # greedy: the sampled token is the most likely one
        assert sorted(top.values(), reverse=True) == pytest.approx(
            row.topk(3).values.tolist(), abs=2e-3)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if c.choices[0].logprobs]
    # approx: without the fast-path plugin torch's GEMMs sum in an order that depends on the
    # team's size, which follows the cores this test process leaves (cpu_share.py)
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                            abs=1e-4)
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": "Hi"}]
    ids = ref_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    [ref] = ref_llm.generate([ids], greedy(4), use_tqdm=False)
    expected = hf_logprobs(ids + ref.token_ids)[len(ids) - 1:-1]
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for item, token, row in zip(content, ref.token_ids, expected):
        assert item.logprob == pytest.approx(float(row[token]), abs=2e-3)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            row.topk(2).values.tolist(), abs=2e-3)
        assert item.bytes == list(item.token.encode())
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_n_completions_through_the_client_share_the_prompt(server):
    """n=3 with a seed: three choices, indices 0..2, the prompt's full blocks computed once
    (children 1 and 2 hit them); streamed, each index ends with its finish_reason."""
    client = server.client()
    prompt = random.Random(7).choices(range(VOCAB_SIZE), k=40)  # unseen: two full blocks
    server.wait_idle()
    hits = server.metrics()["nanoserve:prefix_cache_hits_total"]
    out = client.completions.create(model="m", prompt=prompt, n=3, seed=5, temperature=1.0,
                                    max_tokens=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 15
    server.wait_idle()
    assert server.metrics()["nanoserve:prefix_cache_hits_total"] - hits == 2 * 2 * 16
    again = client.completions.create(model="m", prompt=prompt, n=3, seed=5, temperature=1.0,
                                      max_tokens=5, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    finished, texts = {}, {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(model="m", prompt=prompt, n=3, seed=5,
                                           temperature=1.0, max_tokens=5, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c.text for c in out.choices]
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                          n=2, max_tokens=3, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy


# -- bad input ------------------------------------------------------------------------------

GOOD = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
BAD = [  # (change to GOOD, status, param)
    ({"temperature": -0.5}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN + 1}, 400, "max_tokens"),
    ({"model": "gpt-17"}, 404, "model"),
    ({"n": 0}, 400, "n"),
    ({"top_p": 0}, 400, "top_p"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"prompt": [5, -1]}, 400, "prompt"),
    ({"prompt": [5, VOCAB_SIZE]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt"),
    ({"prompt": [[5, 6], [5, VOCAB_SIZE]]}, 400, "prompt"),  # one bad prompt of a batch
    ({"prompt": ["a"] * 129}, 400, "prompt"),  # a batch over MAX_PROMPTS
    ({"prompt": ["a"] * 3, "n": 43}, 400, "n"),  # 129 completions
    ({"prompt": None}, 400, "prompt"),
    ({"stop": [""]}, 400, "stop"),
    ({"seed": -2}, 400, "seed"),  # (-1 is none, as in vLLM)
    ({"priority": 1}, 400, "priority"),  # this server schedules fcfs
    ({"priority": "1"}, 400, "priority"),
    ({"truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, 400, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "3"}, 400, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize("change, status, param", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_request_names_the_field_and_server_keeps_serving(server, change, status, param):
    r = post(server, "/v1/completions", json.dumps({**GOOD, **change}))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    ok = post(server, "/v1/completions", json.dumps(GOOD))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_max_tokens_beyond_the_prompts_room_is_the_room(server):
    """vLLM's get_max_tokens: a prompt and max_tokens over max_model_len together is no error,
    the request gets the room left and finishes "length"; max_tokens alone over it is a 400."""
    prompt = [5] * (MAX_MODEL_LEN - 3)
    for max_tokens in (MAX_MODEL_LEN, 4):
        r = post(server, "/v1/completions", json.dumps(
            {**GOOD, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}))
        assert r.status_code == 200, r.text
        out = r.json()
        assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == \
            (3, "length")
    hi = [{"role": "user", "content": "hi"}]
    r = post(server, "/v1/chat/completions",
             json.dumps({"messages": hi, "max_completion_tokens": MAX_MODEL_LEN + 1}))
    assert (r.status_code, r.json()["error"]["param"]) == (400, "max_completion_tokens")


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b"", b'"prompt"'])
def test_malformed_body_is_a_400(server, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_oversized_body_is_a_413_with_or_without_content_length(server):
    big = json.dumps({**GOOD, "prompt": "x" * ((1 << 20) + 32 * MAX_MODEL_LEN)}).encode()
    for content in (big, iter([big[i:i + 65536] for i in range(0, len(big), 65536)])):
        r = httpx.post(server.base + "/v1/completions", content=content, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert post(server, "/v1/completions", json.dumps(GOOD)).status_code == 200


def test_bad_chat_requests(server):
    for body, param in [({"model": "m"}, "messages"),
                        ({"model": "m", "messages": "hi"}, "messages"),
                        ({"model": "m", "messages": [{"role": "user"}]}, "messages"),
                        ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 0}, "max_completion_tokens"),
                        ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 0}, "max_tokens"),
                        ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 10**9}, "max_completion_tokens"),
                        ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        r = post(server, "/v1/chat/completions", json.dumps(body))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert r.json()["error"]["message"].startswith(param), r.text  # the name sent, not ours


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server):
    """vLLM's: the last k tokens of each prompt; a text longer than the context may be sent."""
    client = server.client()
    prompt = list(range(100, 140))
    kept = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 5})
    alone = client.completions.create(model="m", prompt=prompt[-5:], max_tokens=4, temperature=0)
    assert kept.choices[0].text == alone.choices[0].text and kept.usage.prompt_tokens == 5
    long = client.completions.create(model="m", prompt="hello " * 4000, max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": 5})
    assert long.usage.prompt_tokens == 5
    whole = client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 40
    messages = [{"role": "user", "content": "Say something long enough."}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=3,
                                          temperature=0, extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4


def test_chat_max_completion_tokens_wins_over_max_tokens(server):
    """As vLLM: OpenAI deprecated max_tokens for chat; a client sending both means the new one."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "ignore_eos": True, "max_tokens": 2, "max_completion_tokens": 3}
    r = post(server, "/v1/chat/completions", json.dumps(body))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_vllm_bench_client_fields_are_accepted(server):
    body = {**GOOD, "repetition_penalty": 1.0, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "unknown_field": 3}
    r = post(server, "/v1/completions", json.dumps(body))
    events = [x for x in r.text.split("\n\n") if x]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] == 2


# -- disconnects ------------------------------------------------------------------------------


def aborted(server) -> float:
    return server.metrics().get('nanoserve:request_success_total{finished_reason="abort"}', 0)


def test_disconnect_mid_stream_aborts(server):
    before = aborted(server)
    body = {**GOOD, "max_tokens": MAX_MODEL_LEN - 10, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.base + "/v1/completions",
                                                 json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few events, then leave
        assert any(x.startswith("data: ") for x in got)
    server.wait_idle()
    assert aborted(server) == before + 1


def test_disconnect_mid_answer_aborts(server):
    before = aborted(server)
    body = {**GOOD, "max_tokens": MAX_MODEL_LEN - 10, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up before the answer
        httpx.post(server.base + "/v1/completions", json=body, timeout=0.5)
    server.wait_idle()
    assert aborted(server) == before + 1


# -- many clients at once -----------------------------------------------------------------


async def one_client(server, i: int, rng: random.Random, kind: str, job) -> tuple[str, object]:
    body = {"model": "m", "prompt": job[0], "max_tokens": job[1], "temperature": 0,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.sleep(rng.random() * 0.5)  # arrivals spread over time
        if kind == "bad":
            r = await c.post(server.base + "/v1/completions", json={**body, "temperature": -1})
            return kind, r.status_code
        if kind == "disconnect":
            leave_after = rng.randint(1, 8)
            async with c.stream("POST", server.base + "/v1/completions",
                                json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    leave_after -= line.startswith("data: ")
                    if leave_after == 0:
                        break
            return kind, r.status_code
        if i % 2:
            r = await c.post(server.base + "/v1/completions", json=body)
            return kind, (r.status_code, r.json()["choices"][0]["text"] if r.is_success else r.text)
        text = ""
        async with c.stream("POST", server.base + "/v1/completions",
                            json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return kind, (r.status_code, text)


def test_64_concurrent_clients(server, ref_llm):
    rng = random.Random(0)
    jobs = []
    for i in range(64):
        n = rng.randint(3, 120)
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(n)] if i % 3 else \
            " ".join(rng.choice(["hello", "world", "phở", "cà phê", "🍜", "serve"])
                     for _ in range(n // 3 + 1))
        jobs.append((prompt, rng.randint(1, 48)))
    kinds = ["good"] * 52 + ["disconnect"] * 6 + ["bad"] * 6
    rng.shuffle(kinds)
    want = {i: o.text for i, o in zip(range(64), ref_llm.generate(
        [j[0] for j in jobs], [greedy(j[1]) for j in jobs], use_tqdm=False))}

    async def round_() -> list:
        return await asyncio.wait_for(asyncio.gather(*(
            one_client(server, i, rng, kinds[i], jobs[i]) for i in range(64))), 300)

    rss = []
    for _ in range(3):
        results = asyncio.run(round_())
        for i, (kind, res) in enumerate(results):
            if kind == "good":
                assert res == (200, want[i]), (i, res, want[i])
            elif kind == "bad":
                assert res == 400
            else:
                assert res == 200
        server.wait_idle()
        rss.append(server.rss_mib())
    assert rss[2] - rss[0] < 64, rss  # flat: the second and third rounds allocate nothing new


# -- the bundled model: real text ---------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_server():
    s = ServerProcess(default_model_dir(), ["--dtype", "float32", "--max-model-len", "512"])
    yield s
    s.stop()


def test_the_readmes_client_example_runs(bundled_server):
    """The README's "Serve it" snippet, as written, against the bundled model served here (only
    the port and the served name changed): it cannot drift from what the server answers."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    serve = readme[readme.index("## Serve it"):]
    snippet = serve[serve.index("```python\n") + 10:serve.index("```\n", serve.index("```python"))]
    assert "client.responses.create" in snippet and "completions.create" in snippet
    printed: list[tuple] = []
    names = {"print": lambda *args: printed.append(args)}
    exec(snippet.replace("http://127.0.0.1:8000/v1", bundled_server.base + "/v1")
         .replace('"SmolLM2-135M-Instruct"', '"m"'), names)
    c, r = names["c"], names["r"]
    assert printed == [(c.choices[0].text, r.output_text)]
    assert 1 <= c.usage.completion_tokens <= 32 and 1 <= r.usage.output_tokens <= 32
    assert r.output[0].content[0].text == r.output_text and r.status in ("completed",
                                                                        "incomplete")


@pytest.mark.slow
@pytest.mark.parametrize("content", ["Viết một câu chào bằng tiếng Việt có dấu.",
                                     "Reply with three emoji about food 🍜🍕"])
def test_stream_emoji_and_vietnamese_without_fffd(bundled_server, content):
    client, messages = bundled_server.client(), [{"role": "user", "content": content}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=40,
                                           temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=40,
                                                 temperature=0, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == whole
    # Only a character cut by max_tokens may end the answer as U+FFFD (as generate()'s text).
    assert all("\ufffd" not in p for p in pieces[:-1]) and "\ufffd" not in pieces[-1][:-1]
    assert not pieces[-1].endswith("\ufffd") or chunks[-1].choices[0].finish_reason == "length"
    assert any(ord(ch) > 127 for ch in whole)  # the answer has non-ASCII characters


@pytest.mark.slow
def test_stop_string_never_leaks_into_the_stream(bundled_server):
    client, prompt = bundled_server.client(), "The three primary colors are"
    whole = client.completions.create(model="m", prompt=prompt, max_tokens=40,
                                      temperature=0).choices[0].text
    tok = AutoTokenizer.from_pretrained(default_model_dir())  # where the tokens split
    ids = tok.encode(whole)
    ends = [len(tok.decode(ids[:k + 1])) for k in range(len(ids))]
    b = next(e for e in ends[2:] if 2 <= e <= len(whole) - 2 and whole[e - 2:e + 2].strip()
             and whole.find(whole[e - 2:e + 2]) == e - 2)
    stop = whole[b - 2:b + 2]  # two characters of one token, two of the next
    sent = ""
    for c in client.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0,
                                       stop=[stop], stream=True):
        sent += c.choices[0].text
        assert whole[:b - 2].startswith(sent)
        last = c.choices[0]
    assert sent == whole[:b - 2] and last.finish_reason == "stop"
    assert last.model_dump()["stop_reason"] == stop
    bundled_server.wait_idle()


# -- API key and shutdown -------------------------------------------------------------------


def test_api_key_sigterm_and_trace_file(tmp_path):
    """401 without the key; SIGTERM lets the in-flight request finish, then exit 0; the served
    steps are in --trace-file, which scripts/reader/trace_page.py reads."""
    trace = tmp_path / "served.jsonl"
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN),
                      [*TINY_FLAGS, "--api-key", "sesame", "--trace-file", str(trace)])
    try:
        for key in ("wrong", None, "sesam", "sesame2", "xsesame", "sesame sesame"):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            r = post(s, "/v1/completions", json.dumps(GOOD), headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
            assert httpx.get(s.base + "/v1/models", headers=headers).status_code == 401
            assert post(s, "/tokenize", '{"prompt": "hi"}', headers).status_code == 401
        # (the scheme in any case: "bearer sesame" opens it, as in vLLM: test_launch_flags.py)
        for header in ("sesame", "Bearer  sesame", "Basic sesame", "Bearer sesame,x"):
            r = post(s, "/v1/completions", json.dumps(GOOD), {"authorization": header})
            assert r.status_code == 401, header
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model="m", prompt="hi")
        client = s.client(api_key="sesame")
        assert client.models.list().data[0].id == "m"
        assert post(s, "/detokenize", '{"tokens": [5]}',
                    {"authorization": "Bearer sesame"}).status_code == 200
        stream = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=300,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        s.proc.send_signal(signal.SIGTERM)  # in flight: it must still finish
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(bool(c.choices[0].text) for c in chunks) >= 1
        assert s.proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(s.base + "/health", timeout=2)
    finally:
        s.stop()
    [run] = read_runs(trace)
    assert run["header"]["source"] == "serve" and len(run["steps"]) >= 300
    assert [f["reason"] for st in run["steps"] for f in st["finished"]] == ["length"]
    assert all(a["t_s"] <= b["t_s"] for a, b in zip(run["steps"], run["steps"][1:]))
    assert "__TRACE_DATA__" not in build_page([run], "served")


def test_chat_template_flag_renders_every_chat(tmp_path):
    """--chat-template (vLLM's): a template, or a file holding one, in place of the model's, for
    chat and /tokenize alike; one that cannot render a message, or a path that is no file,
    stops the start with why. vLLM's no-op flags (--disable-log-requests, ...) are accepted."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir(MAX_MODEL_LEN))
    assert chat_template(template, tokenizer) == chat_template(str(tmp_path / "t.jinja"),
                                                               tokenizer) == template
    with pytest.raises(ValueError, match="--chat-template no/such/template.jinja: no such file"):
        chat_template("no/such/template.jinja", tokenizer)
    messages = [{"role": "user", "content": "Hi"}]
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN),
                      [*TINY_FLAGS, "--chat-template", str(tmp_path / "t.jinja"),
                       "--disable-log-requests", "--trust-remote-code", "--disable-log-stats"])
    try:
        r = post(s, "/tokenize", json.dumps({"messages": messages}))
        assert r.json()["tokens"] == tokenizer.encode("<user>Hi", add_special_tokens=False)
        out = s.client().chat.completions.create(model="m", messages=messages, max_tokens=1)
        assert out.usage.prompt_tokens == r.json()["count"]
    finally:
        assert s.stop() == 0
    with pytest.raises(RuntimeError, match="--chat-template does not render a message"):
        ServerProcess(tiny_model_dir(MAX_MODEL_LEN), [*TINY_FLAGS, "--chat-template", "{% if %}"])


def test_prompt_tokens_details_and_cors_flags(server):
    """--enable-prompt-tokens-details: usage's cached_tokens, the prefix cache's hit (vLLM's);
    --allowed-origins: CORS for those origins only. Without the flags (the module's server):
    neither."""
    prompt = list(range(5, 45))  # 40 tokens: 2 full blocks of 16 cached on the second time
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    origin = {"origin": "http://ui.example"}
    r = httpx.post(server.base + "/v1/completions", json=body, headers=origin, timeout=30)
    assert "prompt_tokens_details" not in r.json()["usage"]
    assert "access-control-allow-origin" not in r.headers
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), [
        *TINY_FLAGS, "--enable-prompt-tokens-details", "--allowed-origins",
        '["http://ui.example"]'])
    try:
        cached = [s.client().completions.create(**body).usage.prompt_tokens_details.cached_tokens
                  for _ in range(2)]
        assert cached == [0, 32]
        usages = [list(s.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi there " * 20}], max_tokens=2,
            stream=True, stream_options={"include_usage": True}))[-1].usage for _ in range(2)]
        assert [u.prompt_tokens_details.cached_tokens for u in usages] == \
            [0, (usages[1].prompt_tokens - 1) // 16 * 16] and usages[1].prompt_tokens > 17
        preflight = httpx.options(s.base + "/v1/completions", timeout=30, headers={
            **origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
        r = httpx.post(s.base + "/v1/completions", json=body, headers=origin, timeout=30)
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=30,
                       headers={"origin": "http://elsewhere.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        assert s.stop() == 0


def test_every_engine_setting_is_a_flag_of_its_name():
    """vLLM's flags reach EngineConfig under their own names (--gpu-memory-utilization was
    missing once); the settings that are not flags are named here."""
    not_flags = {"usage_context", "torch_compile", "trace", "skip_tokenizer_init",
                 "enable_fast_paths"}  # (--no-fast-paths)
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - not_flags
    assert fields <= set(vars(parse_args([])))
    args = parse_args(["--gpu-memory-utilization", "0.5", "--max-num-seqs", "4", "--no-fast-paths",
                       "--no-enable-prefix-caching", "--trace-file", "t.jsonl"])
    assert engine_config(args) == {"gpu_memory_utilization": 0.5, "max_num_seqs": 4,
                                   "enable_prefix_caching": False, "usage_context": "server",
                                   "enable_fast_paths": False}
    EngineConfig(**engine_config(args))  # each one EngineConfig takes
    # the model: positional (vllm serve's) or --model (vLLM's api_server module's)
    assert parse_args(["--model", "d"]).model == parse_args(["d"]).model == "d"


def test_console_script_help():
    exe = Path(sys.executable).with_name("nanoserve")
    out = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True,
                         timeout=120, env={**os.environ})
    assert out.returncode == 0 and "--max-num-seqs" in out.stdout and "--api-key" in out.stdout
