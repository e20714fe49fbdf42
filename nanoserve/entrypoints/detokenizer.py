"""§4, "process outputs", for requests that arrive and leave while others run (a server): each
step's new token becomes new text, and stop strings end a request (vLLM's semantics).

Text is decoded incrementally (vLLM's prefix/read offsets): a token is decoded together with the
tokens since the last complete character, and text is only emitted once it no longer ends in
U+FFFD, so a multi-byte character split over tokens (an emoji, Vietnamese diacritics) comes out
whole. A stop string is searched for only where the new text can complete it; the text is cut
there (keeping the stop string if include_stop_str_in_output), as it leaves out the token that
stopped a request (EOS or one of stop_token_ids: vLLM's). While streaming, the last
max(len(stop)) - 1 characters are held back: they may be the start of a stop string."""

from __future__ import annotations

from nanoserve.engine.request import FinishReason, Request
from nanoserve.layers.sampler import Logprob
from nanoserve.sampling_params import RequestOutputKind, SamplingParams


class Detokenizer:
    """One per request, owned by the engine; `incremental` ones decode every step."""

    def __init__(self, tokenizer: object | None, params: SamplingParams) -> None:
        self.tokenizer = tokenizer  # None (skip_tokenizer_init): token ids only, text ""
        self.delta = params.output_kind == RequestOutputKind.DELTA
        self.incremental = self.delta or bool(params.stop)
        self.stop, self.include_stop = params.stop, params.include_stop_str_in_output
        self.stop_token_ids, self.skip_special = params.stop_token_ids, params.skip_special_tokens
        self.holdback = max(map(len, self.stop)) - 1 if self.stop and not self.include_stop else 0
        self.token_ids: list[int] = []  # the output tokens seen so far
        self.text = ""  # their text, cut at a stop string
        self.prefix_offset = self.read_offset = 0  # decode window: context, then unread tokens
        self.stop_reason: str | None = None  # the stop string that ended the request
        self.num_sent_tokens = self.num_sent_chars = 0  # what DELTA outputs already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def decode_logprobs(self, entries: list[dict[int, Logprob]]) -> list[dict[int, Logprob]]:
        """Each logprob's token as text, alone (vLLM's `decoded_token`)."""
        if self.tokenizer is not None:
            for entry in entries:
                for token, text in zip(entry, self.tokenizer.batch_decode([[t] for t in entry])):
                    entry[token].decoded_token = text
        return entries

    def update(self, req: Request) -> str | None:
        """Take `req`'s new output tokens; returns the stop string they completed, if any.
        A finished request's undecodable tail (an incomplete character) is flushed as is."""
        start = req.num_prompt_tokens + len(self.token_ids)
        new_ids = req.token_ids[start:]
        self.token_ids += new_ids
        if self.tokenizer is None or self.stop_reason is not None:
            return None
        end = len(self.token_ids) - self.stop_token_left_out(req)
        if not new_ids and not (req.is_finished and self.read_offset < end):
            return None
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:end])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not req.is_finished):
            return None  # nothing printable yet: wait for the rest of the character
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, end
        self.text += new_text
        return self._check_stop(len(new_text))

    def stop_token_left_out(self, req: Request) -> int:
        """1 where a token ended the request (not a stop string: it would be the stop_reason)
        and its text stays out, as vLLM's detokenizer leaves it; else 0."""
        return int(req.finish_reason == FinishReason.STOP and self.stop_reason is None
                   and not self.include_stop)

    def _check_stop(self, num_new_chars: int) -> str | None:
        """vLLM's: of the stop strings the new text completes, the one that ends first (as if
        its characters came one at a time; a tie: the one listed first)."""
        found = []  # (where it ends, its place in the list, where it starts)
        for order, stop in enumerate(self.stop):
            # Only where the new text can complete it: earlier text was checked before.
            start = max(0, len(self.text) - num_new_chars - len(stop) + 1)
            if (i := self.text.find(stop, start)) != -1:
                found.append((i + len(stop), order, i))
        if not found:
            return None
        end, order, i = min(found)
        self.text, self.stop_reason = self.text[:end if self.include_stop else i], self.stop[order]
        return self.stop_reason

    def output(self, req: Request) -> tuple[str, list[int], int | str | None]:
        """(text, token_ids, stop_reason) of the output `step()` returns now: everything for
        FINAL_ONLY, what is new since the last output for DELTA (holding back a possible
        stop string's start until the request finishes)."""
        if req.is_finished:
            self.update(req)  # an aborted request may have tokens not yet seen
        if not self.incremental:  # decoded once, at the end
            ids = req.output_token_ids[:len(req.output_token_ids) - self.stop_token_left_out(req)]
            text = self._decode(ids) if self.tokenizer is not None else ""
            self.text, self.token_ids = text, req.output_token_ids
        stop_reason = self.stop_reason
        if (stop_reason is None and req.finish_reason == FinishReason.STOP
                and self.token_ids and self.token_ids[-1] in self.stop_token_ids):
            stop_reason = self.token_ids[-1]  # vLLM: the stop token id (None for EOS)
        if not self.delta:
            return self.text, self.token_ids, stop_reason
        end = len(self.text) if req.is_finished else len(self.text) - self.holdback
        end = max(end, self.num_sent_chars)
        text, self.num_sent_chars = self.text[self.num_sent_chars:end], end
        ids, self.num_sent_tokens = self.token_ids[self.num_sent_tokens:], len(self.token_ids)
        return text, ids, stop_reason
