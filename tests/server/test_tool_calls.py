"""Tool calling (vLLM's --enable-auto-tool-choice --tool-call-parser hermes,
nanoserve/entrypoints/tool_parser.py):
- the parser without a model: calls read whole however the text is cut into pieces, text that
  only looks like a tag's start sent on, a body that is not a call kept as text;
- an assistant message's calls reach the chat template with their arguments as objects;
- served, on the bundled model with a Hermes chat template and one example exchange: the model's
  call comes back as `tool_calls` (finish_reason "tool_calls"), streamed or not, through the
  real `openai` client, and the conversation goes on with the tool's answer; the Responses API
  the same, its calls `function_call` items, its input taking them and their outputs back;
- tool_choice rules: "auto" needs the flags, a forced call is refused, "none" reads nothing;
- Llama 3.x's JSON calls (--tool-call-parser llama3_json): the parser without a model (an answer
  of calls read whole, any other answer text), and served the same way as Hermes'."""

from __future__ import annotations

import json

import pytest

from nanoserve.entrypoints.bundled import default_model_dir
from nanoserve.entrypoints.tool_parser import (
    HermesToolParser,
    Llama3JsonToolParser,
    template_messages,
)
from tests.server.harness import ServerProcess, post

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Hà Nội"}}\n</tool_call>'


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_calls_are_read_whole_however_the_text_is_cut(size):
    text = "Let me check. " + CALL + "\n" + CALL.replace("Hà Nội", "Huế") + " Done <tool"
    parser, content, calls = HermesToolParser(), "", []
    chunks = pieces(text, size)
    for i, chunk in enumerate(chunks):
        got, new = parser.feed(chunk, final=i == len(chunks) - 1)
        content, calls = content + got, calls + new
    assert content == "Let me check. \n Done <tool"  # a tag's start at the end: text after all
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [(0, "get_weather", {"city": "Hà Nội"}),
                                (1, "get_weather", {"city": "Huế"})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)


def test_what_is_not_a_call_stays_text():
    parser = HermesToolParser()
    assert parser.feed("a <tool_cal", final=False) == ("a ", [])  # held back: maybe a tag
    assert parser.feed("l>{not json}</tool_call> b <tool_call>{\"name\": 1}") == (
        "<tool_call>{not json}</tool_call> b ", [])
    assert parser.feed("", final=True) == ('<tool_call>{"name": 1}', [])  # unclosed, no call
    unclosed = HermesToolParser().feed('<tool_call>{"name": "f"}', final=True)
    assert unclosed[0] == "" and unclosed[1][0]["function"] == {"name": "f", "arguments": "{}"}


def test_a_messages_calls_reach_the_template_with_object_arguments():
    calls = [{"id": "1", "type": "function",
              "function": {"name": "f", "arguments": '{"x": 1}'}}]
    messages = [{"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "2", "tool_call_id": "1"}]
    out = template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert out[1] == messages[1] and calls[0]["function"]["arguments"] == '{"x": 1}'


# -- served --------------------------------------------------------------------------------------

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. The tools: <tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\nFor each call write "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

def exchange(city: str, i: int) -> list[dict]:
    """A question, the model's call, the tool's answer, the model's reply."""
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "18 C, sunny"},
            {"role": "assistant", "content": f"It is 18 C and sunny in {city}."}]


# three exchanges that the small model can copy (with one, it answers without a call)
EXAMPLE = [*exchange("Paris", 1), *exchange("Rome", 2), *exchange("Berlin", 3),
           {"role": "user", "content": "What is the weather in London?"}]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("tools") / "hermes.jinja"
    template.write_text(TEMPLATE)
    s = ServerProcess(default_model_dir(), ["--dtype", "float32", "--max-model-len", "1024",
                                            "--chat-template", str(template),
                                            "--enable-auto-tool-choice",
                                            "--tool-call-parser", "hermes"])
    yield s
    assert s.stop() == 0


def test_the_models_call_comes_back_as_tool_calls(tool_server):
    client = tool_server.client()
    out = client.chat.completions.create(model="m", messages=EXAMPLE, tools=TOOLS,
                                         temperature=0, max_tokens=60)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "London"}
    streamed = list(client.chat.completions.create(
        model="m", messages=EXAMPLE, tools=TOOLS, temperature=0, max_tokens=60, stream=True))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    [[delta_call]] = [d.tool_calls for d in deltas if d.tool_calls]
    assert (delta_call.index, delta_call.function.name, delta_call.function.arguments) == (
        0, call.function.name, call.function.arguments)
    assert "".join(d.content or "" for d in deltas).strip() == ""
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # the conversation goes on with the tool's answer
    follow = EXAMPLE + [choice.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "9 C, rain"}]
    answer = client.chat.completions.create(model="m", messages=follow, tools=TOOLS,
                                            temperature=0, max_tokens=30)
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls


def test_tool_choice_none_renders_the_tools_but_reads_nothing(tool_server):
    body = {"model": "m", "messages": EXAMPLE, "tools": TOOLS, "tool_choice": "none",
            "temperature": 0, "max_tokens": 60}
    r = post(tool_server, "/v1/chat/completions", json.dumps(body))
    message = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and "<tool_call>" in message["content"]
    assert "tool_calls" not in message and r.json()["choices"][0]["finish_reason"] == "stop"
    tokens = post(tool_server, "/tokenize", json.dumps({"model": "m", "messages": EXAMPLE,
                                                        "tools": TOOLS})).json()["count"]
    plain = post(tool_server, "/tokenize", json.dumps({"model": "m", "messages": EXAMPLE}))
    assert tokens > plain.json()["count"]  # the tools are in the prompt


