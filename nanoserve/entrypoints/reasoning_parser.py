"""Reasoning in a chat answer (vLLM's `--reasoning-parser deepseek_r1 | qwen3`): a thinking model
writes its reasoning first and closes it with </think> (its chat template may already have opened
the <think>), then the answer. The text is read here into the message's `reasoning` and its
`content`, as it comes: streamed, text that may be the start of a tag is held back until it is
known not to be. As vLLM's: an answer that never closes its reasoning is all reasoning; a
<think> inside the reasoning is dropped; with qwen3, a request whose chat template was asked not
to think (`enable_thinking: false`, or `reasoning_effort: "none"`) is all content. The tags are
found in the text, so a tokenizer need not hold them as single tokens (vLLM's must)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # --reasoning-parser's choices


class ReasoningParser:
    """One choice's answer, fed in pieces: `feed` returns the piece's reasoning and content;
    `final=True` with the last piece (a held-back tag's start is text after all)."""

    def __init__(self, thinking: bool = True, end_id: int | None = None,
                 shown: bool = True) -> None:
        self.in_reasoning = thinking  # until the </think>
        self.shown = shown  # False (include_reasoning false): the answer leaves it out
        self.end_id = end_id  # </think>'s token id, where the tokenizer holds it as one
        self.buffer = ""  # held back: may be a tag's start
        self.reasoning: list[str] = []  # all of it so far, and the content's
        self.content: list[str] = []
        self.num_tokens = 0  # output tokens up to the one that closed the reasoning
        self.last = ("", "")  # the last piece's (reasoning, content)

    def feed(self, text: str, final: bool = False, token_ids: list[int] = ()
             ) -> tuple[str, str]:
        if not self.in_reasoning:
            self.last = ("", text)
        else:  # its tokens count as reasoning: those up to the </think> token where it has one
            ids = list(token_ids)
            self.num_tokens += ids.index(self.end_id) + 1 if self.end_id in ids else len(ids)
            self.buffer += text
            i = self.buffer.find(END)
            if i >= 0:
                reasoning, content, self.buffer = self.buffer[:i], self.buffer[i + len(END):], ""
                self.in_reasoning = False
            else:
                keep = 0 if final else max(_partial(self.buffer, START), _partial(self.buffer, END))
                reasoning, content = self.buffer[:len(self.buffer) - keep], ""
                self.buffer = self.buffer[len(self.buffer) - keep:]
            self.last = (reasoning.replace(START, ""), content)
        self.reasoning.append(self.last[0])
        self.content.append(self.last[1])
        return self.last

    def whole(self) -> tuple[str | None, str]:
        """The answer's reasoning (None where it has none) and content, so far."""
        return "".join(self.reasoning) or None, "".join(self.content)


def _partial(text: str, tag: str) -> int:
    """How many of `text`'s last characters are `tag`'s first ones."""
    return next((k for k in range(min(len(text), len(tag) - 1), 0, -1)
                 if tag.startswith(text[-k:])), 0)


def end_token_id(tokenizer: Any) -> int | None:
    """</think>'s id where the tokenizer holds it as one token (thinking models' do)."""
    return None if tokenizer is None else tokenizer.get_vocab().get(END)


def reasoning_parser_for(name: str | None, template_kwargs: dict | None, end_id: int | None,
                         shown: bool = True) -> Callable[[], ReasoningParser] | None:
    """What makes each choice's parser (None: the server reads no reasoning). qwen3 starts in
    the answer where the template was told not to think (its own default: thinking)."""
    if name is None:
        return None
    thinking = name != "qwen3" or (template_kwargs or {}).get("enable_thinking", True) is not False
    return lambda: ReasoningParser(thinking, end_id, shown)
