"""The fast path's whole decode step (step.py) against the runner's own path: the same tokens,
taken only where every row decodes greedily, and the runner's path wherever it is not."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.model_runner import step_inputs
from nanoserve_accel import kernels
from nanoserve_accel.step import DecodeStep
from tests.common.tiny_model import tiny_model_dir

pytestmark = pytest.mark.skipif(kernels.compile_kernels() is None, reason="no C compiler")
PROMPTS = [[5, 6, 7], [9] * 20, [100, 3, 8, 11, 2]]


def run(llm: LLM, params: list[SamplingParams]) -> tuple[list[list[int]], list[str]]:
    """Each prompt's tokens, and which path each step took ("step" or "runner")."""
    runner, taken = llm.model_runner, []
    decode_step = runner.decode_step

    def counted(step, reqs):
        tokens = decode_step(step, reqs)
        taken.append("runner" if tokens is None else "step")
        return tokens

    runner.decode_step = counted
    outs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    runner.decode_step = decode_step
    return [o.outputs[0].token_ids for o in outs], taken


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_steps_take_it_and_give_the_runners_tokens(dtype):
    llm = LLM(tiny_model_dir(), dtype=dtype, num_kv_blocks=32, block_size=16,
              skip_tokenizer_init=True)
    assert isinstance(llm.model_runner.decode_step, DecodeStep)
    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 3
    fast, taken = run(llm, greedy)
    assert "step" in taken and taken[0] == "runner"  # the prefill step: the runner's
    decode_step, llm.model_runner.decode_step = llm.model_runner.decode_step, None
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    llm.model_runner.decode_step = decode_step
    assert fast == plain


def test_sampling_or_logprobs_rows_take_the_runners_path():
    llm = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=32, block_size=16,
              skip_tokenizer_init=True)
    for other in (SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=0.0, logprobs=2, max_tokens=6, ignore_eos=True)):
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        _, taken = run(llm, [greedy, other, greedy])
        assert taken and set(taken) == {"runner"}


def test_nan_logits_are_the_samplers_error():
    """A row whose logits hold NaN: the sampler's error message, not a token, on both paths."""
    llm = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=32, block_size=16,
              skip_tokenizer_init=True)
    runner = llm.model_runner
    llm.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))
    llm.step(), llm.step()  # the prefill, then a decode step of the modules, which binds
    head = runner.model.lm_head
    if head.layout.is_mkldnn:
        pytest.skip("the LM head's layout is oneDNN's opaque tensor here")
    head.layout.fill_(float("nan"))
    out = llm.scheduler.schedule()
    assert runner.decode_step.takes(*step_inputs(out, runner.block_size))
    step_outputs = []
    for decode_step in (runner.decode_step, None):
        runner.decode_step = decode_step
        step_outputs.append(runner.execute_model(out).token_ids)
    assert step_outputs[0] == step_outputs[1]
    assert all(isinstance(t, str) and "NaN" in t for t in step_outputs[0].values())
