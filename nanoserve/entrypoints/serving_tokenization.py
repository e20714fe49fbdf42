"""POST /tokenize and POST /detokenize (vLLM's OpenAIServingTokenization): a prompt, or a
conversation through the chat template, as the token ids the engine would be given (§3: the
engine only ever sees ids), and ids back as text. Both run on the tokenizer threads; neither
reaches the engine thread, so counting a prompt's tokens costs the running requests nothing."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response

from nanoserve.entrypoints.protocol import APIError, DetokenizeRequest, TokenizeRequest, check_model
from nanoserve.entrypoints.request_prompts import chat_chars
from nanoserve.entrypoints.serving_chat import render
from nanoserve.entrypoints.tokenizer_pool import TokenizerPool
from nanoserve.entrypoints.validation import DETOKENIZE, TOKENIZE, check_request


class OpenAIServingTokenization:
    def __init__(self, model_names: list[str], tokenizers: TokenizerPool, max_model_len: int,
                 vocab_size: int, template_defaults: dict | None = None) -> None:
        self.model_names, self.tokenizers = model_names, tokenizers
        self.max_model_len, self.vocab_size = max_model_len, vocab_size  # the tokenizer's
        self.template_defaults = template_defaults or {}  # --default-chat-template-kwargs

    async def tokenize(self, body: dict) -> Response:
        """{"count", "max_model_len", "tokens", "token_strs"} (strs only if asked for)."""
        req = check_request(body, TOKENIZE)
        check_model(req.model, self.model_names)
        [prompt] = TOKENIZE.prompts_of(req)
        if isinstance(prompt, dict):  # as chat renders it: the request's options over these
            prompt["chat_template_kwargs"] = {**self.template_defaults,
                                              **(prompt["chat_template_kwargs"] or {})}
        num_chars = len(prompt) if isinstance(prompt, str) else chat_chars(prompt)
        ids, strs = await self.tokenizers.run(
            lambda tokenizer, prompt: self._tokenize(tokenizer, prompt, req), prompt, num_chars)
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @staticmethod
    def _tokenize(tokenizer: Any, prompt: str | dict, req: TokenizeRequest
                  ) -> tuple[list[int], list[str] | None]:
        """As the completions endpoint encodes a text (special tokens added), and the chat
        endpoint a conversation (rendered, then encoded without them): vLLM's defaults; the
        request's add_special_tokens overrides either."""
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            rendered = render(tokenizer, prompt)
            ids = (tokenizer.encode(rendered["prompt"]) if req.add_special_tokens
                   else rendered["prompt_token_ids"])
        return ids, tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None

    async def detokenize(self, body: dict) -> Response:
        """{"prompt": the ids' text}, special tokens included (vLLM's)."""
        req: DetokenizeRequest = check_request(body, DETOKENIZE)
        check_model(req.model, self.model_names)
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"tokens must be token ids in [0, {self.vocab_size}), got {bad}",
                           "tokens")
        text = await self.tokenizers.run(lambda tokenizer, ids: tokenizer.decode(ids),
                                         req.tokens, len(req.tokens))
        return JSONResponse({"prompt": text})
