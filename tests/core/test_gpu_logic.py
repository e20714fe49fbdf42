"""GPU path logic of the chapter core that needs no GPU: backend selection (given dtype and a
simulated compute capability), block-size rules and the KV budget. (CUDA graphs, a fast path:
tests/accel/test_cuda_graphs.py.)"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

import pytest
import torch

from nanoserve.config import resolve_block_size
from nanoserve.layers import attention
from nanoserve.layers.attention import select_backend

CPU, CUDA, BF16, FP32 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, torch.float32


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """flash_attn cannot be installed here: an importable stand-in, to test the choice."""
    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.flash_attn_varlen_func = module.flash_attn_with_kvcache = lambda *a, **kw: None
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(attention, "_fallbacks_logged", set())  # "once" starts afresh
    return module


def test_cpu_selects_the_torch_twins():
    assert select_backend(CPU, FP32, "auto").name == "torch"
    assert select_backend(CPU, FP32, "torch").name == "torch"


def test_forcing_flash_attn_without_it_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend='flash-attn' cannot be used"):
        select_backend(CPU, BF16, "flash-attn")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend(CPU, FP32, "xformers")


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_auto_picks_flash_attn_on_ampere_or_newer_in_half_precision(fake_flash_attn, dtype):
    for cc in ((8, 0), (9, 0)):
        assert select_backend(CUDA, dtype, "auto", compute_capability=cc).name == "flash-attn"
    assert select_backend(CUDA, dtype, "torch", compute_capability=(9, 0)).name == "torch"


@pytest.mark.parametrize(("dtype", "cc", "why"), [(FP32, (9, 0), "float32"),
                                                  (BF16, (7, 5), "compute capability")])
def test_auto_falls_back_to_torch_for_fp32_or_old_gpus_and_says_why_once(
        fake_flash_attn, caplog, dtype, cc, why):
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        for _ in range(3):
            assert select_backend(CUDA, dtype, "auto", compute_capability=cc).name == "torch"
    notes = [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert len(notes) == 1, caplog.text


@pytest.mark.parametrize(("dtype", "cc", "why"), [(FP32, (9, 0), "float16 or bfloat16"),
                                                  (BF16, (7, 5), "8.0")])
def test_forcing_flash_attn_with_fp32_or_an_old_gpu_is_a_clear_error(fake_flash_attn, dtype,
                                                                      cc, why):
    with pytest.raises(ValueError, match=why):
        select_backend(CUDA, dtype, "flash-attn", compute_capability=cc)


def test_forced_flash_attn_with_fp32_fails_before_weights_load(fake_flash_attn, monkeypatch):
    from nanoserve import LLM
    from nanoserve.engine import model_runner
    from tests.common.tiny_model import tiny_model_dir

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the backend check")

    monkeypatch.setattr(model_runner, "load_model", no_load)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        LLM(tiny_model_dir(), device="cuda", dtype="float32", attention_backend="flash-attn",
            skip_tokenizer_init=True)


def test_kv_budget_counts_the_sink_block():
    """The cache holds num_kv_blocks + 1 blocks (the CUDA-graph sink): all within budget."""
    from nanoserve import LLM
    from tests.common.tiny_model import tiny_model_dir

    gib = 0.001
    runner = LLM(tiny_model_dir(), kv_cache_memory_gib=gib, skip_tokenizer_init=True).model_runner
    kv = runner.kv_cache
    assert kv.shape[2] == runner.num_kv_blocks + 1
    assert kv.numel() * kv.element_size() <= gib * 2**30


def test_block_size_defaults_and_flash_attn_rule():
    """vLLM's defaults: 128 on a CPU, 16 on CUDA; flash-attn's paged KV: multiples of 256."""
    assert resolve_block_size("torch", None, "cpu") == 128
    assert resolve_block_size("torch", None, "cuda:1") == 16
    assert resolve_block_size("torch", 7, "cpu") == 7
    assert resolve_block_size("flash-attn", None, "cuda") == 256
    assert resolve_block_size("flash-attn", 512, "cuda") == 512
    with pytest.raises(ValueError, match="multiple of 256"):
        resolve_block_size("flash-attn", 16, "cuda")
