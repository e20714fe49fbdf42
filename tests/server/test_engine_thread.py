"""The server's engine thread (nanoserve/entrypoints/engine_thread.py) builds the LLM itself, so
that only it ever starts an OpenMP team, and serves requests handed over from the event loop; a
build that fails (a bad flag) reaches main() as its error. In process, no HTTP; every wait is
bounded."""

from __future__ import annotations

import asyncio
import gc
import threading

from nanoserve import LLM, SamplingParams
from nanoserve.entrypoints.engine_thread import Collector, EngineThread
from tests.common.tiny_model import tiny_model_dir


def tiny_llm() -> LLM:
    return LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=16, block_size=16,
               skip_tokenizer_init=True)


def test_the_llm_is_built_and_stepped_on_the_engine_thread():
    built_on, stepped_on = [], []

    def build() -> LLM:
        built_on.append(threading.current_thread())
        llm = tiny_llm()
        step = llm.step
        llm.step = lambda: stepped_on.append(threading.current_thread()) or step()
        return llm

    engine = EngineThread(build)
    assert engine.ready.wait(120) and engine.error is None
    assert built_on == [engine.thread] != [threading.current_thread()]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def serve_one() -> list[int]:
        engine.loop = asyncio.get_running_loop()
        collector = Collector()
        engine.add(collector, [5, 17, 3, 250], params)
        assert await asyncio.wait_for(collector.accepted, 30) is None  # no error
        ids: list[int] = []
        for _ in range(10):  # deltas or one final output: bounded either way
            await asyncio.wait_for(collector.ready.wait(), 30)
            collector.ready.clear()
            outputs = collector.take()
            ids += [t for out in outputs for t in out.token_ids]
            if outputs[-1].finished:
                return ids
        raise AssertionError("the request did not finish")

    try:
        ids = asyncio.run(serve_one())
    finally:
        engine.stop()
    [ref] = tiny_llm().generate([[5, 17, 3, 250]], params, use_tqdm=False)
    assert ids == ref.token_ids
    assert stepped_on and set(stepped_on) == {engine.thread}
    assert not engine.thread.is_alive()


def test_a_build_that_fails_is_handed_to_main():
    def build() -> LLM:
        return LLM(tiny_model_dir(), dtype="float8", skip_tokenizer_init=True)

    engine = EngineThread(build)
    assert engine.ready.wait(60)
    assert isinstance(engine.error, ValueError) and "dtype" in str(engine.error)
    engine.thread.join(10)
    assert not engine.thread.is_alive() and engine.llm is None


def test_the_heap_built_before_serving_is_frozen_until_the_thread_ends():
    """A full collection would walk everything the LLM's build left (vLLM freezes it too);
    frozen while the thread serves, collectable again once it stops."""
    assert gc.get_freeze_count() == 0
    engine = EngineThread(tiny_llm)
    assert engine.ready.wait(120) and engine.error is None
    try:
        assert gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        [out] = tiny_llm().generate([[5, 17, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out.token_ids) == 2 and gc.get_freeze_count() <= frozen  # none added later
    finally:
        engine.stop()
    assert not engine.thread.is_alive() and gc.get_freeze_count() == 0
