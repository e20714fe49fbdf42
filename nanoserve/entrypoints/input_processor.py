"""From a user's prompt to the chapter's `Request`s (§3: a request is its prompt's token ids and
its sampling parameters), as vLLM V1's `InputProcessor` does for its `LLM`: the prompt tokenized
and checked against the vocabulary, max_model_len and the whole KV cache, the params checked and
copied, `n` > 1 made into n children (parallel_sampling.py). All of it before any engine state
changes, so a bad prompt in a batch leaves the others unqueued and the engine as it was."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.request import Request
from nanoserve.entrypoints.prompts import Prompt, prompt_tokens
from nanoserve.sampling_params import SamplingParams
from nanoserve.utils import as_token_id, is_int


class InputProcessor:
    def __init__(self, engine: LLMEngine, tokenizer: Any) -> None:
        self.tokenizer, self.config, self.vocab_size = tokenizer, engine.config, engine.vocab_size
        self.block_manager = engine.scheduler.block_manager
        most = engine.config.max_logprobs  # the most a request may ask for (-1: the vocabulary)
        self.max_logprobs = self.vocab_size if most == -1 else most
        self.eos_token_ids = eos_token_ids(engine.hf_config, tokenizer, engine.model_dir)
        self._ids = itertools.count()

    def make_requests(self, prompt: Prompt, params: SamplingParams,
                      priority: int) -> list[Request]:
        """Validate everything and build the Request (n > 1: its n children); changes no engine
        state."""
        token_ids, text = prompt_tokens(prompt, self.tokenizer)
        self.check_prompt(token_ids)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        params = copy.deepcopy(params)  # ours: the user's later changes have no effect
        params.validate()
        if params.logprobs is not None and params.logprobs > self.max_logprobs:  # vLLM's rule
            raise ValueError(f"logprobs must be None or an integer in [0, {self.max_logprobs}] "
                             f"(max_logprobs), got {params.logprobs}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is True)")
        if not is_int(priority):
            raise ValueError(f"priority must be an int, got {priority!r}")
        request_id = str(next(self._ids))
        children = [dataclasses.replace(params, n=1, seed=None if params.seed is None else
                                        (params.seed + i) % 2**64) for i in range(params.n)]
        return [Request(request_id if params.n == 1 else f"{i}_{request_id}", token_ids, child,
                        self.eos_token_ids, priority=priority, prompt=text,
                        generator=self.generator(child.seed)) for i, child in enumerate(children)]

    def make_batch(self, prompts: Prompt | Sequence[Prompt],
                   sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                   priority: int | Sequence[int] | None, default: SamplingParams,
                   ) -> list[list[Request]]:
        """`LLM.generate`'s arguments -> each prompt's Requests, all checked first: one prompt
        or a list; one params (None: `default`) for all or one a prompt; the same for priority."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and None not in map(as_token_id, prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a str, a list of token ids, a prompt dict or a "
                             f"list of those, got {type(prompts).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or default] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries but there are "
                                 f"{len(prompts)} prompts")
        if priority is None or is_int(priority):  # vLLM's: one int for every prompt
            priority = [priority or 0] * len(prompts)
        if not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise ValueError(f"priority must be an int or a list of one a prompt ({len(prompts)}), "
                             f"got {priority!r:.100}")
        return [self.make_requests(*args) for args in zip(prompts, params, priority)]

    def check_prompt(self, token_ids: list[int]) -> None:
        """A ValueError unless these ids can run here: in the vocabulary, within max_model_len,
        and with one generated token within the whole KV cache."""
        vocab, bm = self.vocab_size, self.block_manager
        if not token_ids:
            raise ValueError("prompt must have at least 1 token, got 0")
        if bad := [t for t in token_ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        if len(token_ids) >= self.config.max_model_len:  # vLLM's: no room for one token
            raise ValueError(f"prompt has {len(token_ids)} tokens: with one generated token, "
                             f"more than max_model_len ({self.config.max_model_len})")
        if (needed := bm.blocks_needed(len(token_ids) + 1)) > bm.num_blocks:
            raise ValueError(f"prompt has {len(token_ids)} tokens: with one generated token it "
                             f"needs {needed} KV blocks, but the whole KV cache has "
                             f"{bm.num_blocks} (num_kv_blocks) of {bm.block_size} tokens")

    def generator(self, seed: int | None) -> torch.Generator | None:
        """A seeded request's own generator, on the device its tokens are sampled on."""
        return None if seed is None else torch.Generator(self.config.device).manual_seed(seed)


def eos_token_ids(hf_config: Any, tokenizer: Any, model_dir: str) -> frozenset[int]:
    """Every id that ends a request: the model config's, the tokenizer's (None without one) and
    generation_config.json's (a list in Llama 3's)."""
    ids = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    with contextlib.suppress(OSError):  # no generation_config.json
        ids.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    return frozenset(i for x in ids for i in (x if isinstance(x, list) else [x])) - {None}
