"""POST /tokenize and /detokenize (vLLM's): the ids are the ones the generation endpoints give
the engine (a completion's text, a chat's rendered conversation, counted in their usage), ids
come back as the tokenizer's text, and bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from nanoserve import SamplingParams
from tests.server.harness import MAX_MODEL_LEN

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Xin chào!"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=30)


def test_a_prompt_is_the_tokenizers_ids_and_the_completions_prompt_tokens(server, ref_llm):
    text = "The quick brown fox, Tiếng Việt 🦊"
    r = post(server, "/tokenize", {"model": "m", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = ref_llm.tokenizer.encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                        "token_strs": ref_llm.tokenizer.convert_ids_to_tokens(ids)}
    usage = server.client().completions.create(model="m", prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == len(ids)
    plain = post(server, "/tokenize", {"prompt": text}).json()
    assert plain["tokens"] == ids and plain["token_strs"] is None


@pytest.mark.parametrize("options", [{}, {"add_generation_prompt": False},
                                     {"add_generation_prompt": False,
                                      "continue_final_message": True}])
def test_messages_are_llm_chats_prompt_and_the_chats_prompt_tokens(server, ref_llm, options):
    messages = MESSAGES + ([{"role": "assistant", "content": "Chào"}]
                           if options.get("continue_final_message") else [])
    r = post(server, "/tokenize", {"messages": messages, **options})
    assert r.status_code == 200, r.text
    [out] = ref_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, **options)
    assert r.json()["tokens"] == out.prompt_token_ids
    usage = server.client().chat.completions.create(model="m", messages=messages, max_tokens=1,
                                                    extra_body=options).usage
    assert usage.prompt_tokens == r.json()["count"]


def test_add_special_tokens_as_asked(server, ref_llm):
    tok = ref_llm.tokenizer
    chat = post(server, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True}).json()
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=True)
    plain = post(server, "/tokenize", {"prompt": "hi", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("hi", add_special_tokens=False)


def test_detokenize_is_the_tokenizers_decode(server, ref_llm):
    tok = ref_llm.tokenizer
    ids = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    r = post(server, "/detokenize", {"model": "m", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tok.decode(ids)}
    assert "<|im_start|>" in r.json()["prompt"]  # special tokens are text too (vLLM's)
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, 400, "return_token_strs"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True,
                   "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
])
def test_bad_input_names_the_field(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert post(server, "/tokenize", {"prompt": "still here"}).status_code == 200


def test_a_text_longer_than_the_context_is_counted(server, ref_llm):
    """Counting is what /tokenize is for: no max_model_len bound (vLLM's), unlike a prompt."""
    text = "hello world " * 1200
    r = post(server, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(ref_llm.tokenizer.encode(text)) > MAX_MODEL_LEN