@pytest.mark.parametrize("change, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"tools": "x"}, "tools"),
    ({"tool_choice": 3}, "tool_choice"),
    ({"tools": []}, "tools"), ({"tools": [], "tool_choice": "none"}, "tools"),  # vLLM's, OpenAI's
    ({"tools": None, "tool_choice": "auto"}, "tool_choice")])
def test_what_cannot_be_done_is_a_400_naming_it(tool_server, change, param):
    body = {"model": "m", "messages": EXAMPLE, "tools": TOOLS, "max_tokens": 2, **change}
    r = post(tool_server, "/v1/chat/completions", json.dumps(body))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_without_the_flags_auto_is_a_400(server):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "max_tokens": 2}
    r = post(server, "/v1/chat/completions", json.dumps(body))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", json.dumps({**body, "tool_choice": "none"}))
    assert r.status_code == 200


def test_llm_chat_shows_the_tools_and_names_bad_ones():
    from nanoserve import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=1024)
    try:
        [out] = llm.chat(EXAMPLE, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False,
                         chat_template=TEMPLATE, tools=TOOLS)
        assert '"name": "get_weather"' in out.prompt and "<tools>" in out.prompt
        assert out.text.startswith("<tool_call>")  # as served: the text before it is read
        for bad in ("x", [{"type": "function"}], [3]):
            with pytest.raises(ValueError, match="^tools must each be"):
                llm.chat(EXAMPLE, tools=bad, chat_template=TEMPLATE, use_tqdm=False)
    finally:
        llm.shutdown()


# -- the Responses API's function tools ---------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", "name": "get_weather",
                    "description": "The weather in a city now",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def as_input(messages: list[dict]) -> list[dict]:
    """The chat EXAMPLE as Responses input items: calls and their outputs as items of their own."""
    items = []
    for m in messages:
        if m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


def test_responses_read_the_call_into_a_function_call_item(tool_server):
    client = tool_server.client()
    r = client.responses.create(model="m", input=as_input(EXAMPLE), tools=RESPONSES_TOOLS,
                                temperature=0, max_output_tokens=60)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "London"})
    assert r.status == "completed" and r.output_text == "" and r.tools[0].name == "get_weather"
    with client.responses.stream(model="m", input=as_input(EXAMPLE), tools=RESPONSES_TOOLS,
                                 temperature=0, max_output_tokens=60) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert "response.output_text.delta" not in kinds  # the call's text was held, then read
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    follow = as_input(EXAMPLE) + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "9 C, rain"}]
    answer = client.responses.create(model="m", input=follow, tools=RESPONSES_TOOLS,
                                     temperature=0, max_output_tokens=30)
    assert answer.output_text and [item.type for item in answer.output] == ["message"]


# -- Llama 3.x's JSON calls ---------------------------------------------------------------------

def read_llama(text: str, size: int) -> tuple[str, list]:
    parser, content, calls = Llama3JsonToolParser(), "", []
    chunks = pieces(text, size) or [""]
    for i, chunk in enumerate(chunks):
        got, new = parser.feed(chunk, final=i == len(chunks) - 1)
        content, calls = content + got, calls + new
    return content, [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls]


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("text, read", [
    ('{"name": "f", "parameters": {"city": "Huế"}}', ("", [(0, "f", {"city": "Huế"})])),
    (' <|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}}',
     ("", [(0, "f", {}), (1, "g", {"x": 1})])),
    ('It is {"name": "f"}', ('It is {"name": "f"}', [])),  # text first: text
    ('{"name": "f", "parameters": {}} and so', ('{"name": "f", "parameters": {}} and so', [])),
    ('{"nome": "f"}', ('{"nome": "f"}', [])), ("{broken", ("{broken", [])), ("<|py", ("<|py", []))])
def test_llama_calls_are_read_whole_or_are_text(size, text, read):
    assert read_llama(text, size) == read


def test_llama_text_is_sent_as_it_comes():
    parser = Llama3JsonToolParser()
    assert parser.feed(" ") == ("", []) and parser.feed("Hi") == (" Hi", [])
    assert parser.feed(' {"name": "f"}', final=True) == (' {"name": "f"}', [])


LLAMA_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. The tools: "
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}\nTo call one, answer with only "
    "{\"name\": ..., \"parameters\": ...}.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_llama_call_comes_back_as_tool_calls(tmp_path):
    template = tmp_path / "llama.jinja"
    template.write_text(LLAMA_TEMPLATE)
    s = ServerProcess(default_model_dir(), ["--dtype", "float32", "--max-model-len", "1024",
                                            "--chat-template", str(template),
                                            "--enable-auto-tool-choice",
                                            "--tool-call-parser", "llama3_json"])
    try:
        client = s.client()
        out = client.chat.completions.create(model="m", messages=EXAMPLE, tools=TOOLS,
                                             temperature=0, max_tokens=40)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        [call] = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "London"})
        streamed = list(client.chat.completions.create(
            model="m", messages=EXAMPLE, tools=TOOLS, temperature=0, max_tokens=40,
            stream=True))
        deltas = [c.choices[0].delta for c in streamed if c.choices]
        [[delta_call]] = [d.tool_calls for d in deltas if d.tool_calls]
        assert (delta_call.function.name, delta_call.function.arguments) == (
            call.function.name, call.function.arguments)
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
        plain = client.chat.completions.create(model="m", messages=EXAMPLE[:1], tools=TOOLS,
                                               temperature=0, max_tokens=20)
        assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    finally:
        assert s.stop() == 0
