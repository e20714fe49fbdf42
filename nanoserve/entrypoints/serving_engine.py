"""§3-§4 served: what the completions, chat and Responses endpoints share (vLLM's OpenAIServing).
A request is checked, tokenized on the tokenizer thread, handed to the engine thread, and
answered whole or as server-sent events; `n` completions come back as choices 0..n-1 (a
completions batch: those of prompt i as i * n ...; choices.py gathers them). A client that
disconnects, streaming or not, aborts its requests: their KV blocks are free at the next step.
The subclasses (serving_completion.py, serving_chat.py, serving_responses.py) say only what
differs: the prompt and the shapes."""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from nanoserve import SamplingParams
from nanoserve.entrypoints.choices import Batch, Choice, choices_of, num_reasoning
from nanoserve.entrypoints.cli_args import ServingOptions
from nanoserve.entrypoints.engine_thread import EngineThread
from nanoserve.entrypoints.generation_config import request_params
from nanoserve.entrypoints.protocol import (
    APIError,
    StreamOptions,
    check_model,
    error_event,
    param_of,
    sse,
    truncation,
    usage_of,
)
from nanoserve.entrypoints.reasoning_parser import end_token_id
from nanoserve.entrypoints.serving_beam_search import beam_search_params, start_beam_searches
from nanoserve.entrypoints.tokenizer_pool import TokenizerPool
from nanoserve.entrypoints.validation import (
    Endpoint,
    check_max_tokens,
    check_prompt_ids,
    check_prompt_length,
    check_request,
    refusal,
)
from nanoserve.layers.sampler import Logprob


