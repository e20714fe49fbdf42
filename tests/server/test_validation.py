"""Malformed and unsupported input to the server (nanoserve/entrypoints/validation.py): each a
400 JSON error naming the field, never a 500 or silence; the server keeps serving. Also the caps
that keep one request from slowing the others (stop strings, a prompt's length bound)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from transformers import AutoTokenizer

from nanoserve.entrypoints.validation import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    fewest_tokens,
    longest_token,
)
from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, post

GOOD = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BAD = [  # (path, raw JSON body, param)
    ("/v1/completions", '{"model": "m", "prompt": [5], "x": ' + nested(40) + "}", "x"),
    ("/v1/completions", '{"model": "m", "prompt": ' + nested(100_000) + "}", None),
    ("/v1/completions", '{"model": "m", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "m\\udfff", "prompt": "a"}', "model"),
    ("/v1/completions", '{"model": "m", "prompt": "a", "\\ud800": 1}', None),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": '
                             '"\\ud83d"}]}', "messages"),
]
BAD_FIELDS = [  # (change to GOOD, param)
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": "3"}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"), ({"temperature": True}, "temperature"),
    ({"temperature": "0"}, "temperature"), ({"seed": False}, "seed"), ({"n": "1"}, "n"),
    ({"prompt": [True]}, "prompt"), ({"prompt": [1.0, 2.0]}, "prompt"),
    ({"prompt": [[5, True]]}, "prompt"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"stream": "yes"}, "stream"), ({"stop": 5}, "stop"), ({"logprobs": True}, "logprobs"),
    ({"logit_bias": {"5": 100}}, "logit_bias"), ({"min_tokens": 3}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"), ({"min_p": 0.1}, "min_p"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["x" * (MAX_STOP_CHARS // 2 + 1)] * 2}, "stop"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"stream": False, "stream_options": {"continuous_usage_stats": False}}, "stream_options"),
]
BAD_CHAT = [  # (change to CHAT, param)
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto"
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"max_completion_tokens": "2"}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


def assert_400(r: httpx.Response, param: str | None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and err["message"], err


@pytest.mark.parametrize("path, body, param", BAD, ids=[str(b[2]) for b in BAD])
def test_malformed_json_is_a_400_naming_the_field(server, path, body, param):
    assert_400(post(server, path, body.encode()), param)
    assert post(server, "/v1/completions", json.dumps(GOOD)).status_code == 200


@pytest.mark.parametrize("change, param", BAD_FIELDS, ids=[str(b[0])[:30] for b in BAD_FIELDS])
def test_wrong_types_and_unsupported_fields_are_a_400(server, change, param):
    assert_400(post(server, "/v1/completions", json.dumps({**GOOD, **change})), param)


@pytest.mark.parametrize("change, param", BAD_CHAT, ids=[str(b[0])[:30] for b in BAD_CHAT])
def test_chat_unsupported_fields_are_a_400(server, change, param):
    assert_400(post(server, "/v1/chat/completions", json.dumps({**CHAT, **change})), param)


def test_no_op_values_of_unsupported_fields_are_accepted(server):
    for change in ({"logit_bias": None}, {"logit_bias": {}}, {"min_tokens": 0},
                   {"response_format": {"type": "text"}}, {"min_p": 0.0}, {"best_of": 1},
                   {"stop": ["a"] * MAX_STOP_STRINGS}, {"temperature": 1},
                   {"stream_options": None}, {"stream_options": {}},  # vLLM's: falsy passes
                   {"repetition_penalty": 1.0, "presence_penalty": 0, "frequency_penalty": 0.0}):
        r = post(server, "/v1/completions", json.dumps({**GOOD, **change}))
        assert r.status_code == 200, (change, r.text)
    for change in ({"tools": None}, {"tool_choice": "none"}, {"tool_choice": None}):
        r = post(server, "/v1/chat/completions", json.dumps({**CHAT, **change}))
        assert r.status_code == 200, (change, r.text)


def test_vllms_nulls_and_spellings_of_none_are_accepted(server):
    """vLLM 0.32's protocol: stream, echo and chat's logprobs may be null (false); a
    completion's max_tokens null is its default 16; top_k 0 and seed -1 are none; chat's
    top_logprobs 0 without logprobs asks for nothing."""
    for change in ({"stream": None}, {"echo": None}, {"top_k": 0}, {"top_k": -1},
                   {"seed": -1, "temperature": 1.0}):
        r = post(server, "/v1/completions", json.dumps({**GOOD, **change}))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, change
    r = post(server, "/v1/completions",
             json.dumps({**GOOD, "max_tokens": None, "ignore_eos": True}))
    assert r.json()["usage"]["completion_tokens"] == 16, r.text
    for change in ({"logprobs": None}, {"stream": None}, {"top_logprobs": 0}):
        r = post(server, "/v1/chat/completions", json.dumps({**CHAT, **change}))
        assert r.status_code == 200, (change, r.text)
        assert r.json()["choices"][0]["logprobs"] is None


def test_assistant_tool_calls_without_content_are_accepted(server):
    messages = [{"role": "user", "content": "add 1 and 2"},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = post(server, "/v1/chat/completions", json.dumps({**CHAT, "messages": messages}))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_logprobs_0_gives_the_sampled_tokens_logprob(server):
    """vLLM: logprobs 0 is each token's own logprob (and it alone in top_logprobs)."""
    r = post(server, "/v1/completions", json.dumps({**GOOD, "logprobs": 0}))
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 2
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert [list(t.values()) for t in lp["top_logprobs"]] == [[x] for x in lp["token_logprobs"]]
    r = post(server, "/v1/chat/completions", json.dumps({**CHAT, "logprobs": True,
                                                        "top_logprobs": 0}))
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(c["top_logprobs"] == [] for c in content)


def test_a_text_too_long_for_the_context_is_rejected_before_tokenizing(server):
    """Its length alone proves it has too many tokens: a 400 in milliseconds, not seconds."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir(MAX_MODEL_LEN))
    longest = longest_token(tok)
    start = time.monotonic()
    text = "x" * MAX_MODEL_LEN * longest
    r = post(server, "/v1/completions", json.dumps({**GOOD, "prompt": text}))
    assert_400(r, "prompt")
    assert "characters" in r.json()["error"]["message"] and time.monotonic() - start < 5
    r = post(server, "/v1/chat/completions", json.dumps(
        {**CHAT, "messages": [{"role": "user", "content": text}]}))
    assert_400(r, "messages")


def test_the_length_bound_is_sound():
    """The text of the longest token repeated k times is k tokens: the bound says >= k. Other
    texts have at least as many tokens as it says."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir(MAX_MODEL_LEN))
    longest = longest_token(tok)
    entries = tok.convert_ids_to_tokens(list(range(len(tok))))
    word = tok.convert_tokens_to_string([next(e for e in entries if len(e) == longest)])
    for k in (1, 7, 100):
        ids = tok.encode(word * k)
        assert fewest_tokens(len(word * k), longest) <= len(ids)
    for text in ["Xin chào! Hà Nội có gì đẹp? 🍜🍕", "a" * 5000, " " * 3000, "\n" * 999,
                 "".join(map(chr, range(32, 3000)))]:
        assert fewest_tokens(len(text), longest) <= len(tok.encode(text)), text[:20]
