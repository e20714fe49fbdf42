"""POST /v1/completions (vLLM's OpenAIServingCompletion): a text or token-id prompt, the answer's
choices as text (with `echo`, the prompt's text first), and `logprobs` as the legacy completions
API shapes them."""

from __future__ import annotations

from typing import Any

from nanoserve import SamplingParams
from nanoserve.entrypoints.choices import Choice
from nanoserve.entrypoints.protocol import APIError, CompletionRequest
from nanoserve.entrypoints.serving_engine import OpenAIServing
from nanoserve.entrypoints.validation import COMPLETION
from nanoserve.layers.sampler import Logprob


class OpenAIServingCompletion(OpenAIServing):
    endpoint = COMPLETION  # the prompt: text or token ids, or a batch of those (protocol.py)
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def tokenize(self, tokenizer: Any, prompt: Any) -> list[int]:
        """Token ids pass through (the engine checks their range)."""
        return tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

    def num_logprobs_of(self, req: CompletionRequest) -> int | None:
        if req.echo and req.logprobs is not None:  # vLLM's would hold the prompt's logprobs
            raise APIError("echo with logprobs needs the prompt's logprobs, which nanoserve "
                           "does not compute", "echo")
        return req.logprobs

    async def echoes(self, req: CompletionRequest, inputs: list[tuple[SamplingParams, list[int]]]
                     ) -> list[str]:
        """The prompts' texts (token ids decoded, on a tokenizer thread), if echo."""
        if not req.echo:
            return [""] * len(inputs)
        return [prompt if isinstance(prompt, str) else await self.tokenizers.run(
            lambda tokenizer, ids: tokenizer.decode(ids), ids, len(ids))
            for prompt, (_, ids) in zip(self.endpoint.prompts_of(req), inputs)]

    def choice(self, index: int, choice: Choice, text: str, logprobs: dict | None,
               delta: bool) -> dict:
        out = {"index": index, "text": text, "logprobs": logprobs,
               "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
        return out if delta else {**out, "prompt_logprobs": None}

    def logprobs(self, entries: list[dict[int, Logprob]], offset: int, num: int) -> dict:
        """Each token's text, logprob and offset, and its top `num` (the sampled one too)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            sampled = next(iter(entry.values()))  # the sampled token comes first
            tokens.append(sampled.decoded_token)
            token_logprobs.append(max(sampled.logprob, -9999.0))
            top_logprobs.append({e.decoded_token: max(e.logprob, -9999.0)
                                 for e in entry.values()})
            offsets.append(offset)
            offset += len(sampled.decoded_token)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top_logprobs}
