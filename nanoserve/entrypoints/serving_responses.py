"""POST /v1/responses (vLLM's OpenAIServingResponses, for a text model): OpenAI's newer API over
the same engine requests as the chat's (§3). The input, a text or messages, goes through the
chat template as a chat's messages do; the answer is a "response" whose output is one assistant
message and, with function tools, the calls read out of its text (tool_parser.py). Streamed, it
is OpenAI's typed events, numbered: the response created and in progress, the message and its
text part added, the text's deltas, then each of them done, and the response completed (its
status "incomplete" where max_output_tokens ended it, as vLLM sends it). Nothing is stored, as
in vLLM without its store: a request cannot continue an earlier one by id
(`previous_response_id` is a 400); a client sends the conversation, earlier output messages
included, as `input`."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any

from nanoserve.entrypoints.choices import Batch, Choice, num_reasoning
from nanoserve.entrypoints.protocol import (
    APIError,
    ResponsesRequest,
    StreamOptions,
    error_event,
)
from nanoserve.entrypoints.serving_chat import OpenAIServingChat
from nanoserve.entrypoints.tool_parser import HermesToolParser, chat_tools, tool_parser_for
from nanoserve.entrypoints.validation import RESPONSES

LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for them
# a finish reason -> the response's status ("stop": completed; the sampler's "error": failed)
STATUS = {"length": "incomplete", "error": "failed"}


def event(kind: str, number: int, **data: Any) -> str:
    """A server-sent event as OpenAI sends them: its type named twice, and its number."""
    body = json.dumps({"type": kind, "sequence_number": number, **data}, ensure_ascii=False)
    return f"event: {kind}\ndata: {body}\n\n"


class OpenAIServingResponses(OpenAIServingChat):
    endpoint = RESPONSES  # the prompt: `input` and `instructions`, as chat messages (protocol.py)

    def tokenize(self, tokenizer: Any, prompt: dict, req: ResponsesRequest) -> list[int]:
        prompt = {**prompt, "tools": chat_tools(prompt["tools"])}  # as chat templates take them
        try:
            return super().tokenize(tokenizer, prompt, req)
        except APIError as e:  # what the template refused in the messages: the client's input
            if e.param == "messages":
                e.param = "input"
            raise

    def max_tokens_of(self, req: ResponsesRequest) -> int | None:
        return req.max_output_tokens

    def tool_parser_of(self, req: ResponsesRequest) -> type[HermesToolParser] | None:
        return tool_parser_for(chat_tools(req.tools) or [], req.tool_choice,
                               self.options.tool_call_parser)

    def num_logprobs_of(self, req: ResponsesRequest) -> int | None:
        wanted = LOGPROBS in (req.include or [])
        if req.top_logprobs and not wanted:
            raise APIError(f'top_logprobs needs include: ["{LOGPROBS}"]', "top_logprobs")
        return (req.top_logprobs or 0) if wanted else None

    def wire_name(self, field_name: str | None, req: ResponsesRequest) -> str | None:
        names = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}
        return names.get(field_name, field_name)

    def head(self, req: ResponsesRequest) -> dict:
        """The response as it starts (no output yet), the request's settings in it."""
        return {"id": req.request_id or f"resp_{uuid.uuid4().hex}", "object": "response",
                "created_at": int(time.time()), "model": self.model_name,
                "status": "in_progress", "output": [], "usage": None, "error": None,
                "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "metadata": req.metadata,
                "temperature": self.default("temperature", req),
                "top_p": self.default("top_p", req),
                "top_logprobs": req.top_logprobs, "parallel_tool_calls": True,
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                "text": {"format": {"type": "text"}},
                "truncation": "disabled", "previous_response_id": None,
                "reasoning": req.reasoning,
                "store": False, "background": False, "user": req.user}

    def default(self, name: str, req: ResponsesRequest) -> float:
        """The request's value, else the model's recommended one, else SamplingParams'."""
        value = getattr(req, name)
        return self.engine.llm.sampling_defaults.get(name, 1.0) if value is None else value

    def message(self, item_id: str, text: str, choice: Choice, num_logprobs: int | None,
                status: str) -> dict:
        """The output's assistant message, its text as one "output_text" part."""
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": [self.text_part(text, choice, num_logprobs)]}

    def read(self, choice: Choice) -> tuple[str, list[dict]]:
        """The answer's text (after its reasoning) and, with tools, the calls read out of it (as
        chat's), each as a "function_call" output item; streamed, the parser has read it all as
        it came."""
        text = "".join(choice.texts) if choice.reasoning is None else choice.reasoning.whole()[1]
        if choice.parser is None:
            return text, []
        if not choice.parser.done:
            choice.parser.feed(text, final=True)
        return "".join(choice.parser.content), [
            {"type": "function_call", "id": "fc_" + call["id"].rpartition("-")[2],
             "call_id": call["id"], "name": call["function"]["name"],
             "arguments": call["function"]["arguments"], "status": "completed"}
            for call in choice.parser.calls]

    def text_part(self, text: str, choice: Choice, num_logprobs: int | None) -> dict:
        """The message's text; its logprobs those of the tokens after the reasoning's."""
        return {"type": "output_text", "text": text, "annotations": [], "logprobs":
                self.token_logprobs(choice.logprobs[num_reasoning([choice]) or 0:], num_logprobs)}

    def token_logprobs(self, entries: list, num_logprobs: int | None) -> list:
        """The chat's per-token logprobs (each token's, and its top N): the same entries."""
        return [] if num_logprobs is None else self.logprobs(entries, 0, num_logprobs)["content"]

    def finished(self, head: dict, choice: Choice, batch: Batch, num_prompt_tokens: int,
                 num_logprobs: int | None, item_id: str, reasoning_id: str) -> dict:
        """The response once its one completion has finished: its status, output and usage."""
        status = STATUS.get(choice.finish_reason, "completed")
        incomplete = status == "incomplete"
        text, calls = self.read(choice)
        message = self.message(item_id, text, choice, num_logprobs,
                               "incomplete" if incomplete else "completed")
        reasoning = [] if choice.reasoning is None or not (r := choice.reasoning.whole()[0]) \
            else [reasoning_item(reasoning_id, r, "completed")]
        usage = {"input_tokens": num_prompt_tokens, "output_tokens": choice.num_tokens,
                 "total_tokens": num_prompt_tokens + choice.num_tokens,
                 "input_tokens_details": {"cached_tokens": batch.num_cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": num_reasoning([choice]) or 0}}
        return {**head, "status": status, "output": [*reasoning, message, *calls], "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "error": {"code": "server_error", "message": choice.error}
                if status == "failed" else None}

    def answer(self, head: dict, choices: list[Choice], batch: Batch, num_prompt_tokens: int,
               num_logprobs: int | None) -> dict:
        return self.finished(head, choices[0], batch, num_prompt_tokens, num_logprobs,
                             f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}")

    async def stream(self, batch: Batch, head: dict, choices: list[Choice], n: int,
                     prompt_lens: list[int], options: StreamOptions, num_logprobs: int | None):
        """OpenAI's events: the reasoning's item (with --reasoning-parser, where the model
        reasons), then the message's of one text part, each added as its first text comes;
        closing it (a disconnect) aborts."""
        [choice], number = choices, itertools.count()
        item_id, reasoning_id = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        items: list[str] = []  # the items added so far, in their order: their output_index
        try:
            yield event("response.created", next(number), response=head)
            yield event("response.in_progress", next(number), response=head)
            async for _, c in batch.outputs(1):
                start = len(choice.logprobs)
                choice.add(c)
                reasoning, delta = "", c.text
                if choice.reasoning is not None:
                    reasoning, delta = choice.reasoning.last
                if reasoning:
                    for kind, data in self.open_reasoning(items, reasoning_id):
                        yield event(kind, next(number), **data)
                    yield event("response.reasoning_text.delta", next(number),
                                item_id=reasoning_id, output_index=0, content_index=0,
                                delta=reasoning)
                if choice.parser is not None and (delta or c.finish_reason):
                    delta, _ = choice.parser.feed(delta, final=c.finish_reason is not None)
                if delta:  # (with tools, text that may begin a call is held back)
                    for kind, data in self.open_message(items, item_id, reasoning_id, choice):
                        yield event(kind, next(number), **data)
                    yield event("response.output_text.delta", next(number), item_id=item_id,
                                output_index=len(items) - 1, content_index=0, delta=delta,
                                logprobs=self.token_logprobs(choice.logprobs[max(
                                    start, num_reasoning([choice]) or 0):], num_logprobs))
            if choice.finish_reason == "abort":  # shutdown or a failed step
                error = self.aborted()
                yield error_event(error.message, error.code)
                return
            for kind, data in self.open_message(items, item_id, reasoning_id, choice):
                yield event(kind, next(number), **data)  # (where no text came)
            done = self.finished(head, choice, batch, prompt_lens[0], num_logprobs, item_id,
                                 reasoning_id)
            *_, message = done["output"][:len(items)]
            calls = done["output"][len(items):]
            [part] = message["content"]
            where = {"item_id": item_id, "output_index": len(items) - 1, "content_index": 0}
            yield event("response.output_text.done", next(number), **where, text=part["text"],
                        logprobs=part["logprobs"])
            yield event("response.content_part.done", next(number), **where, part=part)
            yield event("response.output_item.done", next(number), output_index=len(items) - 1,
                        item=message)
            for index, call in enumerate(calls, len(items)):  # each whole, once its text came
                at = {"item_id": call["id"], "output_index": index}
                yield event("response.output_item.added", next(number), output_index=index,
                            item={**call, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", next(number), **at,
                            delta=call["arguments"])
                yield event("response.function_call_arguments.done", next(number), **at,
                            arguments=call["arguments"])
                yield event("response.output_item.done", next(number), output_index=index,
                            item=call)
            # vLLM's last event whatever the status (the response says it): the openai client's
            # stream helper hands back a final response only after a response.completed
            yield event("response.completed", next(number), response=done)
        finally:
            self.abort(batch)

    def open_reasoning(self, items: list[str], reasoning_id: str):
        """The reasoning item's first events, once (it comes first, or not at all)."""
        if not items:
            items.append(reasoning_id)
            yield "response.output_item.added", {
                "output_index": 0, "item": reasoning_item(reasoning_id, None, "in_progress")}
            yield "response.content_part.added", {
                "item_id": reasoning_id, "output_index": 0, "content_index": 0,
                "part": {"type": "reasoning_text", "text": ""}}

    def open_message(self, items: list[str], item_id: str, reasoning_id: str, choice: Choice):
        """The message item's first events, once; before them, the reasoning's last."""
        if item_id in items:
            return
        if items:  # the reasoning is over: all of it came
            text, at = choice.reasoning.whole()[0], {"item_id": reasoning_id, "output_index": 0}
            yield "response.reasoning_text.done", {**at, "content_index": 0, "text": text}
            yield "response.content_part.done", {**at, "content_index": 0, "part": {
                "type": "reasoning_text", "text": text}}
            yield "response.output_item.done", {
                "output_index": 0, "item": reasoning_item(reasoning_id, text, "completed")}
        items.append(item_id)
        yield "response.output_item.added", {"output_index": len(items) - 1, "item": {
            **self.message(item_id, "", choice, None, "in_progress"), "content": []}}
        yield "response.content_part.added", {
            "item_id": item_id, "output_index": len(items) - 1, "content_index": 0,
            "part": self.text_part("", choice, None)}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    """A Responses reasoning output item (vLLM's), its text one "reasoning_text" part."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}
