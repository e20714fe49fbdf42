"""A thinking model's reasoning (vLLM's --reasoning-parser; entrypoints/reasoning_parser.py):
- the parser without a model: the same split however the text is cut into pieces, a tag's start
  held back until known, an unclosed reasoning all reasoning, qwen3 told not to think all content,
  the reasoning's tokens counted up to the </think> token;
- served, on the bundled model shown two answers that think first (it copies them): chat's
  `reasoning` beside its `content`, whole and streamed through the real `openai` client, with
  usage's reasoning_tokens; include_reasoning false leaves it out; the Responses API's reasoning
  item before its message, whole and as events; qwen3's enable_thinking false reads none."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from nanoserve.entrypoints.bundled import default_model_dir
from nanoserve.entrypoints.reasoning_parser import ReasoningParser, reasoning_parser_for
from tests.server.harness import ServerProcess, post


def fed(parser: ReasoningParser, text: str, size: int) -> tuple[str, str]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    got = [parser.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(r for r, _ in got), "".join(c for _, c in got)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text, split", [
    ("<think>\nsix.\n</think>\n\nSix.", ("\nsix.\n", "\n\nSix.")),
    ("six </th", ("six </th", "")),  # never closed: all reasoning, the tag's start text after all
    ("a <think>b</think>c</think>", ("a b", "c</think>")),  # the answer is taken as written
    ("</think>x <thi", ("", "x <thi")),
    ("", ("", ""))])
def test_the_split_is_the_same_however_the_text_is_cut(size, text, split):
    parser = ReasoningParser()
    assert fed(parser, text, size) == split
    assert parser.whole() == (split[0] or None, split[1])


def test_a_tags_start_is_held_back_until_known():
    parser = ReasoningParser()
    assert parser.feed("ab</thi") == ("ab", "")
    assert parser.feed("nk>c") == ("", "c")
    parser = ReasoningParser()
    assert parser.feed("x<") == ("x", "") and parser.feed("y") == ("<y", "")


def test_reasoning_tokens_count_up_to_the_end_token():
    parser = ReasoningParser(end_id=9)
    parser.feed("a", token_ids=[1])
    parser.feed("b</think>c", token_ids=[2, 9, 3])  # the </think> token and those before it
    parser.feed("d", token_ids=[4])
    assert parser.num_tokens == 3
    plain = ReasoningParser()  # no such token: the pieces that came while reasoning
    for text, ids in (("a", [1]), ("</th", [2]), ("ink>", [3]), ("c", [4])):
        plain.feed(text, token_ids=ids)
    assert plain.num_tokens == 3 and plain.whole() == ("a", "c")


def test_qwen3_told_not_to_think_reads_no_reasoning():
    text = "<think>x</think>y"
    assert fed(reasoning_parser_for("qwen3", {"enable_thinking": False}, None)(), text, 4) == (
        "", text)
    assert fed(reasoning_parser_for("qwen3", None, None)(), text, 4) == ("x", "y")
    assert fed(reasoning_parser_for("deepseek_r1", {"enable_thinking": False}, None)(), text,
               4) == ("x", "y")
    assert reasoning_parser_for(None, None, None) is None


# -- served --------------------------------------------------------------------------------------

# two answers that think first, which the small model copies
SHOTS = [("What is 2+2?", "<think>\nTwo plus two makes four.\n</think>\n\nThe answer is 4."),
         ("What color is the sky?",
          "<think>\nOn a clear day the sky looks blue.\n</think>\n\nThe sky is blue.")]
MESSAGES = [m for q, a in SHOTS for m in ({"role": "user", "content": q},
                                          {"role": "assistant", "content": a})]
QUESTION = MESSAGES + [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def thinking_server():
    s = ServerProcess(default_model_dir(), ["--dtype", "float32", "--max-model-len", "1024",
                                            "--reasoning-parser", "deepseek_r1"])
    yield s
    assert s.stop() == 0


def raw_split(tokenizer, ids: list[int]) -> tuple[str, str, int]:
    """The answer's text split at its </think>, and the tokens up to the one that completed it."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    reasoning, _, content = text.partition("</think>")
    k = next(k for k in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:k]))
    return reasoning.removeprefix("<think>"), content, k


