"""Bigger benchmark models without a hub: random weights in a real model's shape (its public
config.json's sizes), saved as an HF directory with the bundled SmolLM2 tokenizer. Sizes only:
the text such a model writes is noise, but a step moves the same bytes and FLOPs."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

NO_SPECIAL = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
SHAPES = {
    "qwen3-0.6b": lambda: Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1_000_000, tie_word_embeddings=True,
        **NO_SPECIAL),
    "llama-3.2-1b": lambda: LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
        **NO_SPECIAL),
    "smollm2-135m": lambda: LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000, tie_word_embeddings=True, **NO_SPECIAL),
    "tiny-llama": lambda: LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        **NO_SPECIAL),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def make_random_model(shape: str, out: str | None = None, dtype: torch.dtype = torch.bfloat16,
                      device: str = "cpu", tokenizer: bool = True) -> str:
    """Write a random-weight model of `shape` to `out` (default: a temporary directory) and
    return its path. Llama-3.2-1B's RoPE scaling is left out: nanoserve runs default RoPE, and
    the cost of a step does not depend on it. The tokenizer (when the vocabulary holds it) is
    the bundled one."""
    torch.manual_seed(0)
    config = SHAPES[shape]()
    path = Path(out or tempfile.mkdtemp(prefix=f"nanoserve-{shape}-"))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    del model
    if tokenizer and config.vocab_size >= 49152:
        from nanoserve.entrypoints.bundled import default_model_dir

        for name in TOKENIZER_FILES:
            if (Path(default_model_dir()) / name).is_file():
                shutil.copy(Path(default_model_dir()) / name, path / name)
    return str(path)
