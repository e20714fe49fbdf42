"""Tool calls in a chat answer (vLLM's `--enable-auto-tool-choice --tool-call-parser hermes` or
`llama3_json`): the chat template shows the model the request's `tools`, and the model writes
each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes format that
Qwen2.5, Qwen3 and Hermes models are trained on) or, Llama 3.x's, as an answer of JSON objects
`{"name": ..., "parameters": {...}}`. The answer's text is read back here into the message's
`tool_calls`, as it comes: streamed, a call is sent whole once it has ended, and text that may
be the start of one is held back until it is known not to be."""

from __future__ import annotations

import json
import uuid

from nanoserve.entrypoints.protocol import APIError

START, END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x's before a call (a special token: usually not shown)


class HermesToolParser:
    """One choice's answer, fed in pieces: `feed` returns the content to send and the calls
    completed; `final=True` with the last piece (an unclosed call is read up to the end)."""

    def __init__(self) -> None:
        self.buffer, self.in_call = "", False
        self.content: list[str] = []  # all the text it let through, and all the calls read
        self.calls: list[dict] = []
        self.done = False  # fed its last piece

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += text
        content, first = [], len(self.calls)
        while True:
            if not self.in_call:
                i = self.buffer.find(START)
                if i < 0:  # keep what could be the tag's beginning for the next piece
                    keep = 0 if final else _partial_tag(self.buffer)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:i])
                self.buffer, self.in_call = self.buffer[i + len(START):], True
            j = self.buffer.find(END)
            if j < 0 and not final:
                break
            body = self.buffer if j < 0 else self.buffer[:j]
            self.buffer = "" if j < 0 else self.buffer[j + len(END):]
            self.in_call = False
            if (call := self._call(_json(body))) is None:  # not a call: the text as written
                content.append(START + body + ("" if j < 0 else END))
            else:
                self.calls.append(call)
        self.content.append("".join(content))
        self.done = final
        return self.content[-1], self.calls[first:]

    def _call(self, data: object, index: int | None = None) -> dict | None:
        """The OpenAI shape of one call, or None where the object is not one (vLLM's fields;
        Llama's name its arguments "parameters")."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        index = len(self.calls) if index is None else index
        return {"index": index, "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                "type": "function", "function": {"name": data["name"], "arguments": (
                    arguments if isinstance(arguments, str) else
                    json.dumps(arguments, ensure_ascii=False))}}


class Llama3JsonToolParser(HermesToolParser):
    """Llama 3.x's calls (vLLM's llama3_json): an answer that calls starts with one, each a JSON
    object, several separated by ";" (after the <|python_tag|>, where it is shown). Such an
    answer is held back until it ends, then read whole: all calls, or (one not a call) all text
    as written; an answer that starts otherwise is text, sent as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.is_text = False  # it began as text: it stays text

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += text
        first, content = len(self.calls), ""
        if not (self.in_call or self.is_text):  # undecided: the answer's first characters
            head = self.buffer.lstrip()
            self.in_call = head.startswith(("{", PYTHON_TAG))
            self.is_text = not self.in_call and (final or bool(head)
                                                 and not PYTHON_TAG.startswith(head))
        if self.is_text:
            content, self.buffer = self.buffer, ""
        elif final:
            calls = self._calls(self.buffer.lstrip().removeprefix(PYTHON_TAG))
            content, self.buffer = "" if calls else self.buffer, ""
            self.calls += calls or []
        self.content.append(content)
        self.done = final
        return content, self.calls[first:]

    def _calls(self, text: str) -> list[dict] | None:
        """The calls the text is, or None where it is not calls only."""
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(text) and text[i] in " \n\t;":  # between the calls
                i += 1
            if i == len(text):
                return calls or None
            try:
                data, i = decoder.raw_decode(text, i)
            except ValueError:
                return None
            if (call := self._call(data, len(self.calls) + len(calls))) is None:
                return None
            calls.append(call)


PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}  # the flag's


def _json(body: str) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _partial_tag(text: str) -> int:
    """How many of `text`'s last characters are START's first ones."""
    return next((k for k in range(min(len(text), len(START) - 1), 0, -1)
                 if START.startswith(text[-k:])), 0)


def template_messages(messages: list[dict]) -> list[dict]:
    """An assistant message's tool calls with their `arguments` as objects, not JSON text: the
    templates that render calls write them with `tojson` (vLLM turns them so, too)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = {**m, "tool_calls": [_arguments_as_object(c) for c in calls]}
        out.append(m)
    return out


def _arguments_as_object(call: object) -> object:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function,
                                         "arguments": json.loads(function["arguments"])}}
        except ValueError:
            pass
    return call


def tool_parser_for(tools: list, tool_choice: object, parser: str | None
                    ) -> type[HermesToolParser] | None:
    """vLLM's rules: tool_choice "auto" (the default with tools) reads the calls, with
    --enable-auto-tool-choice; "none" shows the tools but reads nothing; a forced call
    ("required", a named function) would need structured outputs, which nanoserve has not."""
    choice = tool_choice if tool_choice is not None else "auto" if tools else "none"
    if choice == "none" or (choice == "auto" and not tools):
        return None
    if choice != "auto":
        raise APIError(f'tool_choice must be "auto" or "none" (a forced call needs structured '
                       f'outputs, which nanoserve has not), got {choice!r:.100}', "tool_choice")
    if parser is None:
        raise APIError('tool_choice "auto" needs the server started with '
                       '--enable-auto-tool-choice and --tool-call-parser', "tool_choice")
    return PARSERS[parser]


def check_tools(tools: object) -> list:
    """OpenAI's tools: a list, each {"type": "function", "function": {"name": ..., ...}}."""
    for tool in tools if isinstance(tools, list) else [tools]:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or not isinstance(
                function.get("name"), str):
            raise APIError(f'tools must each be {{"type": "function", "function": {{"name": '
                           f'...}}}}, got {tool!r:.200}', "tools")
    return tools


def chat_tools(tools: list | None) -> list | None:
    """Responses' function tools ({"type": "function", "name", "description", "parameters"}) in
    chat's shape, which chat templates take."""
    if not tools:
        return None
    if not all(isinstance(t, dict) and t.get("type") == "function" and isinstance(
            t.get("name"), str) for t in tools):
        raise APIError(f'tools must each be {{"type": "function", "name": ...}} (nanoserve '
                       f'serves function tools), got {tools!r:.200}', "tools")
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                              "parameters") if k in t}}
            for t in tools]
