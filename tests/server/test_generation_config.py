"""The model's recommended sampling (generation_config.json), as vLLM applies it: what a request
leaves unset takes the model's temperature / top_p / top_k (max_new_tokens: the most tokens),
offline (`LLM.generate` without sampling params) and served (a request without them); what
nanoserve cannot apply is said, not silently dropped; "vllm" turns it off; vLLM's
override_generation_config sets over it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from nanoserve import LLM, SamplingParams
from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, TINY_CONFIG, TINY_FLAGS, ServerProcess

RECOMMENDED = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "max_new_tokens": 5,
               "repetition_penalty": 1.1, "do_sample": True, "bos_token_id": 1, "eos_token_id": 2}
AS_PARAMS = SamplingParams(temperature=0.5, top_p=0.9, top_k=7, max_tokens=5)
PROMPTS = ["The quick brown fox", [5, 17, 3, 250, 8, 41], "Xin chào"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny model with a generation_config.json that recommends sampling settings."""
    path = tmp_path_factory.mktemp("recommending")
    for f in Path(tiny_model_dir(MAX_MODEL_LEN)).iterdir():
        shutil.copy(f, path / f.name)
    (path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return str(path)


def texts(outputs) -> list[str]:
    return [o.text for o in outputs]


def test_offline_defaults_are_the_models(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        llm = LLM(model_dir, **TINY_CONFIG)
    assert "repetition_penalty=1.1, which nanoserve does not apply" in caplog.text
    assert llm.get_default_sampling_params() == AS_PARAMS
    got = llm.generate(PROMPTS, use_tqdm=False)  # the engine's generator: seed 0, as below
    assert max(len(o.outputs[0].token_ids) for o in got) == 5  # max_new_tokens
    plain = LLM(model_dir, generation_config="vllm", **TINY_CONFIG)
    assert plain.get_default_sampling_params() == SamplingParams()
    assert texts(got) == texts(plain.generate(PROMPTS, AS_PARAMS, use_tqdm=False))
    for bad in ("no/such/folder", None):
        with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a"):
            LLM(model_dir, generation_config=bad, **TINY_CONFIG)
    with pytest.raises(TypeError):  # keyword only: vLLM's second positional is the tokenizer
        LLM(model_dir, model_dir)


def test_served_defaults_are_the_models(model_dir):
    s = ServerProcess(model_dir, TINY_FLAGS)
    try:
        client, messages = s.client(), [{"role": "user", "content": "Tell me a story"}]

        def chat(top_k=None, **kw):
            return client.chat.completions.create(
                model="m", messages=messages, seed=11,
                extra_body={"ignore_eos": True, **({} if top_k is None else {"top_k": top_k})},
                **kw)

        unset = chat()  # the model's sampling, and at most its max_new_tokens
        assert unset.usage.completion_tokens == 5
        given = chat(temperature=0.5, top_p=0.9, top_k=7, max_tokens=5)
        assert unset.choices[0].message.content == given.choices[0].message.content
        assert chat(temperature=1.0, top_p=1.0, max_tokens=30).usage.completion_tokens == 30
        out = client.completions.create(model="m", prompt="Once", max_tokens=None, seed=3,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 16  # vLLM's: a completion's null is 16
        r = client.responses.create(model="m", input="Hi", extra_body={"ignore_eos": True})
        assert (r.usage.output_tokens, r.temperature, r.top_p) == (5, 0.5, 0.9)
    finally:
        assert s.stop() == 0
    with pytest.raises(RuntimeError, match="generation_config must be"):
        ServerProcess(model_dir, [*TINY_FLAGS, "--generation-config", "no/such/folder"])


def test_override_generation_config_sets_over_the_models(model_dir):
    """vLLM's override_generation_config: the file's names, over the model's file ("auto") or
    alone ("vllm"); checked once, at the start, as SamplingParams checks them."""
    llm = LLM(model_dir, override_generation_config={"temperature": 0.2, "max_new_tokens": 9},
              **TINY_CONFIG)
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.2, top_p=0.9, top_k=7, max_tokens=9)
    alone = LLM(model_dir, generation_config="vllm", override_generation_config={"top_k": 3},
                **TINY_CONFIG)
    assert alone.get_default_sampling_params() == SamplingParams(top_k=3)
    with pytest.raises(ValueError, match="override_generation_config must be a dict"):
        LLM(model_dir, override_generation_config=[0.5], **TINY_CONFIG)
    with pytest.raises(ValueError, match=r"^temperature must be a number in \[0, 2\], got -1"):
        LLM(model_dir, override_generation_config={"temperature": -1}, **TINY_CONFIG)


def test_served_overrides_and_token_ids_by_flag(model_dir):
    s = ServerProcess(model_dir, [*TINY_FLAGS, "--override-generation-config",
                                  '{"max_new_tokens": 3}', "--return-tokens-as-token-ids"])
    try:
        body = {"model": "m", "prompt": [5, 6, 7], "logprobs": 0, "max_tokens": None}
        out = s.client().completions.create(**body, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3  # the override's max_new_tokens
        chat = s.client().chat.completions.create(  # caps an asked-for limit too (vLLM's)
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=10,
            extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3
        assert all(t.startswith("token_id:") for t in out.choices[0].logprobs.tokens)
        off = s.client().completions.create(**body, extra_body={  # the request's own
            "ignore_eos": True, "return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in off.choices[0].logprobs.tokens)
    finally:
        assert s.stop() == 0
    with pytest.raises(RuntimeError, match="top_p must be in"):
        ServerProcess(model_dir, [*TINY_FLAGS, "--override-generation-config", '{"top_p": 2}'])
