"""The wire side of the server: vLLM's request fields and defaults (entrypoints/openai/protocol.py),
its error shape, its prompts' forms (a completion's prompt or batch of them, chat messages) and
its server-sent events."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

MAX_PROMPTS = 128  # prompts in one completions request (a batch; vLLM sets no limit), and
# completions in one (prompts x n): one small body may not queue more requests than n alone could


class APIError(Exception):
    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             408: "RequestTimeoutError", 413: "RequestTooLargeError", 414: "URITooLongError",
             431: "RequestHeaderFieldsTooLargeError", 499: "ClientClosedRequest",
             500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, message: str, param: str | None = None, code: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.TYPES[self.code],
                                       "param": self.param, "code": self.code}}, self.code)


def error_event(message: str, code: int) -> str:
    """An error that ends a stream already answered 200 (vLLM's shape), before `[DONE]`."""
    return sse({"error": {"message": message, "type": APIError.TYPES[code], "param": None,
                          "code": code}})


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # vLLM's


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # with include_usage: a usage in every chunk (vLLM's)


class SamplingRequest(BaseModel):  # vLLM's fields and defaults; others are ignored
    model: str | None = None
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None  # None: 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # --scheduling-policy priority: smaller is served first (vLLM's field)
    use_beam_search: bool = False  # n is the beam width (serving_beam_search.py)
    length_penalty: float = 1.0  # a beam's score: its logprob over its length to this power
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context)
    truncation_side: Literal["left", "right"] | None = None  # "right": keep its first k instead
    # the answer's id is the prefix and it (vLLM's); bounded: every streamed chunk repeats it
    request_id: str | None = Field(None, min_length=1, max_length=256)
    return_token_ids: bool | None = None  # the prompt's and each choice's token ids beside the text
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:N"


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # the top N per token (0: the sampled token's only)
    echo: bool = False
    add_special_tokens: bool = True  # the tokenizer's (a BOS, for some), as vLLM's


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # the chat template's options, as vLLM takes them
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # shown to the model by the chat template
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, else "none"
    add_special_tokens: bool = False  # on the rendered text: the template writes them
    reasoning_effort: Effort | None = None  # to the chat template (chat_prompt)


class ResponsesRequest(SamplingRequest):
    """POST /v1/responses, vLLM's ResponsesRequest for a text model: `input` is a text (one user
    message) or a list of messages, earlier answers' output messages among them; `instructions`
    a system message before them. One answer a request (`n` stays 1)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None  # None: up to max_model_len
    include: list[str] | None = None  # "message.output_text.logprobs": each token's logprob
    top_logprobs: int | None = None  # with that include: the top N too
    tools: list[dict[str, Any]] | None = None  # function tools, Responses' flat shape
    tool_choice: str | dict[str, Any] | None = None  # as chat's
    chat_template_kwargs: dict[str, Any] | None = None  # as chat's
    store: bool = True  # as in vLLM without its store: nothing is kept, nothing to retrieve
    metadata: dict[str, str] | None = None  # handed back as given, as is `user`
    user: str | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize: vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest
    (`messages` and the chat template's options) as one; exactly one of the two is given."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's defaults, True for a prompt, False
    # for messages (the template writes them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # as chat's
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):  # POST /detokenize
    model: str | None = None
    tokens: list[int]


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(f"The model `{requested}` does not exist.", "model", 404)


def param_of(message: str, fields: set[str], prompt_field: str) -> str | None:
    """The request field an engine ValueError names (its messages start with the field)."""
    word = re.match(r"\w+", message)
    word = word and word.group()
    return prompt_field if word == "prompt" else word if word in fields else None


def chat_message(message: dict, field: str = "messages", parts: tuple = ("text",),
                 label: str = "messages") -> dict:
    """{"role", "content"}; content parts ({"type": "text", "text"}; Responses: `parts`) are
    joined, as in vLLM. An assistant message that made tool calls may have no content (OpenAI):
    it is "" here, and the calls are left for a chat template that renders them. A bad one is a
    400 naming `field`."""
    role, content = message.get("role"), message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in parts
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(role, str) or not isinstance(content, str):
        raise APIError(f"{label} must each have a string role and a text content, got "
                       f"{message!r:.200}", field)
    return {**message, "role": role, "content": content}


def completion_prompts(req: CompletionRequest) -> list:
    """A completion request's prompts: one text or token-id list, or a batch of them."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_PROMPTS:
            raise APIError(f"prompt must be at most {MAX_PROMPTS} prompts, got {len(prompt)}",
                           "prompt")
        if len(prompt) * req.n > MAX_PROMPTS:
            raise APIError(f"n must be at most {MAX_PROMPTS // len(prompt)} for a batch of "
                           f"{len(prompt)} prompts ({MAX_PROMPTS} completions a request), got "
                           f"{req.n}", "n")
        return prompt
    return [prompt]