class OpenAIServing:
    endpoint: Endpoint  # its request, prompt and checks (validation.py)
    object_name: str  # the response's "object"
    chunk_object: str  # a streamed chunk's
    id_prefix: str

    def __init__(self, engine: EngineThread, model_names: list[str], tokenizers: TokenizerPool,
                 longest_token: int, options: ServingOptions | None = None) -> None:
        self.engine, self.model_names, self.tokenizers = engine, model_names, tokenizers
        self.model_name = model_names[0]  # the one answers carry, whichever was asked (vLLM's)
        self.options = options or ServingOptions()
        self.end_id = end_token_id(engine.llm.tokenizer) if self.options.reasoning_parser else None
        self.longest_token = longest_token  # characters (validation.longest_token)
        self.max_model_len = engine.llm.config.max_model_len
        self.max_logprobs = engine.llm.processor.max_logprobs  # --max-logprobs

    # -- what the endpoints define -------------------------------------------------------

    def tokenize(self, tokenizer: Any, prompt: Any, req: Any) -> list[int]:
        """On a tokenizer thread, with that thread's tokenizer."""
        raise NotImplementedError

    def max_tokens_of(self, req: Any) -> int | None:
        return req.max_tokens

    def num_logprobs_of(self, req: Any) -> int | None:
        raise NotImplementedError

    def choice(self, index: int, choice: Choice, text: str, logprobs: list | None,
               delta: bool) -> dict:
        """A choice of the answer, or (delta) of a streamed chunk, with this text."""
        raise NotImplementedError

    def logprobs(self, entries: list[dict[int, Logprob]], offset: int, num: int,
                 as_ids: bool = False) -> dict:
        """The choice's "logprobs" for these tokens (their text starts at char `offset`); as_ids:
        each token shown as "token_id:N" (vLLM's return_tokens_as_token_ids)."""
        raise NotImplementedError

    def tool_parser_of(self, req: Any) -> Callable[[], Any] | None:
        """What reads a choice's tool calls (chat's), or None; a 400 for tools it cannot take."""
        return None

    def reasoning_parser_of(self, req: Any) -> Callable[[], Any] | None:
        """What splits a choice's reasoning from its content (chat's), or None."""
        return None

    def role_of(self, req: Any) -> str:
        return "assistant"

    def first_chunks(self, head: dict, choices: list[Choice]) -> list[dict]:
        return []

    def prompt_fields(self, choices: list[Choice]) -> dict:
        """What the answer (and the first chunk) says of the prompt beside its choices."""
        return {}

    async def echoes(self, req: Any, inputs: list[tuple[SamplingParams, list[int]]]
                     ) -> list[str]:
        """Each prompt's text to put before its completions' (completions' `echo`)."""
        return [""] * len(inputs)

    # -- what they share -------------------------------------------------------------------

    async def create(self, body: dict) -> Response:
        """Check, hand the request to the engine, answer. Raises APIError."""
        req = check_request(body, self.endpoint)
        parser = self.tool_parser_of(req)  # chat's tool calls, or None
        inputs = await self.to_engine_inputs(req)
        batch, streaming, head = Batch(len(inputs)), False, self.head(req)
        if self.options.log_requests:  # vLLM's --enable-log-requests: a line a prompt
            for i, (params, prompt_ids) in enumerate(inputs):
                print(f"nanoserve: request {head['id']}-{i}: prompt_token_ids "
                      f"{prompt_ids[:self.options.max_log_len]}, {params}", file=sys.stderr)
        if searches := beam_search_params(req, inputs):
            start_beam_searches(self, batch, inputs, searches, req.priority)
        else:
            for collector, (params, prompt_ids) in zip(batch.collectors, inputs):
                self.engine.add(collector, prompt_ids, params, req.priority)
        params = inputs[0][0]  # the request's (its prompts' differ only in max_tokens)
        prompt_lens = [len(ids) for _, ids in inputs]
        try:
            for collector in batch.collectors:  # any refusal: a 400 (the others are aborted)
                if (error := await collector.accepted) is not None:
                    raise refusal(error, self.endpoint)
            # (once the engine took the token ids: their range is checked there)
            choices = choices_of(req, inputs, await self.echoes(req, inputs), parser,
                                 self.options.as_token_ids, self.reasoning_parser_of(req),
                                 self.role_of(req))
            if req.stream:
                streaming = True  # from here the stream's end aborts (also if never started)
                usage = StreamOptions(include_usage=True, continuous_usage_stats=True) if \
                    self.options.force_include_usage else req.stream_options or StreamOptions()
                return StreamingResponse(
                    self.stream(batch, head, choices, req.n, prompt_lens, usage,
                                params.logprobs),
                    media_type="text/event-stream",
                    background=BackgroundTask(self.abort, batch))
            async for index, c in batch.outputs(req.n):
                choices[index].add(c)
        finally:
            if not streaming:  # a no-op once finished; else the client is gone
                self.abort(batch)
        if any(c.finish_reason == "abort" for c in choices):  # not the client: it is here
            raise self.aborted()
        return JSONResponse(self.answer(head, choices, batch, sum(prompt_lens), params.logprobs))

    def head(self, req: Any) -> dict:
        """What the answer, and each streamed chunk, starts with."""
        return {"id": f"{self.id_prefix}-{req.request_id or uuid.uuid4().hex}",
                "object": self.object_name, "created": int(time.time()), "model": self.model_name}

    def answer(self, head: dict, choices: list[Choice], batch: Batch, num_prompt_tokens: int,
               num_logprobs: int | None) -> dict:
        """The whole answer, once every choice has finished."""
        return {**head, **self.prompt_fields(choices), "choices": [
            self.choice(i, c, c.echo + "".join(c.texts),
                        self.logprobs_or_none(c, c.logprobs, 0, num_logprobs), delta=False)
            for i, c in enumerate(choices)],
                "usage": usage_of(num_prompt_tokens, sum(c.num_tokens for c in choices),
                                  self.num_cached(batch), num_reasoning(choices))}

    def num_cached(self, batch: Batch) -> int | None:
        return batch.num_cached_tokens if self.options.prompt_tokens_details else None

    def abort(self, batch: Batch) -> None:
        for task in batch.tasks:
            task.cancel()
        for collector in batch.collectors:  # a no-op for one finished or never accepted
            self.engine.abort(collector)

    def aborted(self) -> APIError:
        """Why a request the client still waits for was aborted: shutdown, or a failed step."""
        if self.engine.expired:
            return APIError("the server is shutting down (--shutdown-timeout passed)", None, 503)
        return APIError("the engine failed while running the request", None, 500)

    def logprobs_or_none(self, choice: Choice, entries: list, offset: int, num: int | None
                         ) -> dict | None:
        return None if num is None else self.logprobs(entries, offset, num, choice.as_token_ids)

    async def to_engine_inputs(self, req: Any) -> list[tuple[SamplingParams, list[int]]]:
        """Each prompt's params and token ids. Every check that costs little first, on the event
        loop (the request's fields once, each prompt's length); then the tokenizer."""
        check_model(req.model, self.model_names)
        if req.priority != 0 and self.engine.llm.config.scheduling_policy != "priority":
            raise APIError(f"priority must be 0 unless the server runs --scheduling-policy "
                           f"priority (vLLM's rule), got {req.priority}", "priority")
        max_tokens = self.max_tokens_of(req)
        # what the request leaves unset: the model's recommended (generation_config.py), else
        # SamplingParams' own defaults
        defaults = dict(self.engine.llm.sampling_defaults)
        most = defaults.pop("max_tokens", None)  # with max_tokens unset: at most this many
        try:  # max_tokens is set once the prompt's length is known (below)
            params = request_params(req, defaults, 1 if max_tokens is None else max_tokens,
                                    self.num_logprobs_of(req))
        except ValueError as e:
            engine_fields = {f.name for f in dataclasses.fields(SamplingParams)}
            field_name = param_of(str(e), set(type(req).model_fields) | engine_fields,
                                  self.endpoint.prompt_field)
            name, message = self.wire_name(field_name, req), str(e)
            if field_name and name != field_name and message.startswith(field_name + " "):
                message = name + message[len(field_name):]  # the field as the client sent it
            raise APIError(message, name) from None
        check_max_tokens(max_tokens, self.max_model_len, self.wire_name("max_tokens", req))
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            name = self.wire_name("logprobs", req)
            raise APIError(f"{name} must be at most {self.max_logprobs} (--max-logprobs), got "
                           f"{params.logprobs}", name)
        # vLLM's get_max_tokens: the least of the prompt's room, what the request asks for (or
        # the model's default) and --generation-config's cap on any (ServingOptions)
        limits = (most if max_tokens is None else max_tokens, self.options.max_tokens_cap)
        prompts = [(p, self.endpoint.num_chars(p)) for p in self.endpoint.prompts_of(req)]
        keep = truncation(req.truncate_prompt_tokens, self.max_model_len)
        for _, num_chars in prompts * (keep is None):  # (a truncated text may be longer)
            check_prompt_length(self.endpoint, num_chars, self.longest_token, self.max_model_len)
        inputs = []
        for prompt, num_chars in prompts:
            ids = await self.tokenizers.run(lambda tokenizer, prompt: self.tokenize(
                tokenizer, prompt, req), prompt, num_chars)
            if keep is not None:  # vLLM's truncation_side: "left" (None) drops the first tokens
                ids = ids[:keep] if req.truncation_side == "right" else ids[-keep:]
            check_prompt_ids(self.endpoint, len(ids), self.max_model_len)
            room = self.max_model_len - len(ids)
            most_now = min(n for n in (room, *limits) if n is not None)
            inputs.append((dataclasses.replace(params, max_tokens=most_now), ids))
        return inputs

    def wire_name(self, field_name: str | None, req: Any) -> str | None:
        """The request's name for an engine field (chat's top N is `top_logprobs`)."""
        return field_name

    async def stream(self, batch: Batch, head: dict, choices: list[Choice], n: int,
                     prompt_lens: list[int], options: StreamOptions, num_logprobs: int | None):
        """Server-sent events as vLLM sends them; closing it (a disconnect) aborts."""
        head = {**head, "object": self.chunk_object}
        # vLLM's continuous_usage_stats: every chunk also says its choice's usage so far (the
        # prompt's tokens are its own prompt's, in a batch)
        every = options.include_usage and options.continuous_usage_stats
        try:
            for i, chunk in enumerate(self.first_chunks(head, choices)):
                yield sse({**chunk, "usage": usage_of(prompt_lens[i // n], 0)} if every
                          else chunk)
            async for index, c in batch.outputs(n):
                choice, start = choices[index], len(choices[index].logprobs)
                choice.add(c)
                if c.text or c.token_ids or c.finish_reason:
                    text = choice.echo + c.text  # the echo with the first (cleared below)
                    logprobs = self.logprobs_or_none(choice, choice.logprobs[start:],
                                                     choice.num_chars, num_logprobs)
                    yield sse({**head, "choices": [
                        self.choice(index, choice, text, logprobs, delta=True)], **({"usage":
                        usage_of(prompt_lens[index // n], choice.num_tokens, None,
                                 num_reasoning([choice]))} if every else {})})
                    choice.num_chars, choice.echo = choice.num_chars + len(text), ""
            if any(c.finish_reason == "abort" for c in choices):  # shutdown or a failed step
                error = self.aborted()
                yield error_event(error.message, error.code)
            elif options.include_usage:  # vLLM's bench client reads it from a choice-less chunk
                yield sse({**head, "choices": [], "usage": usage_of(
                    sum(prompt_lens), sum(c.num_tokens for c in choices), self.num_cached(batch),
                    num_reasoning(choices))})
            yield "data: [DONE]\n\n"
        finally:
            self.abort(batch)