def test_chat_reads_the_reasoning_apart(thinking_server, tokenizer):
    client = thinking_server.client()
    out = client.chat.completions.create(model="m", messages=QUESTION, temperature=0,
                                         max_tokens=40, extra_body={"return_token_ids": True})
    [choice] = out.choices
    reasoning, content, k = raw_split(tokenizer, choice.model_extra["token_ids"])
    assert reasoning.strip() and content.strip()  # the model thought, then answered
    assert (choice.message.model_extra["reasoning"], choice.message.content) == (
        reasoning, content)
    assert out.usage.completion_tokens_details.reasoning_tokens == k
    assert k < out.usage.completion_tokens
    streamed = list(client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert streamed[-1].usage.completion_tokens_details.reasoning_tokens == k


def test_include_reasoning_false_leaves_it_out(thinking_server):
    body = {"model": "m", "messages": QUESTION, "temperature": 0, "max_tokens": 40,
            "include_reasoning": False, "logprobs": True}
    whole = post(thinking_server, "/v1/chat/completions", json.dumps(body)).json()["choices"][0]
    assert whole["message"]["reasoning"] is None and whole["message"]["content"].strip()
    assert whole["logprobs"] is None  # (its tokens' text would show it)
    shown = post(thinking_server, "/v1/chat/completions",
                 json.dumps({**body, "include_reasoning": True})).json()["choices"][0]
    assert shown["message"]["content"] == whole["message"]["content"]
    assert shown["message"]["reasoning"] and shown["logprobs"]["content"]


def test_an_answer_that_does_not_think_is_all_reasoning(thinking_server):
    """As vLLM's deepseek_r1: without a </think> the text is taken as reasoning never closed."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
            "max_tokens": 12}
    message = post(thinking_server, "/v1/chat/completions",
                   json.dumps(body)).json()["choices"][0]["message"]
    assert message["reasoning"] and message["content"] is None


def test_responses_put_the_reasoning_item_first(thinking_server, tokenizer):
    client = thinking_server.client()
    whole = client.responses.create(model="m", input=QUESTION, temperature=0,
                                    max_output_tokens=40)
    reasoning_item, message = whole.output
    assert reasoning_item.type == "reasoning" and message.type == "message"
    [part] = reasoning_item.content
    assert part.text.strip() and whole.output_text.strip()
    assert not part.text.startswith("<think>") and "</think>" not in whole.output_text
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    with client.responses.stream(model="m", input=QUESTION, temperature=0,
                                 max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.delta") < kinds.index(
        "response.reasoning_text.done") < first_text  # the reasoning item closed first
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        part.text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output[0].content[0].text == part.text and final.output_text == whole.output_text
    # the message's logprobs are its own tokens', whole or streamed
    asked = {"include": ["message.output_text.logprobs"]}
    body = {"model": "m", "input": QUESTION, "temperature": 0, "max_output_tokens": 40, **asked}
    answer = post(thinking_server, "/v1/responses", json.dumps(body)).json()
    usage = answer["usage"]
    [logprobs] = [o["content"][0]["logprobs"] for o in answer["output"] if o["type"] == "message"]
    assert len(logprobs) == usage["output_tokens"] - usage["output_tokens_details"][
        "reasoning_tokens"] > 0
    streamed = post(thinking_server, "/v1/responses", json.dumps({**body, "stream": True}))
    deltas = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ")]
    assert [lp for d in deltas if d["type"] == "response.output_text.delta"
            for lp in d["logprobs"]] == logprobs[:-1]  # (the EOS has no text: no delta)
    assert logprobs[-1]["token"] == "<|im_end|>"


def test_qwen3_reads_no_reasoning_where_thinking_is_off():
    s = ServerProcess(default_model_dir(), ["--dtype", "float32", "--max-model-len", "1024",
                                            "--reasoning-parser", "qwen3"])
    try:
        body = {"model": "m", "messages": QUESTION, "temperature": 0, "max_tokens": 40}
        on = post(s, "/v1/chat/completions", json.dumps(body)).json()["choices"][0]["message"]
        off = post(s, "/v1/chat/completions", json.dumps(
            {**body, "chat_template_kwargs": {"enable_thinking": False}})).json()
        message = off["choices"][0]["message"]
        assert on["reasoning"] and message["reasoning"] is None
        assert message["content"] == f"<think>{on['reasoning']}</think>{on['content']}"
        assert "completion_tokens_details" in off["usage"]
        assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    finally:
        assert s.stop() == 0


def test_responses_reasoning_effort_reaches_the_template_as_chats():
    from nanoserve.entrypoints.protocol import APIError, ResponsesRequest
    from nanoserve.entrypoints.request_prompts import responses_prompt

    def kwargs(reasoning):
        return responses_prompt(ResponsesRequest(input="hi", reasoning=reasoning))[0][
            "chat_template_kwargs"]

    assert kwargs(None) is None and kwargs({"effort": None, "summary": None}) is None
    assert kwargs({"effort": "none"}) == {"enable_thinking": False, "reasoning_effort": "none"}
    assert kwargs({"effort": "high"}) == {"enable_thinking": True, "reasoning_effort": "high"}
    for bad in ({"effort": "hard"}, {"summary": "auto"}, {"x": 1}):
        with pytest.raises(APIError) as e:
            kwargs(bad)
        assert e.value.param == "reasoning"
