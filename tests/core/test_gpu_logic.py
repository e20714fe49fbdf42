"""GPU path logic of the chapter core that needs no GPU: backend selection (given dtype and a
simulated compute capability), block-size rules and the KV budget. (CUDA graphs, a fast path:
tests/accel/test_cuda_graphs.py.)"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types

import pytest
import torch

from nanoserve import config
from nanoserve.config import (
    EngineConfig,
    batch_defaults,
    flash_attn_missing,
    resolve_attention_backend,
    resolve_block_size,
    resolve_config,
)
from nanoserve.layers.attention import get_backend

CPU, CUDA, BF16, FP32 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, torch.float32


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """flash_attn cannot be installed here: an importable stand-in, to test the choice."""
    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.flash_attn_varlen_func = module.flash_attn_with_kvcache = lambda *a, **kw: None
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: module.__spec__
                        if name == "flash_attn" else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # device="cuda" passes the check
    return lambda cc: monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc)


find_spec = importlib.util.find_spec


def test_cpu_selects_the_torch_twins():
    assert resolve_attention_backend("auto", CPU, FP32) == "torch"
    assert resolve_attention_backend("torch", CPU, FP32) == "torch"
    assert get_backend("torch").name == "torch"


def test_forcing_flash_attn_without_it_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend='flash-attn' cannot be used"):
        resolve_attention_backend("flash-attn", CPU, BF16)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="xformers")


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_auto_picks_flash_attn_on_ampere_or_newer_in_half_precision(fake_flash_attn, dtype):
    for cc in ((8, 0), (9, 0)):
        fake_flash_attn(cc)
        assert resolve_attention_backend("auto", CUDA, dtype) == "flash-attn"
        assert get_backend("flash-attn").name == "flash-attn"
    assert resolve_attention_backend("torch", CUDA, dtype) == "torch"


@pytest.mark.parametrize(("dtype", "cc", "why"), [(FP32, (9, 0), "float32"),
                                                  (BF16, (7, 5), "compute capability")])
def test_auto_falls_back_to_torch_for_fp32_or_old_gpus_and_says_why(
        fake_flash_attn, caplog, dtype, cc, why):
    fake_flash_attn(cc)
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        assert resolve_attention_backend("auto", CUDA, dtype) == "torch"
    assert [r for r in caplog.records if why in r.getMessage()], caplog.text


def test_a_flash_attn_that_does_not_import_is_said(monkeypatch, caplog):
    """Installed against another torch: the engine says so, and why, instead of a silent twin."""
    spec = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec
                        if name == "flash_attn" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        assert resolve_attention_backend("auto", CPU, BF16) == "torch"
    assert "installed but does not import" in caplog.text
    assert "does not import" in flash_attn_missing(CUDA, BF16)


@pytest.mark.parametrize(("dtype", "cc", "why"), [(FP32, (9, 0), "float16 or bfloat16"),
                                                  (BF16, (7, 5), "8.0")])
def test_forcing_flash_attn_with_fp32_or_an_old_gpu_is_a_clear_error(fake_flash_attn, dtype,
                                                                      cc, why):
    fake_flash_attn(cc)
    with pytest.raises(ValueError, match=why):
        resolve_attention_backend("flash-attn", CUDA, dtype)


@pytest.mark.parametrize(("name", "gib", "llm", "server"), [
    ("NVIDIA H200", 141, (1024, 16384), (1024, 8192)),
    ("NVIDIA H100 80GB HBM3", 79.6, (1024, 16384), (1024, 8192)),
    ("NVIDIA A100-SXM4-80GB", 80, (256, 8192), (256, 2048)),
    ("NVIDIA B200", 180, (1024, 16384), (1024, 16384)),
    ("NVIDIA L4", 22, (256, 8192), (256, 2048))])
def test_batch_defaults_on_a_gpu_are_vllms(monkeypatch, name, gib, llm, server):
    """vLLM 0.32's EngineArgs.get_batch_defaults: by memory, an A100 counting as small."""
    monkeypatch.setattr(config, "gpu_of", lambda device: (name, gib))
    assert batch_defaults("cuda", "llm") == llm
    assert batch_defaults("cuda:1", "server") == server
    hf = types.SimpleNamespace(max_position_embeddings=4096)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(config, "resolve_attention_backend", lambda *a: "torch")
    for usage, expected in (("llm", llm), ("server", server)):
        resolved = resolve_config(EngineConfig(usage_context=usage), hf)
        assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == expected
        assert resolved.device == "cuda" and resolved.torch_compile
    mine = resolve_config(EngineConfig(max_num_seqs=3, max_num_batched_tokens=77), hf)
    assert (mine.max_num_seqs, mine.max_num_batched_tokens) == (3, 77)
    assert not resolve_config(EngineConfig(enforce_eager=True), hf).torch_compile


