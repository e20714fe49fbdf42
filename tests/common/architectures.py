"""Every architecture the decoder supports, as a tiny random-weight HF model on disk (nothing
downloaded), and HF `generate`'s greedy tokens for it: the reference the engine must equal, with
one process or several (tensor parallel). Head and MLP sizes divide by 2, for 2 ranks."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None, pad_token_id=None)
ARCHITECTURES = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),  # as SmolLM2
    # Every linear with a bias: o_proj and down_proj's are added once, on rank 0, under TP.
    "llama-bias": lambda: LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**TINY, use_sliding_window=False),  # q/k/v biases
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32),  # head_dim != hidden / heads, q/k norms
}


@functools.cache
def architecture_dir(name: str) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ARCHITECTURES[name](), attn_implementation="eager")
    with torch.no_grad():  # wider logits keep greedy argmax away from near-ties
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05).mul_(4.0)
    path = tempfile.mkdtemp(prefix=f"nanoserve-{name}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    model.save_pretrained(path)
    return path


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 37, 19, 70)]


@functools.cache
def hf_model(name: str):
    return AutoModelForCausalLM.from_pretrained(architecture_dir(name), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def hf_greedy(name: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = hf_model(name).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(name: str, tokens: list[int]) -> torch.Tensor:
    """log-softmax of HF's fp32 logits at every position of `tokens`: [len, vocab]."""
    with torch.no_grad():
        return hf_model(name)(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
