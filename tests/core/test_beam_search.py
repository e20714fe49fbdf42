"""Beam search (nanoserve/entrypoints/beam_search.py, vLLM's `LLM.beam_search`):
- the search's rules without a model: an EOS candidate finishes, the beam_width most likely go
  on, the finished and the running are ranked by vLLM's length-penalized score;
- its parameters: each bad one a ValueError naming it (with the prompts: test_validation.py);
- on the bundled SmolLM2 (fp32), with ignore_eos, the sequences HF transformers' beam search
  returns, token for token and in order; with EOS, each sequence's cum_logprob is HF's own
  logprob of its tokens, and no KV block is left held."""

from __future__ import annotations

import math

import pytest
import torch

from nanoserve import LLM
from nanoserve.entrypoints.beam_search import BeamSearch, BeamSearchParams
from nanoserve.entrypoints.bundled import default_model_dir
from nanoserve.layers.sampler import Logprob

EOS = frozenset({0})


def entry(**logprobs: float) -> dict[int, Logprob]:
    """A round's logprobs for one beam: t5=-0.1 is token 5's."""
    return {int(k[1:]): Logprob(v, rank) for rank, (k, v) in enumerate(logprobs.items(), 1)}


def test_the_most_likely_go_on_and_an_eos_finishes():
    s = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=3), EOS, 100)
    s.advance([entry(t5=-0.5, t0=-1.0, t6=-1.5, t9=-3.0)])
    assert [b.tokens for b in s.beams] == [[7, 8, 5], [7, 8, 6]]  # the EOS one left them
    assert [(c.tokens, c.finish_reason, c.stop_reason) for c in s.completed] == [
        ([7, 8, 0], "stop", 0)]
    s.advance([entry(t1=-2.0, t2=-2.5), entry(t3=-0.1, t4=-3.0)])
    assert [(b.tokens[2:], b.cum_logprob) for b in s.beams] == [([6, 3], -1.6), ([5, 1], -2.5)]
    assert len(s.beams[0].logprobs) == 2
    s.advance([entry(t1=-0.1), entry(t1=-0.1)])
    assert s.live() == []  # max_tokens rounds
    best = s.best()
    # scores: [7,8,0] -1.0/2 (its EOS not counted); [7,8,6,3,1] -1.7/5; [7,8,5,1,1] -2.6/5
    assert [b.tokens for b in best] == [[7, 8, 6, 3, 1], [7, 8, 0]]
    assert [b.finish_reason for b in best] == ["length", "stop"]


def test_length_penalty_and_what_a_served_choice_keeps():
    params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.0)
    s = BeamSearch([7, 8], params, EOS, 100)
    s.advance([entry(t5=-0.5, t0=-1.0, t6=-1.5)])
    s.advance([entry(t0=-0.1, t1=-2.0), entry(t0=-0.1, t2=-2.0)])
    s.rounds_left = 0
    # penalty 0: the summed logprob alone
    assert [b.tokens for b in s.best()] == [[7, 8, 5, 0], [7, 8, 0]]
    assert s.generated(s.best()[0]) == ([5], [5])  # the EOS neither in the ids nor the text
    s.params = BeamSearchParams(2, 4, include_stop_str_in_output=True, length_penalty=0.0)
    assert s.generated(s.best()[0]) == ([5, 0], [5])


def test_ignore_eos_keeps_an_eos_beam_running_and_context_bounds_the_rounds():
    s = BeamSearch([7] * 98, BeamSearchParams(2, 10, ignore_eos=True), EOS, 100)
    assert s.rounds_left == 2  # max_model_len 100
    s.advance([entry(t0=-0.1, t5=-0.2)])
    assert [b.tokens[-1] for b in s.beams] == [0, 5] and s.completed == []


@pytest.mark.parametrize("change, field", [
    ({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
    ({"beam_width": True}, "beam_width"), ({"max_tokens": 0}, "max_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"temperature": -1}, "temperature"),
    ({"length_penalty": float("nan")}, "length_penalty"),
    ({"length_penalty": "1"}, "length_penalty"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output")])
def test_bad_params_name_their_field(change, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **change})


# -- on the bundled model -----------------------------------------------------------------------

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Hi!"]


@pytest.fixture(scope="module")
def bundled():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
               for q in QUESTIONS]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(dtype="float32", max_num_seqs=16)
    yield llm, hf, prompts
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("beam_width", [2, 4])
def test_with_ignore_eos_the_sequences_of_hf_beam_search(bundled, beam_width):
    llm, hf, prompts = bundled
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():  # an eos_token_id never produced: HF's EOS ends nothing either
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=beam_width,
                              num_return_sequences=beam_width, do_sample=False,
                              max_new_tokens=10, min_new_tokens=10, eos_token_id=49151,
                              pad_token_id=0, length_penalty=1.0)
        assert [s.tokens for s in out.sequences] == ref.tolist()
        assert all(s.finish_reason == "length" for s in out.sequences)


@pytest.mark.slow
def test_eos_finishes_a_sequence_and_its_score_is_hfs_logprob(bundled):
    llm, hf, prompts = bundled
    (out,) = llm.beam_search([llm.get_tokenizer().decode(prompts[2])],
                             BeamSearchParams(beam_width=3, max_tokens=40))
    seqs = out.sequences
    assert len(seqs) == 3 and any(s.finish_reason == "stop" for s in seqs)
    scores = [s.cum_logprob / (len(s.tokens) - (s.finish_reason == "stop")) for s in seqs]
    assert scores == sorted(scores, reverse=True)
    prompt = prompts[2]
    for s in seqs:
        assert s.tokens[:len(prompt)] == prompt  # the text as vLLM's: no special tokens
        assert s.text == llm.get_tokenizer().decode(s.tokens, skip_special_tokens=True)
        assert "<|im_start|>" not in s.text and s.text.startswith("system\n")
        assert (s.tokens[-1] in llm.processor.eos_token_ids) == (s.finish_reason == "stop")
        with torch.no_grad():
            logits = hf(torch.tensor([s.tokens])).logits[0, len(prompt) - 1:-1]
        hf_logprob = logits.log_softmax(-1).gather(
            1, torch.tensor(s.tokens[len(prompt):])[:, None]).sum().item()
        assert math.isclose(s.cum_logprob, hf_logprob, abs_tol=1e-3)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
