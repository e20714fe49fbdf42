"""Tensor parallel on a CPU: 2 ranks over gloo, real processes (engine/workers.py). Greedy tokens
equal HF generate's in fp32 for every architecture and TP=1's in bf16; chunked prefill, prefix
hits and preemption give TP=1's tokens with every block free at the end; a killed rank is a clear
error within seconds; shutdown, garbage collection leave no process; a head count that does not
divide is a ValueError before anything loads. Every wait is bounded."""

from __future__ import annotations

import gc
import os
import signal
import time

import openai
import psutil
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.workers import WorkerDied
from tests.common.architectures import ARCHITECTURES, architecture_dir, hf_greedy, prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(name: str, tp: int = 2, **config) -> LLM:
    return LLM(architecture_dir(name), **{"dtype": "float32", "skip_tokenizer_init": True,
                                          "num_kv_blocks": 64, "block_size": 16,
                                          "tensor_parallel_size": tp, **config})


def children() -> set[int]:
    """This process's children, but multiprocessing's resource tracker (Python's own helper for
    spawned processes, one per interpreter, which exits with it)."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_equals_hf_generate_on_two_ranks(name):
    llm = engine(name)
    try:
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [hf_greedy(name, tuple(p), 12) for p in prompts()]
    finally:
        llm.shutdown()
    assert not children()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bf16_two_ranks_equal_one_but_for_rounding(name):
    """In bf16 two ranks sum o_proj and down_proj in another order than one (each its half of
    the inputs, then an all-reduce), so a last bit moves now and then, and grows through the
    layers. The logits (bf16: steps of 0.125 at these sizes, ~20) stay within six steps of
    TP=1's (a wrong shard moves them by whole units), and the tokens are TP=1's up to the first
    step whose top two logits are within two steps of each other."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = {}
    for tp in (1, 2):
        llm = engine(name, tp, dtype="bfloat16")
        outs[tp] = llm.generate(prompts(), params, use_tqdm=False)
        llm.shutdown()
    compared = 0
    for one, two in zip(outs[1], outs[2]):
        first_one, first_two = one.logprobs[0], two.logprobs[0]  # the same inputs
        for token in first_one.keys() & first_two.keys():
            assert abs(first_one[token].logprob - first_two[token].logprob) <= 0.75
        for a, b, entry in zip(one.token_ids, two.token_ids, one.logprobs):
            top, second = sorted((e.logprob for e in entry.values()), reverse=True)[:2]
            if top - second <= 0.26:
                break  # a near-tie: from here the two may part
            assert a == b, (one.token_ids, two.token_ids)
            compared += 1
    assert compared >= 8


def test_chunks_prefix_hits_and_preemption_equal_one_rank():
    """A tiny cache (preemption), a small budget (chunks starting mid-block), prompts sharing
    their first blocks (prefix hits): TP=2's tokens are TP=1's, and every block is free."""
    shared = prompts()[3][:40]
    batch = [shared + p for p in prompts()] + [prompts()[1]]
    config = dict(num_kv_blocks=14, max_num_batched_tokens=40, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        llm = engine("qwen2", tp, **config)
        results[tp] = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        stats, bm = llm.stats(), llm.scheduler.block_manager
        assert stats.num_preemptions > 0 and bm.prefix_cache_hits > 0
        assert bm.num_free_blocks == bm.num_blocks
        llm.shutdown()
    assert results[1] == results[2]


def test_a_killed_rank_is_a_clear_error_and_shutdown_leaves_nothing():
    llm = engine("llama")
    assert llm.generate(prompts()[:1], GREEDY, use_tqdm=False)
    [worker] = llm.model_runner.workers.procs
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDied, match="rank 1"):
        llm.generate(prompts()[:2], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 60
    llm.shutdown()
    assert not children()


def test_garbage_collection_stops_the_ranks():
    llm = engine("llama")
    pids = children()
    assert pids
    del llm
    gc.collect()
    deadline = time.monotonic() + 20
    while children() & pids and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not children() & pids
    assert not torch.distributed.is_initialized()  # a next TP engine can start in this process


def test_heads_that_do_not_divide_are_refused_before_loading(monkeypatch):
    from nanoserve.engine import model_runner

    monkeypatch.setattr(model_runner, "load_model", lambda *a: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by "
                                         r"tensor_parallel_size \(3\)"):
        engine("llama", 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        engine("llama", 0)
    assert not children()


def test_the_server_on_two_ranks_answers_with_one_ranks_text_and_exits_if_a_rank_dies():
    """`--tensor-parallel-size 2` behind the real openai client: TP=1's greedy text; a killed
    rank makes the server end its requests and exit non-zero, leaving no process."""
    from tests.common.tiny_model import tiny_model_dir
    from tests.server.test_server import MAX_MODEL_LEN, TINY_CONFIG, TINY_FLAGS, ServerProcess

    [ref] = LLM(tiny_model_dir(MAX_MODEL_LEN), **TINY_CONFIG).generate(
        ["The quick brown fox"], GREEDY, use_tqdm=False)
    server = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), [*TINY_FLAGS, "--tensor-parallel-size",
                                                           "2"])
    try:
        out = server.client().completions.create(
            model="m", prompt="The quick brown fox", max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True})
        assert out.choices[0].text == ref.text
        ranks = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                 if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 1
        ranks[0].kill()
        try:  # the engine ends the request (an abort), or the server is already gone
            out = server.client().completions.create(model="m", prompt="x", max_tokens=4)
            assert out.choices[0].finish_reason == "abort"
        except openai.APIError:
            pass
        assert server.proc.wait(60) != 0
        assert not psutil.pid_exists(ranks[0].pid) or \
            psutil.Process(ranks[0].pid).status() == psutil.STATUS_ZOMBIE
    finally:
        server.stop()
