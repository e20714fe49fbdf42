"""Input validation: every bad prompt, sampling parameter or engine setting is a
ValueError that names the field and its allowed range, raised by `add_request`,
`generate`, `chat` or `LLM(...)` *before* any engine state changes: no KV block is taken, nothing
is queued, and the engine goes on serving the good requests.

Engine-setting errors are checked with `load_model` replaced by a function that fails the
test, which proves they are raised before any weights are read.

`PYTHONPATH=. python tests/core/test_validation.py` prints the "bad input -> error message" table.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import nanoserve.engine.model_runner as model_runner
from nanoserve import LLM, SamplingParams
from nanoserve.entrypoints.beam_search import BeamSearchParams
from tests.common.tiny_model import VOCAB_SIZE, tiny_model_dir

MAX_MODEL_LEN = 64
NUM_KV_BLOCKS, BLOCK_SIZE = 8, 4  # the whole cache holds 32 tokens < MAX_MODEL_LEN
NAN = float("nan")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_llm() -> LLM:
    return LLM(tiny_model_dir(), num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE,
               max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


def _mutated(**fields) -> SamplingParams:
    """Params that were valid when built and were changed afterwards: add_request must
    re-validate them instead of trusting __post_init__."""
    params = SamplingParams()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


# (bad input, how it is submitted, regex the message must match: field and allowed range)
REQUEST_CASES = [
    ('empty prompt ""', lambda llm: llm.add_request(""), r"prompt must have at least 1 token"),
    ("empty prompt []", lambda llm: llm.add_request([]), r"prompt must have at least 1 token"),
    ("token id -1", lambda llm: llm.add_request([5, -1]),
     rf"token ids must be in \[0, {VOCAB_SIZE}\)"),
    (f"token id {VOCAB_SIZE} (= vocab size)", lambda llm: llm.add_request([5, VOCAB_SIZE]),
     rf"token ids must be in \[0, {VOCAB_SIZE}\)"),
    (f"prompt of {MAX_MODEL_LEN + 1} tokens > max_model_len {MAX_MODEL_LEN}",
     lambda llm: llm.add_request([5] * (MAX_MODEL_LEN + 1)), rf"max_model_len \({MAX_MODEL_LEN}"),
    # vLLM's: a prompt that fills the context leaves no room for a token
    (f"prompt of {MAX_MODEL_LEN} tokens = max_model_len",
     lambda llm: llm.add_request([5] * MAX_MODEL_LEN),
     rf"prompt has {MAX_MODEL_LEN} tokens: with one generated token, more than max_model_len"),
    # 32 tokens + 1 generated need 9 blocks of 4; the whole cache has 8.
    (f"prompt of 32 tokens, whole KV cache {NUM_KV_BLOCKS} x {BLOCK_SIZE} tokens",
     lambda llm: llm.add_request([5] * 32), r"num_kv_blocks"),
    ("prompt is a dict without 'prompt' or 'prompt_token_ids'",
     lambda llm: llm.add_request({"text": "hi"}),
     r"prompt must be a str, a list of int token ids, or a dict with 'prompt' or "
     r"'prompt_token_ids', got a dict with \['text'\]"),
    ("prompt_token_ids is a str", lambda llm: llm.add_request({"prompt_token_ids": "5 6"}),
     r"prompt_token_ids must be a list of int token ids, got str"),
    ("prompt_token_ids with a prompt that is not text",
     lambda llm: llm.add_request({"prompt_token_ids": [5, 6], "prompt": 7}),
     r"prompt beside prompt_token_ids must be a str \(the text they were made from\), got int"),
    ("prompt {'prompt': ''}", lambda llm: llm.add_request({"prompt": ""}),
     r"prompt must have at least 1 token, got ''"),
    ("prompt is a list of floats", lambda llm: llm.add_request([1.0, 2.0]),
     r"prompt must be a str or a list of int token ids, got list containing float 1\.0"),
    # bools are ints to Python; EngineConfig rejects them, and so does every request field.
    ("prompt [True, False]", lambda llm: llm.add_request([True, False]),
     r"prompt must be a str or a list of int token ids, got list containing bool True"),
    ("prompt [5, np.float64(6.0)]", lambda llm: llm.add_request([5, np.float64(6.0)]),
     r"got list containing float64 np\.float64\(6\.0\)"),
    ("prompt is None (add_request)", lambda llm: llm.add_request(None),
     r"prompt must be a str or a list of int token ids, got NoneType"),
    ("prompts is None (generate)", lambda llm: llm.generate(None, use_tqdm=False),
     r"prompts must be a str, a list of token ids, a prompt dict or a list of those, "
     r"got NoneType"),
    ("max_tokens=0", lambda llm: llm.add_request("hi", SamplingParams(max_tokens=0)),
     r"max_tokens must be None or an integer >= 1"),
    ("max_tokens=True", lambda llm: llm.add_request("hi", SamplingParams(max_tokens=True)),
     r"max_tokens must be None or an integer >= 1, got True"),
    ("priority=True", lambda llm: llm.add_request("hi", GREEDY, priority=True),
     r"priority must be an int, got True"),
    ("temperature=-0.5", lambda llm: llm.add_request("hi", SamplingParams(temperature=-0.5)),
     r"temperature must be a number in \[0, 2\]"),
    # NaN slips past `t < 0`; it used to crash the sampler mid-step instead.
    ("temperature=nan", lambda llm: llm.add_request("hi", SamplingParams(temperature=NAN)),
     r"temperature must be a number in \[0, 2\]"),
    # vLLM's and OpenAI's range (inf used to sample uniformly)
    ("temperature=2.5", lambda llm: llm.add_request("hi", SamplingParams(temperature=2.5)),
     r"temperature must be a number in \[0, 2\], got 2.5"),
    ("temperature=inf", lambda llm: llm.add_request("hi", SamplingParams(temperature=1e999)),
     r"temperature must be a number in \[0, 2\], got inf"),
    ("top_p=0", lambda llm: llm.add_request("hi", SamplingParams(top_p=0)),
     r"top_p must be in \(0, 1\]"),
    ("top_p=1.5", lambda llm: llm.add_request("hi", SamplingParams(top_p=1.5)),
     r"top_p must be in \(0, 1\]"),
    ("top_k=-2", lambda llm: llm.add_request("hi", SamplingParams(top_k=-2)),
     r"top_k must be None, 0 or -1 \(disabled\) or an integer >= 1"),
    ("top_k=True", lambda llm: llm.add_request("hi", SamplingParams(top_k=True)),
     r"top_k must be None, 0 or -1 \(disabled\) or an integer >= 1, got True"),
    ("seed=True", lambda llm: llm.add_request("hi", SamplingParams(seed=True)),
     r"seed must be None, -1 or an integer in \[0, 2\*\*64\), got True"),
    # torch.Generator.manual_seed takes [-2**63, 2**64); a negative seed aliases another.
    ("seed=2**64", lambda llm: llm.add_request("hi", SamplingParams(seed=2**64)),
     r"seed must be None, -1 or an integer in \[0, 2\*\*64\), got 18446744073709551616"),
    ("seed=-2", lambda llm: llm.add_request("hi", SamplingParams(seed=-2)),
     r"seed must be None, -1 or an integer in \[0, 2\*\*64\), got -2"),
    ("stop_token_ids=[True]", lambda llm: llm.add_request("hi", SamplingParams(
        stop_token_ids=[True])), r"stop_token_ids must be a list of integers >= 0, got \[True\]"),
    ("stop_token_ids=7", lambda llm: llm.add_request("hi", SamplingParams(stop_token_ids=7)),
     r"stop_token_ids must be a list of integers >= 0, got 7"),
    # the engine's max_logprobs (vLLM's), 20 by default
    ("logprobs=21", lambda llm: llm.add_request("hi", SamplingParams(logprobs=21)),
     r"logprobs must be None or an integer in \[0, 20\] \(max_logprobs\), got 21"),
    ("skip_special_tokens=1", lambda llm: llm.add_request("hi", SamplingParams(
        skip_special_tokens=1)), r"skip_special_tokens must be a bool, got 1"),
    ("stop=''", lambda llm: llm.add_request("hi", SamplingParams(stop="")),
     r"stop must be a non-empty string or a list of them, got \[''\]"),
    ("top_p set to 1.5 after construction", lambda llm: llm.add_request("hi", _mutated(top_p=1.5)),
     r"top_p must be in \(0, 1\]"),
    ("max_tokens set to 0 after construction",
     lambda llm: llm.add_request("hi", _mutated(max_tokens=0)), r"max_tokens must be None or an"),
    ("sampling_params is a dict", lambda llm: llm.add_request("hi", {"temperature": 0}),
     r"sampling_params must be a SamplingParams, got dict"),
    ("2 prompts, 1 SamplingParams in a list",
     lambda llm: llm.generate(["a", "b"], [GREEDY], use_tqdm=False),
     r"sampling_params has 1 entries but there are 2 prompts"),
    ("abort(3): request id is not a str", lambda llm: llm.abort(3),
     r"request_id must be a str \(the id add_request returned\), got int 3"),
    ("chat: messages is a str", lambda llm: llm.chat("hi", use_tqdm=False),
     r"messages must be a conversation \(a non-empty list of message dicts\) or a list of them, "
     r"got 'hi'"),
    ("chat: an empty conversation among good ones",
     lambda llm: llm.chat([[{"role": "user", "content": "hi"}], []], use_tqdm=False),
     r"messages must be a conversation"),
    ("chat: a message without content",
     lambda llm: llm.chat([{"role": "user"}], use_tqdm=False),
     r"messages must each have a string role and a text content, got \{'role': 'user'\}"),
    ("chat: continue_final_message with add_generation_prompt",
     lambda llm: llm.chat([{"role": "user", "content": "hi"}], continue_final_message=True,
                          use_tqdm=False),
     r"continue_final_message must be False when add_generation_prompt is True"),
    ("chat: chat_template_kwargs is a list",
     lambda llm: llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs=["x"],
                          use_tqdm=False),
     r"chat_template_kwargs must be a dict or None, got list"),
    ("chat: a tool not in OpenAI's shape",
     lambda llm: llm.chat([{"role": "user", "content": "hi"}], tools=[{"type": "function"}],
                          use_tqdm=False),
     r'tools must each be \{"type": "function", "function": \{"name": \.\.\.\}\}, got'),
    ("chat: chat_template is a dict",
     lambda llm: llm.chat([{"role": "user", "content": "hi"}], chat_template={"x": 1},
                          use_tqdm=False),
     r"chat_template must be a str \(a Jinja template\) or None, got dict"),
    ("one bad prompt among good ones (generate)",
     lambda llm: llm.generate(["hello", [5, VOCAB_SIZE], "world"], GREEDY, use_tqdm=False),
     rf"token ids must be in \[0, {VOCAB_SIZE}\)"),
    ("beam_search: beam_width 11", lambda llm: llm.beam_search(["hi"], BeamSearchParams(11, 4)),
     r"beam_width must be an integer in \[1, 10\], got 11"),
    ("beam_search: length_penalty NaN",
     lambda llm: llm.beam_search(["hi"], BeamSearchParams(2, 4, length_penalty=NAN)),
     r"length_penalty must be a finite number, got nan"),
    ("beam_search: params is a dict", lambda llm: llm.beam_search(["hi"], {"beam_width": 2}),
     r"params must be a BeamSearchParams, got dict"),
    ("beam_search: prompts is a str", lambda llm: llm.beam_search("hi", BeamSearchParams(2, 4)),
     r"prompts must be a list of prompts, got str"),
    ("one bad prompt among good ones (beam_search)",
     lambda llm: llm.beam_search(["hello", [5, VOCAB_SIZE]], BeamSearchParams(2, 4)),
     rf"token ids must be in \[0, {VOCAB_SIZE}\)"),
]

# Engine settings given to LLM(...): (bad input, kwargs, regex).
CONFIG_CASES = [
    ("max_num_batched_tokens=512 < max_model_len=2048, chunked prefill off",
     dict(max_num_batched_tokens=512, max_model_len=2048, enable_chunked_prefill=False),
     r"max_num_batched_tokens \(512\) must be >= max_model_len \(2048\)"),
    ("chunked prefill off, max_model_len not given (the model's 2048 > the 1024 budget)",
     dict(enable_chunked_prefill=False, max_num_batched_tokens=1024),
     r"max_num_batched_tokens \(1024\) must be >= max_model_len \(2048\)"),
    ("max_model_len=4096 > the model's max_position_embeddings", dict(max_model_len=4096),
     r"max_model_len \(4096\) must be <= the model's max_position_embeddings \(2048\)"),
    ("block_size=0", dict(block_size=0), r"block_size must be None or an integer >= 1"),
    ("max_logprobs=-2", dict(max_logprobs=-2), r"max_logprobs must be an int >= -1, got -2"),
    ("block_size=-16", dict(block_size=-16), r"block_size must be None or an integer >= 1"),
    ("max_num_seqs=0", dict(max_num_seqs=0), r"max_num_seqs must be None or an integer >= 1"),
    ('scheduling_policy="lifo"', dict(scheduling_policy="lifo"),
     r"scheduling_policy must be one of \('fcfs', 'priority'\)"),
    ('attention_backend="triton"', dict(attention_backend="triton"),
     r"attention_backend must be one of \('auto', 'flash-attn', 'torch'\)"),
    ('device="cuda:99"', dict(device="cuda:99"),
     r"device must be 'auto', 'cpu' or a CUDA device torch sees .*, got 'cuda:99'"),
    ('device="tpu"', dict(device="tpu"), r"device must be 'auto', 'cpu' or a CUDA device"),
    ('attention_backend="flash-attn" on CPU', dict(attention_backend="flash-attn", device="cpu"),
     r"attention_backend='flash-attn' cannot be used"),
    # The flag means what it says: no chunking at all, so a per-request chunk cap is a
    # contradiction (it used to chunk a 20-token prompt into five chunks of 4).
    ('quantization="awq" (a vLLM setting nanoserve has not)', dict(quantization="awq"),
     r"quantization is not a nanoserve setting; the settings are dtype, device, "),
    ("tokenizer a folder that is not there", dict(tokenizer="no/such/folder"),
     r"tokenizer must be None or a directory holding a tokenizer, got 'no/such/folder'"),
    ("generation_config a folder without one", dict(generation_config="no/such/folder"),
     r"generation_config must be 'auto', 'vllm' or a folder holding a generation_config.json"),
    ("long_prefill_token_threshold=4, chunked prefill off",
     dict(long_prefill_token_threshold=4, enable_chunked_prefill=False, max_model_len=1024),
     r"long_prefill_token_threshold must be None when enable_chunked_prefill is False, got 4"),
]


def engine_state(llm: LLM) -> tuple:
    """Everything a rejected request must leave alone."""
    s, bm = llm.scheduler, llm.scheduler.block_manager
    return (bm.num_free_blocks, [b.ref_count for b in bm.blocks], dict(bm.cached_blocks),
            [r.request_id for r in s.waiting], [r.request_id for r in s.running],
            len(llm._pending), llm.num_steps)


@pytest.mark.parametrize("case", REQUEST_CASES, ids=[c[0] for c in REQUEST_CASES])
def test_bad_request_is_rejected_without_state_change(llm, case):
    _, submit, pattern = case
    # A request already holding blocks: a rejection must not touch it either.
    running = llm.add_request([7, 8, 9, 10, 11], GREEDY)
    llm.step()
    before = engine_state(llm)
    assert before[0] < NUM_KV_BLOCKS, "the running request should hold blocks"
    with pytest.raises(ValueError, match=pattern):
        submit(llm)
    assert engine_state(llm) == before
    llm.abort(running)
    llm.step()  # hands back the abort output
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.has_unfinished_requests()


def test_boundary_prompts_are_accepted(llm):
    """The limits are exact: the largest prompt that fits is accepted and served."""
    fits = [5] * (NUM_KV_BLOCKS * BLOCK_SIZE - 1)  # + 1 generated token = the whole cache
    [out] = llm.generate([fits], GREEDY, use_tqdm=False)
    # The cache caps the request's length, so it stops after one token.
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    top = SamplingParams(temperature=0.5, top_p=1.0, top_k=-1, max_tokens=2, seed=1)
    [out] = llm.generate([[0, VOCAB_SIZE - 1]], top, use_tqdm=False)
    assert len(out.token_ids) == 2
    # top_k=-1 ("disabled") is allowed even when set after construction.
    [out] = llm.generate(["hi"], _mutated(top_k=-1, temperature=0.5, max_tokens=2),
                         use_tqdm=False)
    assert len(out.token_ids) == 2
    # vLLM's other spellings of "none": top_k 0, seed -1, stop_token_ids None; logprobs True: 1
    assert (SamplingParams(top_k=0).top_k, SamplingParams(seed=-1).seed) == (None, None)
    assert (SamplingParams(stop_token_ids=None).stop_token_ids, SamplingParams(
        logprobs=True).logprobs) == ([], 1)
    # max_tokens None: up to max_model_len (a roomy cache, so the context is what stops it)
    roomy = LLM(tiny_model_dir(), num_kv_blocks=32, block_size=BLOCK_SIZE,
                max_model_len=MAX_MODEL_LEN, max_logprobs=-1)  # -1: the vocabulary
    [out] = roomy.generate(["hi"], SamplingParams(max_tokens=1, logprobs=VOCAB_SIZE),
                           use_tqdm=False)
    assert len(out.logprobs[0]) == VOCAB_SIZE  # every token (the sampled one among them)
    [out] = roomy.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=None,
                                                      ignore_eos=True), use_tqdm=False)
    assert out.finish_reason == "length" and len(out.token_ids) == MAX_MODEL_LEN - 60
    [out] = llm.generate(["hi"], _mutated(top_k=0, seed=-1, temperature=0.5, max_tokens=2),
                         use_tqdm=False)
    assert len(out.token_ids) == 2


def test_a_cache_smaller_than_max_model_len_is_said_at_start(llm):
    """vLLM refuses such a cache; nanoserve serves it, and its start-up line says what it means."""
    held = NUM_KV_BLOCKS * BLOCK_SIZE
    assert llm.describe().endswith(f"; the KV cache holds {held} tokens, fewer than "
                                   f"max_model_len {MAX_MODEL_LEN}: a request stops there "
                                   "(finish_reason 'length')")
    roomy = LLM(tiny_model_dir(), num_kv_blocks=16, block_size=BLOCK_SIZE, max_model_len=held)
    assert "KV cache holds" not in roomy.describe()


def test_integer_like_ids_and_edge_seeds_are_accepted(llm):
    """numpy integers are token ids (prompt and stop_token_ids); the seed range is exact."""
    [expected] = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    as_numpy = [np.int64(5), np.int32(6), np.uint16(7)]
    assert [o.token_ids for o in llm.generate(as_numpy, GREEDY, use_tqdm=False)] == \
        [expected.token_ids]  # one prompt of numpy ids, not three prompts
    stop = SamplingParams(temperature=0.0, max_tokens=4,
                          stop_token_ids=[np.int64(expected.token_ids[1])])
    [out] = llm.generate([as_numpy], stop, use_tqdm=False)
    assert out.finish_reason == "stop" and out.token_ids == expected.token_ids[:2]
    for seed in [0, 2**64 - 1]:
        params = SamplingParams(temperature=1.0, max_tokens=3, seed=seed, ignore_eos=True)
        runs = [llm.generate([[5, 6, 7]], params, use_tqdm=False)[0] for _ in range(2)]
        assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 3


def test_engine_keeps_serving_after_rejections(llm):
    prompts = ["The quick brown fox", [3, 1, 4, 1, 5, 9]]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    a = llm.add_request(prompts[0], GREEDY)
    llm.step()
    for _, submit, pattern in REQUEST_CASES:
        with pytest.raises(ValueError, match=pattern):
            submit(llm)
    b = llm.add_request(prompts[1], GREEDY)
    outputs = {}
    while llm.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.step())
    assert [outputs[a].token_ids, outputs[b].token_ids] == expected
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.fixture
def no_model_loading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the config error was raised")

    monkeypatch.setattr(model_runner, "load_model", fail)


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_is_rejected_before_loading_the_model(no_model_loading, case):
    _, kwargs, pattern = case
    with pytest.raises(ValueError, match=pattern):
        LLM(tiny_model_dir(), **kwargs)


def test_max_model_len_defaults_to_the_models_limit():
    """As in vLLM: with max_model_len not given, a 512-position model gets 512 (an engine
    default of 2048 made such a model fail to load with default settings)."""
    llm = LLM(tiny_model_dir(max_position_embeddings=512), num_kv_blocks=64)
    assert llm.config.max_model_len == 512
    with pytest.raises(ValueError, match=r"more than max_model_len \(512\)"):
        llm.add_request([5] * 513)


def test_max_model_len_above_the_models_limit_fails_before_any_allocation(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("weights or KV memory were allocated before the config error")

    monkeypatch.setattr(model_runner, "load_model", fail)
    monkeypatch.setattr(model_runner.ModelRunner, "_allocate_kv_cache", fail)
    monkeypatch.setattr(model_runner.ModelRunner, "_kv_blocks_from_memory", fail)
    with pytest.raises(ValueError, match=r"max_model_len \(513\) must be <= the model's "
                                         r"max_position_embeddings \(512\)"):
        LLM(tiny_model_dir(max_position_embeddings=512), max_model_len=513)


def error_table() -> str:
    """The markdown table of the report: each bad input and the message it gets."""
    def message(fn) -> str:
        try:
            fn()
        except ValueError as e:
            return str(e).replace("|", "\\|")
        return "(no error!)"

    llm = make_llm()
    rows = [(name, message(lambda s=submit: s(llm))) for name, submit, _ in REQUEST_CASES]
    model_runner.load_model = None  # a config error must come before this is called
    rows += [(f"LLM({name})", message(lambda k=kwargs: LLM(tiny_model_dir(), **k)))
             for name, kwargs, _ in CONFIG_CASES]
    lines = ["| bad input | error message |", "|---|---|"]
    lines += [f"| {name} | {msg} |" for name, msg in rows]
    return "\n".join(lines)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                    reason="the table's flash-attn row is the message where it is missing")
def test_the_docs_table_is_the_one_this_file_prints(monkeypatch):
    """docs/bad-input.md shows error_table(): no message there can drift from the code's."""
    monkeypatch.setattr(model_runner, "load_model", model_runner.load_model)  # set back after
    assert error_table() in (Path(__file__).parents[2] / "docs" / "bad-input.md").read_text()


if __name__ == "__main__":
    print(error_table())
