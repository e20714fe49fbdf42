"""GPU path logic that needs no GPU: backend selection, block-size rules, the CUDA-graph
batch-size ladder and the padding of decode inputs to a captured size."""

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
from nanoserve.engine.model_runner import resolve_block_size
from nanoserve.layers.attention import AttentionMetadata, select_backend


def test_cpu_selects_the_torch_twins():
    assert select_backend(torch.device("cpu"), "auto").name == "torch"
    assert select_backend(torch.device("cpu"), "torch").name == "torch"


def test_forcing_flash_attn_without_it_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend='flash-attn' cannot be used"):
        select_backend(torch.device("cpu"), "flash-attn")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend(torch.device("cpu"), "xformers")


def test_block_size_defaults_and_flash_attn_rule():
    assert resolve_block_size("torch", None) == 16
    assert resolve_block_size("torch", 7) == 7
    assert resolve_block_size("flash-attn", None) == 256
    assert resolve_block_size("flash-attn", 512) == 512
    with pytest.raises(ValueError, match="multiple of 256"):
        resolve_block_size("flash-attn", 16)


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


def test_graph_runner_plumbing_matches_eager_on_cpu(monkeypatch):
    from tiny_model import tiny_model_dir

    from nanoserve import LLM, SamplingParams

    def capture_stand_in(self: CUDAGraphRunner) -> None:
        self.slot_mapping.fill_(self.padding_block * self.block_size)
        self.block_tables.fill_(self.padding_block)
        hidden = self.model.config.hidden_size
        for bs in self.sizes:
            self.outputs[bs] = torch.empty(bs, hidden)
            self.graphs[bs] = ReplayEagerly(self, bs)

    monkeypatch.setattr(CUDAGraphRunner, "_capture_all", capture_stand_in)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    for use_graphs in (False, True):
        llm = LLM(tiny_model_dir(), num_kv_blocks=24, block_size=4, max_num_seqs=5)
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
