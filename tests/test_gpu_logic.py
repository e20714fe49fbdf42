"""GPU path logic that needs no GPU: backend selection (given dtype and a simulated compute
capability), block-size rules, the KV budget, the CUDA-graph batch-size ladder, the padding
of decode inputs to a captured size, and the eager fallback when capture fails."""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

import pytest
import torch

from nanoserve.config import resolve_block_size
from nanoserve.engine import cuda_graph
from nanoserve.engine.cuda_graph import (
    CUDAGraphRunner,
    graph_batch_sizes,
    pad_decode_inputs,
    padded_batch_size,
)
from nanoserve.layers import attention
from nanoserve.layers.attention import AttentionMetadata, select_backend

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
    from tiny_model import tiny_model_dir

    from nanoserve import LLM
    from nanoserve.engine import model_runner

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the backend check")

    monkeypatch.setattr(model_runner, "load_model", no_load)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        LLM(tiny_model_dir(), device="cuda", dtype="float32", attention_backend="flash-attn",
            skip_tokenizer_init=True)


def test_kv_budget_counts_the_sink_block():
    """The cache holds num_kv_blocks + 1 blocks (the CUDA-graph sink): all within budget."""
    from tiny_model import tiny_model_dir

    from nanoserve import LLM

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


def test_graph_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert padded_batch_size(65, sizes) is None


def test_pad_decode_inputs_points_padding_rows_at_the_padding_block():
    n, bs, block_size, padding_block, max_blocks = 3, 8, 4, 10, 5
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 9, 2]), num_decode_tokens=n,
        decode_context_lens=torch.tensor([6, 10, 3], dtype=torch.int32),
        decode_block_tables=torch.tensor([[1, 2, 0], [3, 4, 7], [0, 0, 0]], dtype=torch.int32),
        num_prefill_tokens=0, cu_seqlens_q=torch.zeros(1), cu_seqlens_k=torch.zeros(1),
        max_seqlen_q=0, max_seqlen_k=0, prefill_block_tables=torch.zeros(0, 1))
    ids, pos, slots, lens, tables = pad_decode_inputs(
        torch.tensor([11, 12, 13]), torch.tensor([5, 9, 2]), meta, bs, padding_block,
        block_size, max_blocks)
    assert ids.tolist() == [11, 12, 13] + [0] * 5
    assert pos.tolist() == [5, 9, 2] + [0] * 5
    assert slots.tolist() == [5, 9, 2] + [padding_block * block_size] * 5
    assert lens.tolist() == [6, 10, 3] + [1] * 5
    assert tables.shape == (bs, max_blocks)
    assert tables[0].tolist() == [1, 2, 0, padding_block, padding_block]
    assert (tables[n:] == padding_block).all()


class ReplayEagerly:
    """A CPU stand-in for a captured CUDA graph: `replay()` recomputes the model on the
    runner's static buffers, which is what the real graph's kernels do. Everything around
    the capture (buffer plumbing, padding rows, the padding block) is then real."""

    def __init__(self, graphs: CUDAGraphRunner, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        g, bs = self.graphs, self.bs
        g.outputs[bs].copy_(g.model(g.input_ids[:bs], g.positions[:bs], g._meta(bs)))


def capture_stand_in(self: CUDAGraphRunner) -> None:
    """CUDAGraphRunner._capture_all on CPU: the same static buffers, eager 'graphs'; the
    outputs in the model's dtype, as a captured forward leaves them."""
    self.slot_mapping.fill_(self.padding_block * self.block_size)
    self.block_tables.fill_(self.padding_block)
    dtype = next(self.model.parameters()).dtype
    for bs in self.sizes:
        self.outputs[bs] = torch.empty(bs, self.model.config.hidden_size, dtype=dtype)
        self.graphs[bs] = ReplayEagerly(self, bs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_runner_plumbing_matches_eager_on_cpu(monkeypatch, dtype):
    from tiny_model import tiny_model_dir

    from nanoserve import LLM, SamplingParams

    monkeypatch.setattr(CUDAGraphRunner, "_capture_all", capture_stand_in)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    for use_graphs in (False, True):
        llm = LLM(tiny_model_dir(), num_kv_blocks=24, block_size=4, max_num_seqs=5, dtype=dtype)
        runner = llm.model_runner
        if use_graphs:  # on CPU the engine never builds one; attach it by hand
            runner.graphs = CUDAGraphRunner(runner.model, 5, runner.max_blocks_per_seq,
                                            padding_block=runner.num_kv_blocks,
                                            block_size=runner.block_size)
            sizes = []  # (rows, captured size) of every replay
            monkeypatch.setattr(cuda_graph, "padded_batch_size", _recording(sizes))
        results.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.stats().num_preemptions > 0  # padding rows must not disturb resumed KV
    assert results[0] == results[1]
    assert any(n < bs for n, bs in sizes) and any(n == bs for n, bs in sizes)


def _recording(seen: list[tuple[int, int]]):
    def padded(num_rows: int, sizes: list[int]) -> int | None:
        bs = padded_batch_size(num_rows, sizes)
        seen.append((num_rows, bs))
        return bs
    return padded


def test_failed_capture_falls_back_to_eager_decode_with_one_warning(monkeypatch):
    """A kernel that syncs with the host during capture (e.g. flash-attn after 2.8.3, whose
    paged decode calls `.item()`) makes capture fail: decode then runs eagerly, and the
    engine says so once instead of crashing at start-up."""
    from tiny_model import tiny_model_dir

    from nanoserve import LLM, SamplingParams

    class FailingCapture:
        def __init__(self, graph, pool=None) -> None:
            pass

        def __enter__(self):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

        def __exit__(self, *exc) -> bool:
            return False

    prompts = [[5 + i] * (3 + 4 * i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    config = dict(num_kv_blocks=24, block_size=4, max_num_seqs=5, skip_tokenizer_init=True)
    eager = [o.token_ids for o in LLM(tiny_model_dir(), **config).generate(
        prompts, params, use_tqdm=False)]
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", FailingCapture)
    llm = LLM(tiny_model_dir(), **config)
    runner = llm.model_runner
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed") as record:
        runner.graphs = CUDAGraphRunner(runner.model, 5, runner.max_blocks_per_seq,
                                        padding_block=runner.num_kv_blocks,
                                        block_size=runner.block_size)
    assert len(record) == 1
    assert runner.graphs.graphs == {}
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == eager
