"""Where prompts are tokenized: off the event loop and off the engine thread, in two lanes. A long
text (up to max_model_len × the longest token in characters: ~0.7 s for SmolLM2 at 8192) must not
queue the short ones behind it, so prompts over LONG_CHARS characters get a thread (and a copy
of the tokenizer: an HF tokenizer is not to be shared between threads) of their own. HF's Rust
encoder releases the GIL, so neither lane stalls the event loop or the engine thread."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

LONG_CHARS = 16384  # ~20 ms of tokenizing: above it, the long lane


class TokenizerPool:
    def __init__(self, tokenizer: Any) -> None:
        self.lanes = [(ThreadPoolExecutor(1, "nanoserve-tokenize"), tokenizer),
                      (ThreadPoolExecutor(1, "nanoserve-tokenize-long"), copy.deepcopy(tokenizer))]

    async def run(self, fn: Callable[[Any, Any], list[int]], prompt: Any, num_chars: int
                  ) -> list[int]:
        """fn(tokenizer, prompt) on the lane for a prompt of `num_chars` characters."""
        pool, tokenizer = self.lanes[num_chars > LONG_CHARS]
        return await asyncio.get_running_loop().run_in_executor(pool, fn, tokenizer, prompt)

    def shutdown(self) -> None:
        for pool, _ in self.lanes:
            pool.shutdown(wait=False, cancel_futures=True)
