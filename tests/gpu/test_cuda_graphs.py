"""CUDA graphs without a GPU: the batch-size ladder, the padding of decode inputs to a captured
size, replay (stood in for on CPU) equal to eager in fp32 and bf16, and the eager fallback when
capture fails."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine import cuda_graph
from nanoserve.engine.cuda_graph import (
    CUDAGraphRunner,
    graph_batch_sizes,
    pad_decode_inputs,
    padded_batch_size,
)
from nanoserve.layers.attention import AttentionMetadata
from tests.common.graphs import capture_stand_in
from tests.common.tiny_model import tiny_model_dir


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_runner_plumbing_matches_eager_on_cpu(monkeypatch, dtype):

    from nanoserve import LLM, SamplingParams

    monkeypatch.setattr(CUDAGraphRunner, "_capture_all", capture_stand_in)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    for use_graphs in (False, True):
        llm = LLM(tiny_model_dir(), num_kv_blocks=24, block_size=4, max_num_seqs=5, dtype=dtype)
        runner = llm.model_runner
        if use_graphs:  # on CPU the engine never builds one; attach it by hand
            runner.model = CUDAGraphRunner(runner.model, 5, runner.max_blocks_per_seq,
                                            padding_block=runner.num_kv_blocks,
                                            block_size=runner.block_size)
            runner.decode_step = None  # the CPU fast path's, which would go around the graphs
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
        runner.model = CUDAGraphRunner(runner.model, 5, runner.max_blocks_per_seq,
                                        padding_block=runner.num_kv_blocks,
                                        block_size=runner.block_size)
    assert len(record) == 1
    assert runner.model.graphs == {}
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == eager
