"""vLLM's request fields, none of them ignored: `return_token_ids` (the prompt's
and the answer's ids beside the text, whole or streamed: the ids `LLM.generate` gives),
`return_tokens_as_token_ids` (logprobs' tokens as "token_id:N"), `add_special_tokens` (passed
to the tokenizer), `truncation_side`, `request_id`, chat's `reasoning_effort` (to the template),
`X-Request-Id` (in and out); and every field nanoserve cannot honour is a 400 naming it at any
value but its no-op ones."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from nanoserve import SamplingParams
from nanoserve.entrypoints.body_checker import ENDPOINTS
from nanoserve.entrypoints.cli_args import ServingOptions
from nanoserve.entrypoints.protocol import APIError, ResponsesRequest
from nanoserve.entrypoints.request_prompts import responses_prompt
from nanoserve.entrypoints.serving_chat import OpenAIServingChat
from nanoserve.entrypoints.serving_completion import OpenAIServingCompletion
from nanoserve.entrypoints.validation import check_no_ops
from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, TINY_FLAGS, ServerProcess

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def server():
    """The tiny model's server (conftest's), with vLLM's --enable-request-id-headers."""
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), [*TINY_FLAGS, "--enable-request-id-headers"])
    yield s
    s.stop()
MESSAGES = [{"role": "user", "content": "Xin chào!"}]


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.base + path, json={"model": "m", "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.base + path, timeout=60,
                      json={"model": "m", "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def greedy(ref_llm, prompt: list[int], n: int) -> list[int]:
    [out] = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                      ignore_eos=True), use_tqdm=False)
    return out.outputs[0].token_ids


def test_a_completions_token_ids_are_llm_generates_whole_and_streamed(server, ref_llm):
    want = greedy(ref_llm, PROMPT, 6)
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    [choice] = post(server, "/v1/completions", body)["choices"]
    assert choice["prompt_token_ids"] == PROMPT and choice["token_ids"] == want
    [echoed] = post(server, "/v1/completions", {**body, "echo": True})["choices"]
    assert echoed["token_ids"] == PROMPT + want  # (vLLM's: the echoed prompt's ids first)
    chunks = [c["choices"][0] for c in stream(server, "/v1/completions", body)]
    assert [c["prompt_token_ids"] for c in chunks] == [PROMPT] + [None] * (len(chunks) - 1)
    assert sum((c["token_ids"] for c in chunks), []) == want
    plain = post(server, "/v1/completions", {**body, "return_token_ids": None})["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_a_chats_token_ids_are_its_prompts_and_llm_generates(server, ref_llm):
    prompt = ref_llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
    want = greedy(ref_llm, prompt, 5)
    body = {"messages": MESSAGES, "max_tokens": 5, "ignore_eos": True, "n": 2,
            "return_token_ids": True}
    out = post(server, "/v1/chat/completions", body)
    assert out["prompt_token_ids"] == prompt
    assert [c["token_ids"] for c in out["choices"]] == [want, want]
    chunks = stream(server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    for i in range(2):
        assert sum((c["choices"][0].get("token_ids", []) for c in chunks
                    if c["choices"] and c["choices"][0]["index"] == i), []) == want
    assert "prompt_token_ids" not in post(server, "/v1/chat/completions", {
        **body, "return_token_ids": False})


def test_return_tokens_as_token_ids_names_each_logprobs_token_by_its_id(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "logprobs": 2,
            "return_token_ids": True}
    plain = post(server, "/v1/completions", body)["choices"][0]
    as_ids = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    logprobs = as_ids["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in plain["token_ids"]]
    assert logprobs["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert logprobs["text_offset"] == plain["logprobs"]["text_offset"]  # the text's
    assert all(len(top) == len(before) and all(k.startswith("token_id:") for k in top)
               for top, before in zip(logprobs["top_logprobs"],
                                      plain["logprobs"]["top_logprobs"]))
    chat = post(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "logprobs": True,
        "top_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True})
    [choice] = chat["choices"]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    assert tokens == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["logprobs"]["content"][0]["bytes"] == list(tokens[0].encode())


@pytest.mark.parametrize("side, kept", [(None, PROMPT[-3:]), ("left", PROMPT[-3:]),
                                        ("right", PROMPT[:3])])
def test_truncation_side_says_which_end_of_the_prompt_is_kept(server, side, kept):
    body = {"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": 3,
            "truncation_side": side, "return_token_ids": True}
    out = post(server, "/v1/completions", body)
    assert out["choices"][0]["prompt_token_ids"] == kept and out["usage"]["prompt_tokens"] == 3


def test_request_id_is_the_answers_id(server):
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                            "request_id": "abc-1"})["id"] == "cmpl-abc-1"
    assert post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                 "request_id": "x"})["id"] == "chatcmpl-x"
    assert post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 1,
                                          "request_id": "resp_7"})["id"] == "resp_7"
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})[
        "id"].startswith("cmpl-")


