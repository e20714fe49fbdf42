"""Every supported architecture (Llama/SmolLM2, Mistral, Qwen2 with biases, Qwen3 with q/k norms),
through the whole engine with its merged `qkv_proj` / `gate_up_proj` loaded from HF's separate
tensors: greedy tokens equal HF `generate`'s in fp32, on the plain path and with the fast paths;
`logprobs` equal a log-softmax of HF's logits; `n` completions share the prompt's blocks."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.models.decoder import DecoderAttention, GatedMLP
from tests.common.architectures import (
    ARCHITECTURES,
    architecture_dir,
    hf_greedy,
    hf_logprobs,
    prompts,
)

MAX_TOKENS = 12


def engine(name: str, **config) -> LLM:
    return LLM(architecture_dir(name), **{"dtype": "float32", "skip_tokenizer_init": True,
                                          "num_kv_blocks": 64, "block_size": 16, **config})


@pytest.mark.parametrize("fast_paths", [False, True], ids=["plain", "fast"])
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_equals_hf_generate(name, fast_paths):
    llm = engine(name, enable_fast_paths=fast_paths)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [hf_greedy(name, tuple(p), MAX_TOKENS)
                                              for p in prompts()]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_one_merged_qkv_and_gate_up_linear_per_layer(name):
    model = engine(name, enable_fast_paths=False).model_runner.model
    for module in model.modules():
        if isinstance(module, DecoderAttention):
            names = {n for n, _ in module.named_children()}
            assert "qkv_proj" in names and not names & {"q_proj", "k_proj", "v_proj"}
        if isinstance(module, GatedMLP):
            names = {n for n, _ in module.named_children()}
            assert "gate_up_proj" in names and not names & {"gate_proj", "up_proj"}
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.output_sizes == [4 * layer.self_attn.head_dim,
                                                    2 * layer.self_attn.head_dim,
                                                    2 * layer.self_attn.head_dim]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_logprobs_are_hf_log_softmax(name):
    """Greedy, fp32: each token's logprob and rank, and the top 5, from HF's logits."""
    llm = engine(name)
    prompt = prompts()[1]
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True, logprobs=5), use_tqdm=False)
    ref = hf_logprobs(name, prompt + out.token_ids)[len(prompt) - 1:-1]  # the step's logits
    assert len(out.logprobs) == MAX_TOKENS
    for token, entry, expected in zip(out.token_ids, out.logprobs, ref):
        assert next(iter(entry)) == token and entry[token].rank == 1  # greedy: the top one
        top = expected.topk(5)
        assert list(entry) == top.indices.tolist()
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t].logprob == pytest.approx(lp, abs=2e-3)  # logits ~ 30: fp32 sums
    [none] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2),
                          use_tqdm=False)
    assert none.logprobs is None


def test_logprobs_of_a_sampled_token_and_zero_top():
    """logprobs=0: the sampled token's alone, with its true rank (not always 1 when sampling)."""
    llm = engine("llama", seed=1)
    params = SamplingParams(temperature=2.0, max_tokens=8, ignore_eos=True, logprobs=0, seed=5)
    prompt = prompts()[0]
    [out] = llm.generate([prompt], params, use_tqdm=False)
    ref = hf_logprobs("llama", prompt + out.token_ids)[len(prompt) - 1:-1]
    for token, entry, expected in zip(out.token_ids, out.logprobs, ref):
        assert list(entry) == [token]
        assert entry[token].logprob == pytest.approx(float(expected[token]), abs=2e-3)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
    expected = sum(float(e[t]) for t, e in zip(out.token_ids, ref))  # vLLM's cumulative_logprob
    assert out.outputs[0].cumulative_logprob == out.cumulative_logprob == pytest.approx(
        expected, abs=2e-2)
    [none] = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert none.cumulative_logprob is None


def test_n_completions_share_the_prompts_blocks():
    """n=3 with a seed: three completions (child i seeded seed + i), the prompt's full blocks
    computed once: children 1 and 2 find them in the prefix cache."""
    llm = engine("qwen3", block_size=16)
    prompt = prompts()[3]  # 70 tokens: four full blocks
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=6, ignore_eos=True)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    bm = llm.scheduler.block_manager
    assert bm.prefix_cache_hits == 2 * 4 * 16  # two children x four blocks
    assert bm.num_free_blocks == bm.num_blocks
    # Each child draws as a lone request with its seed would: seed + i.
    alone = [engine("qwen3", block_size=16).generate([prompt], SamplingParams(
        temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
        for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    again = engine("qwen3", block_size=16).generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_n_completions_stream_and_abort():
    """DELTA outputs of n=2 come under the parent's id, each with its index; aborting the
    parent ends both children, frees every block and gives one final output."""
    from nanoserve.sampling_params import RequestOutputKind

    llm = engine("llama")
    params = SamplingParams(temperature=0.0, n=2, max_tokens=4, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    rid = llm.add_request(prompts()[0], params)
    seen: dict[int, list[int]] = {0: [], 1: []}
    finished = None
    for _ in range(20):
        for out in llm.step():
            assert out.request_id == rid
            for c in out.outputs:
                seen[c.index] += c.token_ids
            finished = finished or (out if out.finished else None)
        if finished:
            break
    assert seen[0] == seen[1] == hf_greedy("llama", tuple(prompts()[0]), 4)
    rid = llm.add_request(prompts()[1], params)
    llm.step()
    assert llm.abort(rid)
    outs = [o for _ in range(5) for o in llm.step()]
    assert outs and outs[-1].finished and outs[-1].request_id == rid
    assert not llm.has_unfinished_requests()
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bf16_runs_every_architecture():
    for name in sorted(ARCHITECTURES):
        [out] = engine(name, dtype="bfloat16").generate(
            [prompts()[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            use_tqdm=False)
        assert len(out.token_ids) == 4 and not torch.tensor(out.token_ids).lt(0).any()
