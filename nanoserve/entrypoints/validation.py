"""The server's checks on a request body before anything costly is done with it: each failure is
an APIError, a 400 naming the field (protocol.py's shape), never a 500 and never silence.

- The JSON itself: nesting depth, and strings that cannot be UTF-8 (a lone surrogate such as
  "\\ud800" is valid JSON but no tokenizer or response can take it).
- Fields vLLM or OpenAI define that nanoserve cannot honour (logit_bias, min_p, ...): accepted
  only at their no-op values, else a 400 naming them; a field that changes results must never
  be ignored. Fields nobody defines are still ignored, as in vLLM.
- The types: numbers are numbers (not bools, not strings), token ids are integers (pydantic's
  strict mode), with the field named.
- `stop` and `stop_token_ids` capped: the engine thread checks them at every token.
- A text prompt that cannot fit max_model_len, rejected from its length before it is tokenized
  (`fewest_tokens`: a sound lower bound on its token count).

Nothing here imports torch: body_checker.py's helper process runs these checks too (`Endpoint`:
what they need to know of each endpoint)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from nanoserve.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    ShuttingDown,
    TokenizeRequest,
    param_of,
)
from nanoserve.entrypoints.request_prompts import (
    chat_chars,
    chat_prompt,
    completion_chars,
    completion_prompts,
    responses_prompt,
    tokenize_prompts,
)

MAX_DEPTH = 32  # JSON nesting: a chat message with content parts needs 5
MAX_STOP_STRINGS, MAX_STOP_CHARS = 32, 4096  # OpenAI allows 4 stop strings; vLLM any number
MAX_STOP_TOKEN_IDS = 256

# field -> its values that change nothing. Anything else is a 400 naming the field.
NO_OP = {"logit_bias": (None, {}), "min_tokens": (None, 0), "min_p": (None, 0, 0.0),
         "repetition_penalty": (None, 1, 1.0), "presence_penalty": (None, 0, 0.0),
         "frequency_penalty": (None, 0, 0.0),
         "best_of": (None, 1),
         "spaces_between_special_tokens": (None, True),
         "prompt_logprobs": (None,),
         "allowed_token_ids": (None,), "bad_words": (None, []),
         "response_format": (None, {"type": "text"}), "guided_json": (None,),
         "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
         "structured_outputs": (None,), "prompt_embeds": (None,), "logprob_token_ids": (None, []),
         "repetition_detection": (None,), "thinking_token_budget": (None, -1),
         "watermarking": (None, False), "cache_salt": (None,)}
NO_OP_COMPLETION = {**NO_OP, "suffix": (None, "")}
NO_OP_CHAT = {**NO_OP, "functions": (None, []), "function_call": (None, "none", "auto"),
              "chat_template": (None,), "echo": (None, False),
              "documents": (None,), "modalities": (None, ["text"]),
              "return_prompt_text": (None, False)}

# /v1/responses: one answer, text only, nothing stored to continue from
NO_OP_RESPONSES = {**NO_OP, "n": (None, 1), "use_beam_search": (None, False),
                   "length_penalty": (None, 1, 1.0), "truncate_prompt_tokens": (None,),
                   "previous_response_id": (None,),
                   "background": (None, False), "prompt": (None,),
                   "text": (None, {"format": {"type": "text"}}), "truncation": (None, "disabled"),
                   "conversation": (None,), "previous_response": (None,),
                   "truncation_side": (None,), "return_token_ids": (None, False),
                   "return_tokens_as_token_ids": (None, False), "max_tool_calls": (None,),
                   "previous_input_messages": (None,), "enable_response_messages": (None, False)}


@dataclass(frozen=True)
class Endpoint:
    """What the checks need to know of an endpoint (its serving class's `endpoint`)."""

    request_model: type[BaseModel]
    prompt_field: str  # the request's field that holds the prompt
    no_op: dict[str, tuple]  # fields nanoserve cannot honour, and their values that change nothing
    prompts_of: Callable[[Any], list]  # the request's prompts, each as the tokenizer takes it
    num_chars: Callable[[Any], int]  # the characters of its text (0 for token ids)


COMPLETION = Endpoint(CompletionRequest, "prompt", NO_OP_COMPLETION, completion_prompts,
                      completion_chars)
CHAT = Endpoint(ChatCompletionRequest, "messages", NO_OP_CHAT, chat_prompt, chat_chars)
RESPONSES = Endpoint(ResponsesRequest, "input", NO_OP_RESPONSES, responses_prompt, chat_chars)
# /tokenize and /detokenize: no length bound (a text need not fit the context to be counted)
TOKENIZE = Endpoint(TokenizeRequest, "prompt", {"chat_template": (None,)},
                    tokenize_prompts, lambda prompt: 0)
DETOKENIZE = Endpoint(DetokenizeRequest, "tokens", {}, lambda req: [], lambda prompt: 0)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only JSON escapes can make a surrogate


def parse_json(raw: bytes) -> dict:
    """The body's bytes as a JSON object, checked (check_json)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the body is not valid JSON: {e}") from None
    except RecursionError:  # deeper than the parser's stack: check_json's 400, sooner
        raise APIError(f"the body is nested more than {MAX_DEPTH} levels deep") from None
    if not isinstance(body, dict):
        raise APIError(f"the body must be a JSON object, got {type(body).__name__}")
    check_json(body, raw)
    return body


def check_json(body: dict, raw: bytes) -> None:
    """Depth, then UTF-8, each named by the top-level field the bad value sits under. This runs
    on the event loop, so `raw` (the body's bytes) says first, in C, whether to look at all:
    depth only if it has more brackets than MAX_DEPTH (then containers are walked level by
    level, without recursion), strings only if it has a surrogate's escape (then each field
    is encoded whole, in C)."""
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:  # else no value can be that deep
        _check_depth(body)
    if SURROGATE_ESCAPE.search(raw) is None:
        return
    for field, value in body.items():
        _check_utf8(field, None)  # a field with no name it can be called by
        _check_utf8(json.dumps(value, ensure_ascii=False), field)


def _check_depth(body: dict) -> None:
    for field, value in body.items():
        level, depth = [value], 1
        while level := [v for c in level if isinstance(c, (dict, list))
                        for v in (c.values() if isinstance(c, dict) else c)
                        if isinstance(v, (dict, list))]:
            depth += 1
            if depth > MAX_DEPTH:
                raise APIError(f"{field} is nested more than {MAX_DEPTH} levels deep", field)


def _check_utf8(s: str, field: str | None) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(f"{field or 'a field name'} has a string that is not valid Unicode (a "
                       f"lone surrogate)", field) from None


def check_no_ops(body: dict, no_op: dict[str, tuple]) -> None:
    for name, allowed in no_op.items():
        value = body.get(name)
        # `value in allowed` would let True pass as 1: compare the type too
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise APIError(f"{name} is not supported by nanoserve, got {value!r:.100}", name)


def parse(model: type[BaseModel], body: dict) -> Any:
    """The request as `model`, strict: true is not 1, "3" is not 3, 1.0 is not a token id."""
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(map(str, err["loc"][1:]))
        raise APIError(f"{field}: {err['msg']}{f' (at {where})' if where else ''}, got "
                       f"{err.get('input')!r:.100}", field) from None


def check_request(body: dict, endpoint: Endpoint) -> Any:
    """The parsed body's checks, in order, and the request as endpoint.request_model."""
    check_no_ops(body, endpoint.no_op)
    check_stop(body.get("stop"), body.get("stop_token_ids"))
    # vLLM's rule (and OpenAI's): usage options only for a stream; an empty {} passes, as there
    if endpoint in (COMPLETION, CHAT) and body.get("stream_options") and not body.get("stream"):
        raise APIError(f"stream_options can only be given with stream true, got stream "
                       f"{body.get('stream')!r:.20}", "stream_options")
    return parse(endpoint.request_model, body)


def check_stop(stop: Any, stop_token_ids: Any) -> None:
    """On the raw body, before pydantic copies a list that is too long (types checked later).
    The count first: the characters of 110,000 strings take 3 ms to add up (issue 38)."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    num_chars = 0 if len(stops) > MAX_STOP_STRINGS else sum(
        len(s) for s in stops if isinstance(s, str))
    if len(stops) > MAX_STOP_STRINGS or num_chars > MAX_STOP_CHARS:
        raise APIError(f"stop must be at most {MAX_STOP_STRINGS} strings of at most "
                       f"{MAX_STOP_CHARS} characters in all, got {len(stops)} strings"
                       f"{f' of {num_chars} characters' if num_chars else ''}", "stop")
    if isinstance(stop_token_ids, list) and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, got "
                       f"{len(stop_token_ids)}", "stop_token_ids")


def longest_token(tokenizer: Any) -> int:
    """The most characters of text one token can stand for. A vocabulary entry's string has a
    character per byte it encodes (byte-level BPE: GPT-2, Llama 3, SmolLM) or per character
    (SentencePiece, "▁" for a space; a byte-fallback "<0xE2>" stands for less than one), and a
    byte is at most one character: so no token covers more characters than its entry is long.
    (A normalizer that deletes characters would break this; these tokenizers have none.)"""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(t) for t in vocab if t is not None)


def fewest_tokens(num_chars: int, longest: int) -> int:
    """A lower bound on the tokens of a text of `num_chars` characters."""
    return -(-num_chars // longest)


def check_prompt_length(endpoint: Endpoint, num_chars: int, longest: int,
                        max_model_len: int) -> None:
    """A text that has too many tokens for the context whatever its tokens are: a 400."""
    if (fewest := fewest_tokens(num_chars, longest)) >= max_model_len:
        raise APIError(f"{endpoint.prompt_field} has {num_chars} characters, so at least "
                       f"{fewest} tokens: this model's maximum context length is "
                       f"{max_model_len} tokens", endpoint.prompt_field)


def check_max_tokens(max_tokens: int | None, max_model_len: int, name: str) -> None:
    """More tokens asked for than the context holds: a 400, as vLLM's. Fewer, but more than a
    prompt leaves room for, is no error in vLLM: the request gets the room (to_engine_inputs),
    finishing "length"."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise APIError(f"{name} is {max_tokens}, more than this model's maximum context length "
                       f"({max_model_len})", name)


def check_prompt_ids(endpoint: Endpoint, num_ids: int, max_model_len: int) -> None:
    """A tokenized prompt that leaves the context no room for a token: a 400."""
    if num_ids >= max_model_len:
        raise APIError(f"{endpoint.prompt_field} has {num_ids} tokens: this model's maximum "
                       f"context length is {max_model_len} tokens", endpoint.prompt_field)


def refusal(error: BaseException, endpoint: Endpoint) -> APIError:
    """What the engine thread's add raised, as the client's error."""
    if isinstance(error, ShuttingDown):
        return APIError("the server is shutting down", None, 503)
    if not isinstance(error, ValueError):
        return APIError(f"the engine failed to add the request: {error!r}", None, 500)
    fields = set(endpoint.request_model.model_fields)
    return APIError(str(error), param_of(str(error), fields, endpoint.prompt_field))
