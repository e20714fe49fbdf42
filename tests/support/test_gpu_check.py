"""The tensor logic of scripts/dev/gpu_check.py's one-shot checks, run on CPU: the torch twins
against a dense fp64 reference on shuffled, NaN-poisoned block tables (chunks starting
mid-page, lengths crossing 256 and 512, GQA groups 1, 3 and 8), and the CUDA-graph replay
vs eager check with a CPU stand-in for the captured graph. On a GPU the same functions
compare flash-attn with the fp32 twin."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))
import gpu_check  # noqa: E402

from nanoserve.layers import torch_attention  # noqa: E402

TWINS = (torch_attention.flash_attn_varlen_func, torch_attention.flash_attn_with_kvcache)


def test_cases_cover_mid_page_chunks_long_lengths_and_gqa_groups():
    lens = [pair for case, _ in gpu_check.KERNEL_CASES.values() for pair in case]
    assert {group for _, group in gpu_check.KERNEL_CASES.values()} == {1, 3, 8}
    assert any((ctx - chunk) % 256 and chunk > 1 for ctx, chunk in lens)  # mid-page chunk
    assert any(ctx > 256 for ctx, _ in lens) and any(ctx > 512 for ctx, _ in lens)
    case = gpu_check.paged_case(*gpu_check.KERNEL_CASES["chunks mid-page, GQA 3"], 16)
    assert case["k"].isnan().any() and case["v"].isnan().any()  # unused blocks are poisoned


@pytest.mark.parametrize("block_size", [16, 256])
def test_fp32_twins_match_the_dense_reference(block_size):
    rows = gpu_check.check_kernels(
        "twins", lambda c: gpu_check.run_backend(*TWINS, c, torch.float32, "cpu"),
        gpu_check.dense_reference, block_size, gpu_check.FP32_ATOL)
    assert len(rows) == 3 and all(ok for *_, ok in rows), rows


def test_whole_kernel_check_passes_on_cpu():
    """What the script runs where flash-attn is absent, incl. the bf16 twins standing in
    for flash-attn with its contract checks on."""
    rows = gpu_check.kernel_checks("cpu")
    assert len(rows) == 6 and all(ok for *_, ok in rows), rows


def test_kernel_check_fails_a_kernel_that_reads_an_unused_block():
    def ignores_table(q, k, v, **kw):  # reads blocks 0, 1, ... instead of the table's
        kw["block_table"] = torch.arange(kw["block_table"].numel(), dtype=torch.int32).view(
            kw["block_table"].shape) % k.shape[0]
        return TWINS[0](q, k, v, **kw)

    rows = gpu_check.check_kernels(
        "broken", lambda c: gpu_check.run_backend(ignores_table, TWINS[1], c, torch.float32,
                                                  "cpu"),
        gpu_check.dense_reference, 16, gpu_check.FP32_ATOL)
    assert not any(ok for *_, ok in rows)


@pytest.fixture(params=["float32", "bfloat16"])
def cpu_graphs(monkeypatch, request):
    """An LLM on CPU with a CUDAGraphRunner whose 'graphs' recompute eagerly (see
    test_gpu_logic.capture_stand_in): the plumbing around capture is real."""
    from nanoserve import LLM
    from nanoserve.engine.cuda_graph import CUDAGraphRunner
    from tests.common.graphs import capture_stand_in
    from tests.common.tiny_model import tiny_model_dir

    monkeypatch.setattr(CUDAGraphRunner, "_capture_all", capture_stand_in)
    llm = LLM(tiny_model_dir(), num_kv_blocks=64, max_num_seqs=8, max_model_len=1024,
              skip_tokenizer_init=True, dtype=request.param)
    runner = llm.model_runner
    runner.model = CUDAGraphRunner(runner.model, 8, runner.max_blocks_per_seq,
                                    padding_block=runner.num_kv_blocks,
                                    block_size=runner.block_size)
    return llm


def test_graph_vs_eager_check_on_cpu(cpu_graphs):
    result = gpu_check.graph_vs_eager(cpu_graphs)
    assert result["rows"] == 3 and result["padded_to"] == 4
    assert result["logits_within_tolerance"]  # not bitwise: 4 padded rows vs 3 differ
    assert result["writes_only_own_slots_and_sink"] and result["padding_outputs_finite"]


def test_graph_vs_eager_check_catches_padding_rows_writing_outside_the_sink(cpu_graphs):
    cpu_graphs.model_runner.model.padding_block = 0  # a block a real request may own
    result = gpu_check.graph_vs_eager(cpu_graphs)
    assert not result["writes_only_own_slots_and_sink"]
