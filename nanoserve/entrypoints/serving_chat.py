"""POST /v1/chat/completions (vLLM's OpenAIServingChat): messages through the model's chat
template, the answer as an assistant message (streamed: a role chunk, then content deltas), its
tool calls read out of its text (tool_parser.py), and `logprobs` / `top_logprobs` as the chat API
shapes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanoserve.entrypoints.choices import Choice, shown
from nanoserve.entrypoints.prompts import chat_prompts
from nanoserve.entrypoints.protocol import APIError, ChatCompletionRequest, param_of
from nanoserve.entrypoints.reasoning_parser import reasoning_parser_for
from nanoserve.entrypoints.request_prompts import template_kwargs
from nanoserve.entrypoints.serving_engine import OpenAIServing
from nanoserve.entrypoints.tool_parser import HermesToolParser, check_tools, tool_parser_for
from nanoserve.entrypoints.validation import CHAT
from nanoserve.layers.sampler import Logprob


def render(tokenizer: Any, prompt: dict) -> dict:
    """A conversation as LLM.chat renders it (the template's options from the request): its
    text ("prompt") and token ids ("prompt_token_ids"). On a tokenizer thread."""
    try:
        [rendered] = chat_prompts(tokenizer=tokenizer, **prompt)
    except ValueError as e:  # messages that do not fit the template, or its options
        raise APIError(str(e), param_of(str(e), set(ChatCompletionRequest.model_fields),
                                        "messages") or "messages") from None
    return rendered


class OpenAIServingChat(OpenAIServing):
    endpoint = CHAT  # the prompt: the messages, each {"role", "content"} (protocol.py)
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def tokenize(self, tokenizer: Any, prompt: dict, req: ChatCompletionRequest) -> list[int]:
        """The rendered conversation's ids; add_special_tokens (vLLM's, False by default: the
        template writes them) encodes its text with the tokenizer's own added (a BOS, for some).
        The server's flags: --default-chat-template-kwargs under the request's, and with
        --exclude-tools-when-tool-choice-none no tools shown where tool_choice is "none"."""
        hide = self.options.exclude_tools_when_tool_choice_none and req.tool_choice == "none"
        rendered = render(tokenizer, {**prompt, "tools": None if hide else prompt["tools"],
                                      "chat_template_kwargs": self.with_defaults(
                                          prompt["chat_template_kwargs"])})
        if getattr(req, "add_special_tokens", False):  # (Responses have none)
            return tokenizer.encode(rendered["prompt"], add_special_tokens=True)
        return rendered["prompt_token_ids"]

    def max_tokens_of(self, req: ChatCompletionRequest) -> int | None:
        # as vLLM: max_completion_tokens, OpenAI's name now, over the deprecated max_tokens
        return req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens

    def num_logprobs_of(self, req: ChatCompletionRequest) -> int | None:
        if req.top_logprobs and not req.logprobs:  # (0 alone asks for nothing, as in vLLM)
            raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None

    def wire_name(self, field_name: str | None, req: ChatCompletionRequest) -> str | None:
        if field_name == "max_tokens" and req.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if field_name == "logprobs" else field_name

    def tool_parser_of(self, req: ChatCompletionRequest) -> type[HermesToolParser] | None:
        # vLLM's (check_tool_usage) and OpenAI's: no empty tools, no tool_choice without tools
        if req.tools == []:
            raise APIError("tools must not be an empty list: give a tool or leave it out",
                           "tools")
        if req.tools is None and req.tool_choice not in (None, "none"):
            raise APIError(f"tool_choice {req.tool_choice!r:.100} needs tools", "tool_choice")
        return tool_parser_for(check_tools(req.tools or []), req.tool_choice,
                               self.options.tool_call_parser)

    def role_of(self, req: ChatCompletionRequest) -> str:
        """vLLM's: --response-role after a generation prompt, else the last message's role
        (the answer continues it)."""
        if getattr(req, "add_generation_prompt", True) or not req.messages:  # (Responses: no)
            return self.options.response_role
        return req.messages[-1]["role"]

    def with_defaults(self, kwargs: dict | None) -> dict | None:
        """The chat template's options: the request's over the server's defaults."""
        defaults = self.options.default_chat_template_kwargs
        return {**defaults, **(kwargs or {})} if defaults else kwargs

    def reasoning_parser_of(self, req: ChatCompletionRequest) -> Callable[[], Any] | None:
        return reasoning_parser_for(self.options.reasoning_parser,
                                    self.with_defaults(template_kwargs(req)), self.end_id,
                                    getattr(req, "include_reasoning", True))

    def choice(self, index: int, choice: Choice, text: str, logprobs: dict | None,
               delta: bool) -> dict:
        calls, finish, parsed = [], choice.finish_reason, choice.reasoning
        reasoning = None
        if parsed is not None:  # the reasoning apart (read as the outputs came: choices.py)
            reasoning, text = parsed.last if delta else parsed.whole()
            if not parsed.shown:  # vLLM's: nor the tokens' logprobs and ids, which would show it
                reasoning, logprobs = None, None
        if choice.parser is not None:  # the calls out of the text, as they complete
            text, calls = choice.parser.feed(text, final=finish is not None)
            finish = "tool_calls" if finish and choice.parser.calls else finish
        if delta:
            message = {"reasoning": reasoning} if reasoning else {}
            message |= {"content": text} if text or not (calls or reasoning) else {}
            message |= {"tool_calls": calls} if calls else {}
        else:
            message = {"role": choice.role, "content": text if text or parsed is None else None}
            message |= {} if parsed is None else {"reasoning": reasoning}
            if choice.parser is not None:  # no text beside the calls: null, as vLLM's
                message |= {"content": text if text.strip() or not calls else None,
                            "tool_calls": [{k: v for k, v in c.items() if k != "index"}
                                           for c in calls]}
        ids = {} if choice.prompt_ids is None or (parsed and not parsed.shown) else {
            "token_ids": choice.new_ids if delta else choice.token_ids}  # return_token_ids
        return {"index": index, "delta" if delta else "message": message, "logprobs": logprobs,
                "finish_reason": finish, "stop_reason": choice.stop_reason, **ids}

    def first_chunks(self, head: dict, choices: list[Choice]) -> list[dict]:
        """vLLM's first chat chunk: the role, for each choice (the first: the prompt's ids)."""
        return [{**head, **(self.prompt_fields(choices) if i == 0 else {}), "choices": [
            {"index": i, "delta": {"role": c.role, "content": ""}, "logprobs": None,
             "finish_reason": None}]} for i, c in enumerate(choices)]

    def prompt_fields(self, choices: list[Choice]) -> dict:
        """return_token_ids: the prompt's ids, once in the answer (one prompt a chat)."""
        ids = choices[0].prompt_ids if choices else None
        return {} if ids is None else {"prompt_token_ids": ids}

    def logprobs(self, entries: list[dict[int, Logprob]], offset: int, num: int,
                 as_ids: bool = False) -> dict:
        """Each token's text (as_ids: "token_id:N"), logprob and bytes, and the `num` most
        likely tokens'."""
        def item(token: int, e: Logprob) -> dict:
            text = shown(token, e, as_ids)
            return {"token": text, "logprob": max(e.logprob, -9999.0),
                    "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(*next(iter(entry.items()))), "top_logprobs": [
            item(t, e) for t, e in sorted(entry.items(), key=lambda te: te[1].rank)
            if e.rank <= num]} for entry in entries]}
