"""Where prompts are tokenized: off the event loop and off the engine thread, in two lanes. A long
text (up to max_model_len × the longest token in characters: ~0.7 s for SmolLM2 at 8192) must not
queue the short ones behind it, so prompts over LONG_CHARS characters get a thread (and a copy
of the tokenizer: an HF tokenizer is not to be shared between threads) of their own. HF's Rust
encoder releases the GIL, so neither lane stalls the event loop; the long lane's thread runs at
the lowest CPU priority (nice 19), so on a small CPU its minutes of tokenizing take the cores
only when the engine's threads leave them (with TOKENIZERS_PARALLELISM off, the encoding runs
on that thread itself, not on the tokenizers library's own pool)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

LONG_CHARS = 16384  # ~20 ms of tokenizing: above it, the long lane


def _lowest() -> None:
    """This thread at nice 19 (Linux: a thread's priority is its own)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class TokenizerPool:
    def __init__(self, tokenizer: Any) -> None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one text at a time: no pool needed
        self.lanes = [(ThreadPoolExecutor(1, "nanoserve-tokenize"), tokenizer),
                      (ThreadPoolExecutor(1, "nanoserve-tokenize-long", initializer=_lowest),
                       copy.deepcopy(tokenizer))]

    async def run(self, fn: Callable[[Any, Any], list[int]], prompt: Any, num_chars: int
                  ) -> list[int]:
        """fn(tokenizer, prompt) on the lane for a prompt of `num_chars` characters."""
        pool, tokenizer = self.lanes[num_chars > LONG_CHARS]
        return await asyncio.get_running_loop().run_in_executor(pool, fn, tokenizer, prompt)

    def shutdown(self) -> None:
        for pool, _ in self.lanes:
            pool.shutdown(wait=False, cancel_futures=True)
