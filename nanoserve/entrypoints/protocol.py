"""The wire side of the server: vLLM's request fields and defaults (entrypoints/openai/protocol.py),
its error shape and its server-sent events (a request's prompts: request_prompts.py)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator

MAX_PROMPTS = 128  # prompts in one completions request (a batch; vLLM sets no limit), and
# completions in one (prompts x n): one small body may not queue more requests than n alone could


class ShuttingDown(Exception):
    """An add after the engine thread's expire(): past --shutdown-timeout (a 503)."""


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
    skip_special_tokens: bool = True  # False: <|im_end|> and the like stay in the text
    ignore_eos: bool = False
    n: int = 1
    stream: bool | None = False
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
    max_tokens: int = 16  # null too (vLLM's normalize_null_max_tokens)
    logprobs: int | None = None  # the top N per token (0: the sampled token's only)
    echo: bool | None = False
    add_special_tokens: bool = True  # the tokenizer's (a BOS, for some), as vLLM's

    @field_validator("max_tokens", mode="before")
    @classmethod
    def null_max_tokens(cls, value: Any) -> Any:
        return 16 if value is None else value


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # the chat template's options, as vLLM takes them
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # shown to the model by the chat template
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, else "none"
    add_special_tokens: bool = False  # on the rendered text: the template writes them
    reasoning_effort: Effort | None = None  # to the chat template (chat_prompt)
    include_reasoning: bool = True  # False: --reasoning-parser's reasoning left out


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
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: chat's reasoning_effort
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


def check_model(requested: str | None, served: list[str]) -> None:
    """vLLM's: any of the served names (--served-model-name), or none given ("" too)."""
    if requested and requested not in served:
        raise APIError(f"The model `{requested}` does not exist.", "model", 404)


def param_of(message: str, fields: set[str], prompt_field: str) -> str | None:
    """The request field an engine ValueError names (its messages start with the field)."""
    word = re.match(r"\w+", message)
    word = word and word.group()
    return prompt_field if word == "prompt" else word if word in fields else None


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage_of(num_prompt: int, num_completion: int, num_cached: int | None = None,
             num_reasoning: int | None = None) -> dict:
    """`num_cached` (--enable-prompt-tokens-details): the prompt tokens the prefix cache held;
    `num_reasoning` (--reasoning-parser): the completion's tokens that were reasoning."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion} | (
        {} if num_cached is None else {"prompt_tokens_details": {"cached_tokens": num_cached}}) | (
        {} if num_reasoning is None else
        {"completion_tokens_details": {"reasoning_tokens": num_reasoning}})


def truncation(k: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: how many of a prompt's last tokens to keep (None: all)."""
    if k is None:
        return None
    if k == -1 or 1 <= k <= max_model_len:
        return max_model_len if k == -1 else k
    raise APIError(f"truncate_prompt_tokens must be -1 (the context), or in [1, {max_model_len}] "
                   f"(max_model_len), got {k}", "truncate_prompt_tokens")

