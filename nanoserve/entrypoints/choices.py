"""§4 ("process outputs") served: one HTTP request's engine requests, read as one (`Batch`: a
completions batch's prompts, else one), and each of its choices' answer so far (`Choice`), from
which the serving classes (serving_engine.py) write the answer or the streamed chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from nanoserve.entrypoints.engine_thread import Collector
from nanoserve.entrypoints.outputs import CompletionOutput
from nanoserve.layers.sampler import Logprob


@dataclass
class Choice:
    """One completion's answer so far (choices[index])."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_chars: int = 0  # of text already sent: where the next token's text starts
    echo: str = ""  # text before the first token's, until sent (a completion's `echo`: its prompt)
    error: str | None = None  # why, where finish_reason is "error"
    parser: Any = None  # reads the tool calls out of its text (chat's: tool_parser.py)
    reasoning: Any = None  # splits its text into reasoning and content (reasoning_parser.py)
    as_token_ids: bool = False  # logprobs' tokens as "token_id:N" (return_tokens_as_token_ids)
    prompt_ids: list[int] | None = None  # return_token_ids: its prompt's, sent in the first chunk
    token_ids: list[int] = field(default_factory=list)  # its tokens so far
    new_ids: list[int] = field(default_factory=list)  # the last output's
    sent_first: bool = False  # a (streamed) choice was written for it: prompt_ids are sent
    role: str = "assistant"  # chat's: the answer's

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, c: CompletionOutput) -> None:
        self.texts.append(c.text)
        self.new_ids = list(c.token_ids)
        self.token_ids += self.new_ids
        self.logprobs += c.logprobs or []
        self.finish_reason, self.stop_reason, self.error = c.finish_reason, c.stop_reason, c.error
        if self.reasoning is not None:  # each output as it comes, with its tokens
            self.reasoning.feed(c.text, c.finish_reason is not None, c.token_ids)


def shown(token: int, entry: Logprob, as_ids: bool) -> str:
    """A logprobs entry's token as the answer shows it: its text, or (vLLM's
    return_tokens_as_token_ids) "token_id:N"."""
    return f"token_id:{token}" if as_ids else entry.decoded_token


def num_reasoning(choices: list[Choice]) -> int | None:
    """The choices' reasoning tokens, where a reasoning parser read them (usage's)."""
    if not choices or any(c.reasoning is None for c in choices):
        return None
    return sum(c.reasoning.num_tokens for c in choices)


def choices_of(req: Any, inputs: list[tuple[Any, list[int]]], echoes: list[str],
               parser: Any, as_token_ids: bool = False, reasoning: Any = None,
               role: str = "assistant") -> list[Choice]:
    """A request's choices, `n` a prompt (`inputs`: each prompt's params and ids; `echoes`: the
    text each prompt's choices start with; `parser`: what makes a choice's tool-call parser;
    `as_token_ids`: the server's return_tokens_as_token_ids, where the request sets none;
    `reasoning`: what makes its reasoning parser; `role`: chat's answer's)."""
    as_ids = as_token_ids if req.return_tokens_as_token_ids is None else \
        req.return_tokens_as_token_ids
    return [Choice(echo=echo, parser=parser and parser(), as_token_ids=as_ids,
                   reasoning=reasoning and reasoning(), role=role,
                   prompt_ids=ids if req.return_token_ids else None)
            for echo, (_, ids) in zip(echoes, inputs) for _ in range(req.n)]


class Batch:
    """The engine requests of one HTTP request (a completions batch; else one), read as one: their
    collectors share a `ready` event, so the handler wakes for whichever has outputs."""

    def __init__(self, num_prompts: int) -> None:
        self.ready = asyncio.Event()
        self.collectors = [Collector(self.ready) for _ in range(num_prompts)]
        self.num_cached_tokens = 0  # the prefix cache's hit, summed over the finished prompts
        self.tasks: list[asyncio.Task] = []  # beam searches, whose rounds add the requests

    async def outputs(self, n: int) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """Each completion's outputs as they come, with its choice index (vLLM's: prompt i's
        completion j is i * n + j), until every request has finished."""
        live = set(range(len(self.collectors)))
        while live:
            await self.ready.wait()
            self.ready.clear()
            for i in sorted(live):
                for output in self.collectors[i].take():
                    for c in output.outputs:
                        yield i * n + c.index, c
                    if output.finished:
                        live.discard(i)
                        self.num_cached_tokens += output.num_cached_tokens