def completion_chars(prompt: Any) -> int:
    return len(prompt) if isinstance(prompt, str) else 0


def chat_prompt(req: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    """The one prompt of a chat request: the messages (checked here, on the event loop) and the
    chat template's options, prompts.chat_prompts' arguments. vLLM's reasoning_effort goes to
    the template, over the request's own kwargs, and turns its thinking on (off: "none") where
    they do not say enable_thinking."""
    kwargs = req.chat_template_kwargs
    if (effort := getattr(req, "reasoning_effort", None)) is not None:
        kwargs = {"enable_thinking": effort != "none", **(kwargs or {}), "reasoning_effort": effort}
    return [{"messages": [chat_message(m) for m in req.messages],
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
            "chat_template_kwargs": kwargs, "tools": req.tools}]


def input_message(item: Any) -> dict:
    """A Responses `input` item as a chat message (chat_message's), its text parts "input_text"
    or an earlier answer's "output_text"; only its role and content go to the template. An
    earlier answer's "function_call" is an assistant's tool call, a "function_call_output" the
    tool's message, as chat's."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "function_call" and all(isinstance(item.get(k), str) for k in
                                       ("call_id", "name", "arguments")):
        return {"role": "assistant", "content": "", "tool_calls": [{
            "id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}]}
    if kind == "function_call_output" and all(isinstance(item.get(k), str) for k in
                                              ("call_id", "output")):
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    if kind != "message":
        raise APIError(f"input items must be messages, function calls (call_id, name, arguments) "
                       f"or their outputs (call_id, output), got {item!r:.200}", "input")
    message = chat_message({"role": item.get("role"), "content": item.get("content")}, "input",
                           ("input_text", "output_text"), "input messages")
    return {"role": message["role"], "content": message["content"]}


def responses_prompt(req: ResponsesRequest) -> list[dict]:
    """A Responses request's one prompt, as chat_prompt's: the instructions, then the input."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError("input must be a text or a non-empty list of messages, got []", "input")
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    return [{"messages": system + [input_message(m) for m in items],
             "add_generation_prompt": True, "continue_final_message": False,
             "chat_template_kwargs": req.chat_template_kwargs, "tools": req.tools}]


def tokenize_prompts(req: TokenizeRequest) -> list:
    """A /tokenize request's one prompt: its text, or its conversation as chat_prompt's."""
    if (req.prompt is None) == (req.messages is None):
        raise APIError("prompt or messages must be given, not both nor neither", "prompt")
    return [req.prompt] if req.messages is None else chat_prompt(req)


def chat_chars(prompt: dict) -> int:
    return sum(len(m["content"]) for m in prompt["messages"])


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage_of(num_prompt: int, num_completion: int, num_cached: int | None = None) -> dict:
    """`num_cached` (--enable-prompt-tokens-details): the prompt tokens the prefix cache held."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion} | (
        {} if num_cached is None else {"prompt_tokens_details": {"cached_tokens": num_cached}})


def truncation(k: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: how many of a prompt's last tokens to keep (None: all)."""
    if k is None:
        return None
    if k == -1 or 1 <= k <= max_model_len:
        return max_model_len if k == -1 else k
    raise APIError(f"truncate_prompt_tokens must be -1 (the context), or in [1, {max_model_len}] "
                   f"(max_model_len), got {k}", "truncate_prompt_tokens")