def test_x_request_id_names_the_request_and_comes_back(server):
    """vLLM's: the header over the body's request_id; with --enable-request-id-headers every
    answer says X-Request-Id, streamed ones and errors too (a new one where none was sent)."""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "request_id": "body"}
    r = httpx.post(server.base + "/v1/completions", json=body, headers={"X-Request-Id": "hdr"})
    assert r.json()["id"] == "cmpl-hdr" and r.headers["x-request-id"] == "hdr"
    with httpx.stream("POST", server.base + "/v1/chat/completions", headers={
            "X-Request-Id": "s1"}, json={"model": "m", "messages": MESSAGES, "max_tokens": 2,
                                         "stream": True}) as r:
        assert r.headers["x-request-id"] == "s1"
        assert json.loads(next(r.iter_lines())[len("data: "):])["id"] == "chatcmpl-s1"
    bad = httpx.post(server.base + "/v1/completions", json={**body, "max_tokens": 0})
    assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32
    assert httpx.get(server.base + "/health").headers["x-request-id"]
    long = httpx.post(server.base + "/v1/completions", json=body,
                      headers={"X-Request-Id": "x" * 257})  # (each chunk would repeat it)
    assert long.status_code == 400 and long.json()["error"]["param"] == "request_id"


def test_add_special_tokens_is_the_tokenizers_option():
    """With a tokenizer that adds a BOS (Llama's do; the bundled one does not): a completion's
    text gets it by default, a chat's rendered text only when asked for (vLLM's defaults)."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir(MAX_MODEL_LEN))
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    text = tokenizer.encode("hello", add_special_tokens=False)
    assert tokenizer.encode("hello") == [bos, *text]  # the BOS-adding tokenizer

    def completion(**body):
        req = OpenAIServingCompletion.endpoint.request_model(prompt="hello", **body)
        return OpenAIServingCompletion.tokenize(None, tokenizer, "hello", req)

    assert completion() == completion(add_special_tokens=True) == [bos, *text]
    assert completion(add_special_tokens=False) == text

    serving = OpenAIServingChat.__new__(OpenAIServingChat)  # (no engine: only its options)
    serving.options = ServingOptions()

    def chat(**body):
        req = OpenAIServingChat.endpoint.request_model(messages=MESSAGES, **body)
        [prompt] = OpenAIServingChat.endpoint.prompts_of(req)
        return serving.tokenize(tokenizer, prompt, req)

    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat() == tokenizer.encode(rendered, add_special_tokens=False)
    assert chat(add_special_tokens=True) == [bos, *chat()]


def test_skip_special_tokens_reaches_the_engine():
    """vLLM's field (true by default): a request's False reaches its SamplingParams, whose
    detokenizer then keeps <|im_end|> and the like (tests/core/test_detokenizer.py)."""
    from nanoserve.entrypoints.generation_config import request_params
    from nanoserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

    for req in (CompletionRequest(prompt="hi", skip_special_tokens=False),
                ChatCompletionRequest(messages=MESSAGES, skip_special_tokens=False)):
        assert request_params(req, {}, 4, None).skip_special_tokens is False
    assert request_params(CompletionRequest(prompt="hi"), {}, 4, None).skip_special_tokens


def test_responses_pass_chat_template_kwargs_to_the_template():
    req = ResponsesRequest(input="hi", chat_template_kwargs={"enable_thinking": False})
    assert responses_prompt(req)[0]["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.prompt_field)
def test_each_field_nanoserve_cannot_honour_is_refused_but_at_its_no_op_values(endpoint):
    for name, allowed in endpoint.no_op.items():
        for value in allowed:
            check_no_ops({name: value}, endpoint.no_op)
        for value in ("x", 12345, True, [1], {"a": 1}):
            if any(value == a and type(value) is type(a) for a in allowed):
                continue
            with pytest.raises(APIError) as e:
                check_no_ops({name: value}, endpoint.no_op)
            assert e.value.param == name and name in e.value.message


@pytest.mark.parametrize("effort, kwargs, seen", [
    (None, None, "-|-"), ("none", None, "False|none"), ("high", None, "True|high"),
    ("low", {"enable_thinking": False}, "False|low"),
    ("high", {"reasoning_effort": "low"}, "True|high")])
def test_reasoning_effort_reaches_the_chat_template(effort, kwargs, seen):
    """vLLM's: the template's reasoning_effort (over the request's kwargs), and enable_thinking
    unless the request's kwargs set it ("none": off)."""
    from nanoserve.entrypoints.prompts import chat_prompts
    from nanoserve.entrypoints.protocol import ChatCompletionRequest
    from nanoserve.entrypoints.request_prompts import chat_prompt

    req = ChatCompletionRequest(messages=MESSAGES, reasoning_effort=effort,
                                chat_template_kwargs=kwargs)
    [prompt] = chat_prompt(req)
    template = ("{{ enable_thinking if enable_thinking is defined else '-' }}|"
                "{{ reasoning_effort if reasoning_effort is defined else '-' }}")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir(MAX_MODEL_LEN))
    [rendered] = chat_prompts(tokenizer=tokenizer, chat_template=template, **prompt)
    assert rendered["prompt"] == seen


def test_a_beam_searchs_choices_carry_their_token_ids(server, ref_llm):
    out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 2,
                                           "use_beam_search": True, "return_token_ids": True})
    for choice in out["choices"]:
        assert choice["prompt_token_ids"] == PROMPT and 1 <= len(choice["token_ids"]) <= 4
        assert ref_llm.tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == \
            choice["text"]
