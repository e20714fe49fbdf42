"""A tiny random-weight Llama with the bundled SmolLM2 tokenizer, for engine tests that need
a real `LLM` (validation, abort, forward errors) but not real text. Nothing is downloaded:
the weights are random and the tokenizer files are copied from the bundled model's cache.

Built once per process (functools.cache) so every test module shares one directory.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from nanoserve.entrypoints.bundled import default_model_dir

# vocab_size equals the bundled tokenizer's, so every id the tokenizer makes is in range.
VOCAB_SIZE = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


@functools.cache
def tiny_model_dir(max_position_embeddings: int = 2048, head_dim: int = 16) -> str:
    """head_dim 16 (4 heads, 2 KV heads); 64: the size the CPU attention kernels specialize."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=4 * head_dim, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF's init (std 0.02) gives near-flat logits; widen them so
        for p in model.parameters():  # greedy argmax is far from ties (batch-invariant)
            p.mul_(5.0)
    path = Path(tempfile.mkdtemp(prefix="nanoserve-tiny-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    model.save_pretrained(path)
    src = Path(default_model_dir())
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, path / name)
    return str(path)
