"""Beam search served (vLLM's `use_beam_search` in completions and chat, `n` the beam width,
`length_penalty`): beam_search.py's rounds driven from the event loop, each live beam one request
of the engine thread's like any other, so searches and plain requests share every step. The
answer comes when the search ends: streamed, one chunk a choice (as vLLM's)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nanoserve.entrypoints.beam_search import BeamSearch, BeamSearchParams
from nanoserve.entrypoints.choices import Batch
from nanoserve.entrypoints.engine_thread import Collector, EngineThread
from nanoserve.entrypoints.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.entrypoints.protocol import APIError
from nanoserve.entrypoints.tokenizer_pool import TokenizerPool
from nanoserve.sampling_params import SamplingParams


def beam_search_params(req: Any, inputs: list[tuple[SamplingParams, list[int]]]
                       ) -> list[BeamSearchParams] | None:
    """Each prompt's search (None without use_beam_search). What a search would not honour is a
    400 naming it, where vLLM's ignores it: stop strings and ids, top_p, top_k, seed, logprobs."""
    if not req.use_beam_search:
        return None
    for name, ok in (("stop", not req.stop), ("stop_token_ids", not req.stop_token_ids),
                     ("top_p", req.top_p in (None, 1)), ("top_k", req.top_k in (None, -1)),
                     ("seed", req.seed is None), ("logprobs", inputs[0][0].logprobs is None)):
        if not ok:
            raise APIError(f"{name} cannot be used with use_beam_search, got "
                           f"{getattr(req, name)!r}", name)
    try:
        return [BeamSearchParams(req.n, params.max_tokens, req.ignore_eos, params.temperature,
                                 req.length_penalty, req.include_stop_str_in_output)
                for params, _ in inputs]
    except ValueError as e:  # beam_width is the request's n
        message = str(e).replace("beam_width", "n (the beam width)", 1)
        raise APIError(message, "n" if message.startswith("n ") else "length_penalty") from None


async def serve_beam_search(engine: EngineThread, tokenizers: TokenizerPool, collector: Collector,
                            prompt: list[int], params: BeamSearchParams, priority: int) -> None:
    """One prompt's search; its answer, one output of `n` completions, goes to `collector`, whose
    `accepted` says whether the engine took the first round. Cancelled: the round is aborted."""
    llm, start = engine.llm, time.time()
    search = BeamSearch(prompt, params, llm.processor.eos_token_ids,
                        llm.scheduler.max_model_len_in_cache)
    num_cached, round_, ended, answered = None, None, None, False
    try:
        while not ended and (beams := search.live()):
            round_ = Batch(len(beams))
            for c, beam in zip(round_.collectors, beams):
                engine.add(c, beam.tokens, search.sampling_params(), priority)
            refused = [e for c in round_.collectors if (e := await c.accepted) is not None]
            if refused and not collector.accepted.done():  # the first round: the refusal
                collector.accepted.set_result(refused[0])
                return
            if not collector.accepted.done():
                collector.accepted.set_result(None)
            if refused:  # shutting down: the round's others are aborted (below)
                ended = CompletionOutput(0, "", [], "abort")
                break
            entries = [None] * len(beams)
            async for i, c in round_.outputs(1):
                ended = ended or (c if c.finish_reason in ("abort", "error") else None)
                entries[i] = c.logprobs[0] if c.logprobs else None
            if num_cached is None:  # the first round's: the prompt's hit
                num_cached = round_.num_cached_tokens
            round_ = None
            if not ended:
                search.advance(entries)
        if ended:  # shutdown, a failed step or the sampler's error: every choice ends so
            outputs = [CompletionOutput(j, "", [], ended.finish_reason, error=ended.error)
                       for j in range(params.beam_width)]
        else:
            best = search.best()
            ids = [search.generated(seq) for seq in best]
            texts = await tokenizers.run(_decode, [text_ids for _, text_ids in ids], 0)
            outputs = [CompletionOutput(j, text, token_ids, seq.finish_reason, seq.stop_reason)
                       for j, (seq, (token_ids, _), text) in enumerate(zip(best, ids, texts))]
        metrics = RequestMetrics(start, None, None, time.time() - start, 0, num_cached or 0)
        collector.put(RequestOutput("beam-search", None, prompt, outputs, metrics))
        answered = True
    finally:
        for c in round_.collectors if round_ is not None else []:  # cancelled mid-round
            engine.abort(c)
        if not collector.accepted.done():  # failed before the first round was taken: a 500
            collector.accepted.set_result(RuntimeError("the beam search failed to start"))
        elif not answered:  # failed, or cancelled (then nobody reads it): the handler stops
            collector.put(RequestOutput("beam-search", None, prompt, [CompletionOutput(
                j, "", [], "abort") for j in range(params.beam_width)],
                RequestMetrics(start, None, None, None, 0, 0)))


def _decode(tokenizer: Any, sequences: list[list[int]]) -> list[str]:
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]


def start_beam_searches(serving: Any, batch: Batch, inputs: list, searches: list,
                        priority: int) -> None:
    """Each prompt's search as a task of `batch`'s (its abort cancels them)."""
    batch.tasks = [asyncio.create_task(serve_beam_search(
        serving.engine, serving.tokenizers, collector, prompt_ids, params, priority))
        for collector, (_, prompt_ids), params in zip(batch.collectors, inputs, searches)]
