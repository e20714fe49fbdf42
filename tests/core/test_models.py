"""The decoder against Hugging Face transformers: same logits, whole prompts and paged steps."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from nanoserve.models.loader import load_model
from tests.common.helpers import bind_kv_cache, run_step

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6)
TINY_CONFIGS = {
    # tied embeddings, like SmolLM2; rope_theta as in SmolLM2
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    # explicit head_dim != hidden / heads, and per-head q/k norms
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
}
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    """(hf_model, nanoserve_model, model_dir) for a random-weight tiny model saved to disk."""
    torch.manual_seed(0)
    config = TINY_CONFIGS[request.param]()
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # make norms and biases non-trivial, so loading them matters
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, config = load_model(str(path), torch.float32, torch.device("cpu"))
    assert config.model_type == request.param
    return hf.eval(), model, str(path)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def prompt(n: int, seed: int = 1) -> list[int]:
    return random.Random(seed).choices(range(256), k=n)


def shuffled_blocks(n: int, seed: int = 2) -> list[int]:
    """Non-contiguous block ids, so the test exercises the block table, not slot == pos."""
    blocks = list(range(16))
    random.Random(seed).shuffle(blocks)
    return blocks[:n]


def test_whole_prompt_matches_hf(tiny):
    hf, model, _ = tiny
    ids = prompt(13)
    bind_kv_cache(model, num_blocks=16, block_size=BLOCK_SIZE)
    ours = run_step(model, ids, [(shuffled_blocks(4), 0, len(ids))], BLOCK_SIZE)
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_chunked_prefill_matches_hf(tiny):
    """Prefill 5 tokens, then the next 7 as a second chunk that attends to the cached 5."""
    hf, model, _ = tiny
    ids, table = prompt(12), shuffled_blocks(3)
    bind_kv_cache(model, num_blocks=16, block_size=BLOCK_SIZE)
    first = run_step(model, ids[:5], [(table, 0, 5)], BLOCK_SIZE)
    second = run_step(model, ids[5:], [(table, 5, 7)], BLOCK_SIZE)
    torch.testing.assert_close(torch.cat([first, second]), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_token_by_token_decode_matches_hf(tiny):
    hf, model, _ = tiny
    ids, table = prompt(20), shuffled_blocks(5)
    expected = hf_logits(hf, ids)
    bind_kv_cache(model, num_blocks=16, block_size=BLOCK_SIZE)
    run_step(model, ids[:6], [(table, 0, 6)], BLOCK_SIZE)
    for pos in range(6, len(ids)):
        step = run_step(model, [ids[pos]], [(table, pos, 1)], BLOCK_SIZE)
        torch.testing.assert_close(step[0], expected[pos], atol=1e-4, rtol=0)


def test_mixed_batch_matches_hf(tiny):
    """One step with two decodes and two prefill chunks (one mid-prompt) of four requests."""
    hf, model, _ = tiny
    prompts = [prompt(n, seed) for n, seed in ((9, 3), (7, 4), (11, 5), (6, 6))]
    tables = [[0, 5, 9], [2, 7], [12, 1, 14], [3, 8]]
    bind_kv_cache(model, num_blocks=16, block_size=BLOCK_SIZE)
    cached = [8, 6, 4, 0]  # requests 0, 1 decode their last token; 2 and 3 prefill the rest
    for p, t, c in zip(prompts, tables, cached):
        if c:
            run_step(model, p[:c], [(t, 0, c)], BLOCK_SIZE)
    seqs = [(t, c, len(p) - c) for p, t, c in zip(prompts, tables, cached)]
    tokens = [tok for p, c in zip(prompts, cached) for tok in p[c:]]
    logits = run_step(model, tokens, seqs, BLOCK_SIZE)
    start = 0
    for p, c in zip(prompts, cached):
        expected = hf_logits(hf, p)[c:]
        torch.testing.assert_close(logits[start:start + len(expected)], expected, atol=1e-4,
                                   rtol=0)
        start += len(expected)


def test_bf16_load_runs(tiny):
    """The meta-device build + dtype cast path: bf16 weights, fp32 RoPE tables."""
    hf, _, path = tiny
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32
    bind_kv_cache(model, num_blocks=16, block_size=BLOCK_SIZE, dtype=torch.bfloat16)
    ids = prompt(10)
    ours = run_step(model, ids, [(shuffled_blocks(3), 0, 10)], BLOCK_SIZE).float()
    assert (ours.argmax(-1) == hf_logits(hf, ids).argmax(-1)).float().mean() > 0.8


# --- errors -------------------------------------------------------------------------------


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2") as err:
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    assert "llama" in str(err.value) and "qwen3" in str(err.value)


def test_scaled_rope_is_refused(tmp_path):
    config = LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0})
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="linear"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_directory_without_weights(tmp_path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY))
    hf.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if "layers.1.mlp" not in k}
    state["model.extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight") as err:
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    assert "model.extra.weight" in str(err.value)
