"""POST /v1/completions (vLLM's OpenAIServingCompletion): a text or token-id prompt, the answer's
choices as text (with `echo`, the prompt's text first), and `logprobs` as the legacy completions
API shapes them."""

from __future__ import annotations

from typing import Any

from nanoserve import SamplingParams
from nanoserve.entrypoints.choices import Choice, shown
from nanoserve.entrypoints.protocol import APIError, CompletionRequest
from nanoserve.entrypoints.serving_engine import OpenAIServing
from nanoserve.entrypoints.validation import COMPLETION
from nanoserve.layers.sampler import Logprob


class OpenAIServingCompletion(OpenAIServing):
    endpoint = COMPLETION  # the prompt: text or token ids, or a batch of those (protocol.py)
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def tokenize(self, tokenizer: Any, prompt: Any, req: CompletionRequest) -> list[int]:
        """Token ids pass through (the engine checks their range)."""
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
        return prompt

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
        if choice.prompt_ids is not None:  # return_token_ids: the prompt's in the first chunk
            first, choice.sent_first = not choice.sent_first, True  # (and with `echo`, its
            echoed = choice.prompt_ids if first and choice.echo else []  # ids before the tokens')
            out |= {"prompt_token_ids": choice.prompt_ids if first else None,
                    "token_ids": echoed + (choice.new_ids if delta else choice.token_ids)}
        return out if delta else {**out, "prompt_logprobs": None}

    def logprobs(self, entries: list[dict[int, Logprob]], offset: int, num: int,
                 as_ids: bool = False) -> dict:
        """Each token's text, logprob and offset (in the text, whatever as_ids shows), and its
        top `num` (the sampled one too)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            sampled = next(iter(entry.values()))  # the sampled token comes first
            tokens.append(shown(next(iter(entry)), sampled, as_ids))
            token_logprobs.append(max(sampled.logprob, -9999.0))
            top_logprobs.append({shown(t, e, as_ids): max(e.logprob, -9999.0)
                                 for t, e in entry.items()})
            offsets.append(offset)
            offset += len(sampled.decoded_token)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top_logprobs}