def test_batch_defaults_on_a_cpu_and_without_chunked_prefill():
    hf = types.SimpleNamespace(max_position_embeddings=4096)
    resolved = resolve_config(EngineConfig(device="cpu"), hf)
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == config.CPU_DEFAULTS["llm"]
    assert not resolved.torch_compile
    whole = resolve_config(EngineConfig(device="cpu", enable_chunked_prefill=False), hf)
    assert whole.max_num_batched_tokens == 4096  # a whole prompt fits one step



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


def test_the_kv_budget_warmup_steps_run_on_one_scratch_block():
    """What cuda_kv_budget measures on a GPU: a full prefill budget, then max_num_seqs
    decodes at max_model_len; both run (here on a CPU) on a cache of one block."""
    from nanoserve import LLM
    from nanoserve.engine.cuda_graph import warmup_steps
    from tests.common.tiny_model import tiny_model_dir

    llm = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=8, block_size=16,
              max_num_seqs=5, max_num_batched_tokens=70, max_model_len=300,
              skip_tokenizer_init=True, enable_fast_paths=False)
    runner = llm.model_runner
    prefill, decode = warmup_steps(runner.config)
    assert prefill.num_scheduled_tokens == 70 and len(decode.scheduled) == 5
    assert all(s.request.num_computed_tokens == 299 for s in decode.scheduled)
    runner._allocate_kv_cache(num_blocks=1)
    for step in (prefill, decode):
        out = runner.execute_model(step)
        assert len(out.token_ids) == len(step.scheduled)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_the_kv_budget_counts_the_decode_graphs_pool_once_more(monkeypatch, enforce_eager):
    """cuda_kv_budget's arithmetic, torch.cuda's memory counters faked: a GPU of 1000 bytes, 100
    held by others, 200 by the weights and scratch block; the prefill step peaks 50 above that,
    the decode step 30. CUDA graphs keep the decode step's 30 in their own pool (the GPU check
    on an H200 used 93% of the GPU at gpu_memory_utilization 0.9 before they were counted)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from nanoserve import LLM
    from nanoserve.engine import cuda_graph
    from tests.common.tiny_model import tiny_model_dir

    llm = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=8, block_size=16,
              max_num_seqs=5, max_num_batched_tokens=70, max_model_len=300,
              skip_tokenizer_init=True, enable_fast_paths=False)
    runner, mem, above = llm.model_runner, {"allocated": 200, "peak": 0}, iter([50, 30])
    monkeypatch.setattr(runner, "config", replace(runner.config, gpu_memory_utilization=0.9,
                                                  enforce_eager=enforce_eager))
    monkeypatch.setattr(runner, "run_alone", lambda out: mem.update(
        peak=mem["allocated"] + next(above)))
    monkeypatch.setattr(cuda_graph.torch, "cuda", SimpleNamespace(
        empty_cache=lambda: None, memory_allocated=lambda device: mem["allocated"],
        reset_peak_memory_stats=lambda device: mem.update(peak=mem["allocated"]),
        max_memory_allocated=lambda device: mem["peak"],
        mem_get_info=lambda device: (1000 - 100 - mem["allocated"], 1000)))
    assert cuda_graph.cuda_kv_budget(runner) == 900 - 250 - 100 - (0 if enforce_eager else 30)
