"""End to end (§3–§6): greedy outputs of LLM.generate on the bundled SmolLM2 must be
token-identical to HF transformers `generate`, run one prompt at a time (fp32, CPU),
under every scheduling situation the chapter describes: plain continuous batching, KV
pressure with preemption by recompute, chunked prefills, prefix-cache hits, PRIORITY,
and static batching. The other tests run the default (fast) path."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.entrypoints.bundled import default_model_dir
from tests.common.tiny_model import tiny_model_dir

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Hi!",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, as if I were ten years old.",
    "List three colors.",
    "What is 12 times 12? Answer with the number and a short explanation of how you got it.",
    "Name a famous painter.",
    "Give me a short tip for learning a new language quickly, and one common mistake to "
    "avoid when starting out, with an example of each.",
]
LONG_SYSTEM = ("You are a careful assistant for a small bakery. Always answer politely, "
               "keep answers short, mention that bread is baked fresh every morning, and "
               "never invent prices. If unsure, say you will ask the baker. ") * 2


def chat(tokenizer, question: str, system: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@pytest.fixture(scope="module")
def reference():
    """Prompts (token ids) and HF greedy outputs, one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    shared = [chat(tokenizer, q, LONG_SYSTEM) for q in QUESTIONS]
    expected = {}
    for p in prompts + shared:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                              max_new_tokens=MAX_TOKENS, do_sample=False)
        expected[tuple(p)] = out[0, len(p):].tolist()
    return {"prompts": prompts, "shared": shared, "expected": expected}


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def run_steps(llm: LLM, prompts: list[list[int]], priorities: list[int] | None = None):
    """Drive the step loop by hand and record what the scheduler did."""
    priorities = priorities or [0] * len(prompts)
    ids = [llm.add_request(p, GREEDY, priority=q) for p, q in zip(prompts, priorities)]
    outputs, seen = {}, {"chunks": 0, "preempted": 0, "max_batch": 0}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outputs[o.request_id] = o
        out = llm.last_scheduler_output
        seen["max_batch"] = max(seen["max_batch"], len(out.scheduled))
        seen["preempted"] += len(out.preempted)
        seen["chunks"] += sum(1 for s in out.scheduled if not s.samples)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    return [outputs[i] for i in ids], seen


def check(outputs, prompts, expected):
    for out, prompt in zip(outputs, prompts):
        assert out.token_ids == expected[tuple(prompt)], f"prompt {prompt[-8:]} differs"


@pytest.mark.parametrize("fast_paths", [False, True], ids=["plain path", "fast path"])
def test_default_config(reference, fast_paths):
    # HF identity is an fp32 promise ("auto" may pick bf16), on the reader's plain path (the
    # decoder as written) and on the default one (nanoserve_accel/ swapped in).
    llm = LLM(dtype="float32", enable_fast_paths=fast_paths)
    # The long-system prompts span two of the default 128-token blocks on a CPU.
    prompts = reference["prompts"] + reference["shared"]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check(outputs, prompts, reference["expected"])
    assert any(len(p) + len(o.token_ids) > llm.config.block_size for p, o in zip(prompts, outputs))
    assert any(o.finish_reason == "stop" for o in outputs)  # EOS ends some answers
    assert all(o.metrics.ttft is not None and o.metrics.e2e >= o.metrics.ttft for o in outputs)


def test_preemption_under_kv_pressure(reference):
    llm = LLM(num_kv_blocks=20, block_size=16, max_model_len=320, dtype="float32")
    outputs, seen = run_steps(llm, reference["prompts"])
    check(outputs, reference["prompts"], reference["expected"])
    assert seen["preempted"] > 0
    assert sum(o.metrics.num_preemptions for o in outputs) == seen["preempted"]


def test_chunked_prefill(reference):
    llm = LLM(max_num_batched_tokens=16, block_size=16, dtype="float32")  # chunks cross blocks
    outputs, seen = run_steps(llm, reference["prompts"])
    check(outputs, reference["prompts"], reference["expected"])
    assert seen["chunks"] > 0
    assert seen["max_batch"] > 1  # chunks shared steps with other requests' decodes


def test_prefix_caching_hits(reference):
    llm = LLM(enable_prefix_caching=True, dtype="float32", block_size=16)  # a ~100-token prefix
    shared = reference["shared"]
    first = llm.generate(shared[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(shared[1:], GREEDY, use_tqdm=False)
    check(first + rest, shared, reference["expected"])
    assert llm.scheduler.block_manager.prefix_cache_hits > 0
    assert all(o.metrics.num_cached_tokens == o.num_cached_tokens > 0 for o in rest)
    assert first[0].num_cached_tokens == 0
    # vLLM's other names a script may read
    assert first[0].prompt_logprobs is None and first[0].outputs[0].finished()


def test_priority_policy(reference):
    llm = LLM(scheduling_policy="priority", num_kv_blocks=20, block_size=16, max_model_len=320,
              dtype="float32")
    prompts = reference["prompts"]
    outputs, seen = run_steps(llm, prompts, priorities=[i % 3 for i in range(len(prompts))])
    check(outputs, prompts, reference["expected"])
    assert seen["preempted"] > 0


def test_generate_takes_a_priority_a_prompt():
    """vLLM's generate(..., priority=[...]): with one seat, the smallest priority runs first."""
    llm = LLM(tiny_model_dir(), scheduling_policy="priority", max_num_seqs=1, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False, priority=[2, 0, 1])
    ttft = [o.metrics.ttft for o in outs]
    assert ttft[1] < ttft[2] < ttft[0]
    for bad in ([0, 1], "1"):
        with pytest.raises(ValueError, match=r"priority must be an int or a list of one a prompt "
                                             r"\(3\)"):
            llm.generate(["a", "b", "c"], params, use_tqdm=False, priority=bad)
    # vLLM's: one int is every prompt's
    batch = llm.processor.make_batch(["a", "b"], params, 5, params)
    assert [r.priority for requests in batch for r in requests] == [5, 5]
    assert not llm.has_unfinished_requests()


def test_static_policy(reference):
    llm = LLM(batching="static", max_num_seqs=4, dtype="float32")
    outputs, _ = run_steps(llm, reference["prompts"])
    check(outputs, reference["prompts"], reference["expected"])
