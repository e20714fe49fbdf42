"""The GPU's speed, outside the chapter: CUDA graphs for decode steps, torch.compile of the
element-wise modules, and sizing the KV cache from GPU memory after the largest steps ran.

CUDA graphs (§4's "one forward step"): the launch cost of a decode step's hundreds of small
kernels, not the arithmetic, sets the step time (§1: decode is memory bound). A graph records the
launches once and replays them in one call, for fixed shapes only: one graph per batch size of a
ladder, a decode batch padded to the next. If capture fails (a host sync, as in flash-attn after
2.8.3), decode runs eagerly. The runner wraps the model as a module with the model's own
interface, so the ModelRunner just calls it."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.config import EngineConfig
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models.decoder import RMSNorm, RotaryEmbedding, SiluAndMul
from nanoserve.sampling_params import SamplingParams


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def padded_batch_size(num_rows: int, sizes: list[int]) -> int | None:
    return next((s for s in sizes if s >= num_rows), None)


def pad_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      batch_size: int, padding_block: int, block_size: int, max_blocks: int,
                      ) -> tuple[torch.Tensor, ...]:
    """Pad a decode batch to `batch_size` rows, its block tables to `max_blocks` columns. A
    padding row: token 0 at position 0, K/V in `padding_block`'s first slot, reading it alone."""
    rows = (0, batch_size - meta.num_decode_tokens)  # F.pad: (before, after) on the last dim
    tables = meta.decode_block_tables
    return (F.pad(input_ids, rows), F.pad(positions, rows),
            F.pad(meta.slot_mapping, rows, value=padding_block * block_size),
            F.pad(meta.decode_context_lens, rows, value=1),
            F.pad(tables, (0, max_blocks - tables.shape[1], *rows), value=padding_block))


class CUDAGraphRunner(nn.Module):
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks: int,
                 padding_block: int, block_size: int) -> None:
        super().__init__()
        self.model, self.max_blocks, self.config = model, max_blocks, model.config
        self.compute_logits, self.attention_layers = model.compute_logits, model.attention_layers
        self.padding_block, self.block_size = padding_block, block_size
        self.sizes = graph_batch_sizes(max_num_seqs)
        max_bs, device = self.sizes[-1], next(model.parameters()).device
        # Static buffers: a graph reads its inputs from fixed addresses (three int64 rows here).
        self.input_ids, self.positions, self.slot_mapping = torch.zeros(
            3, max_bs, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        try:
            self._capture_all()
        except RuntimeError as e:  # e.g. a kernel that syncs with the host while capturing
            self.graphs.clear(), self.outputs.clear()
            warnings.warn(f"CUDA graph capture failed, decode runs eagerly: {e}",
                          RuntimeWarning, stacklevel=2)

    def _meta(self, bs: int) -> AttentionMetadata:
        empty = torch.zeros(1, dtype=torch.int32, device=self.input_ids.device)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs,
            decode_context_lens=self.context_lens[:bs], decode_block_tables=self.block_tables[:bs],
            num_prefill_tokens=0, cu_seqlens_q=empty, cu_seqlens_k=empty, max_seqlen_q=0,
            max_seqlen_k=0, prefill_block_tables=empty.view(1, 1)[:0])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model, pool = self.model, None
        self.slot_mapping.fill_(self.padding_block * self.block_size)
        self.block_tables.fill_(self.padding_block)
        for bs in reversed(self.sizes):  # largest first, so smaller ones reuse its pool
            args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            model(*args)  # warm up kernels (and lazy allocations) outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = model(*args)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step that fits replays a graph; any other runs the model eagerly."""
        n = meta.num_decode_tokens
        if not self.graphs or meta.num_prefill_tokens or n > self.sizes[-1]:
            return self.model(input_ids, positions, meta)
        bs = padded_batch_size(n, self.sizes)
        padded = pad_decode_inputs(input_ids, positions, meta, bs, self.padding_block,
                                   self.block_size, self.max_blocks)
        for buffer, value in zip((self.input_ids, self.positions, self.slot_mapping,
                                  self.context_lens, self.block_tables), padded):
            buffer[:bs].copy_(value)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


def compile_elementwise(model: nn.Module) -> None:
    """torch.compile the small element-wise modules (RMSNorm, SiLU-and-mul, RoPE), each into one
    kernel, as nano-vllm does on CUDA; compiled once per class (dynamic shapes) and bound to every
    instance. The decoder's code, and what it computes, stay as written."""
    compiled: dict[type, Callable] = {}
    for module in model.modules():
        if type(module) in (RMSNorm, SiluAndMul, RotaryEmbedding):
            cls = type(module)
            if cls not in compiled:
                compiled[cls] = torch.compile(cls.forward, dynamic=True)
            module.forward = compiled[cls].__get__(module)


def cuda_kv_budget(runner) -> int:
    """The ModelRunner's GPU memory left for KV: gpu_memory_utilization of the GPU, less what
    others use, the weights, the peak of the largest steps run on a one-block cache, and, where
    decode steps will be captured, the decode step's activations once more: the graphs keep
    them in a private pool, beside the allocator's memory that eager prefills use."""
    device = runner.device
    torch.cuda.empty_cache()
    runner._allocate_kv_cache(num_blocks=1)
    base, peaks = torch.cuda.memory_allocated(device), []
    for out in warmup_steps(runner.config):  # the logits and the sampler's buffers count too
        torch.cuda.reset_peak_memory_stats(device)
        runner.run_alone(out)
        peaks.append(torch.cuda.max_memory_allocated(device))
    graph_pool = 0 if runner.config.enforce_eager else peaks[-1] - base
    for attn in runner.attn_layers:  # drop the scratch cache's last references
        attn.bind(torch.empty(0), torch.empty(0), runner.backend)
    del runner.kv_cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use_by_others = total - free - torch.cuda.memory_allocated(device)
    return (int(total * runner.config.gpu_memory_utilization) - max(peaks) - graph_pool
            - in_use_by_others)


def warmup_steps(config: EngineConfig) -> list[SchedulerOutput]:
    """The largest steps the engine will run, all reading one scratch block: a full prefill
    budget of fresh sequences, and max_num_seqs decodes at max_model_len (the widest decode a
    CUDA graph captures)."""
    c, bs, steps = config, config.block_size, [SchedulerOutput(), SchedulerOutput()]

    def request(i: int, num_tokens: int, num_computed: int) -> Request:
        req = Request(f"warmup-{i}", [0] * num_tokens, SamplingParams(max_tokens=1))
        req.num_computed_tokens = num_computed
        req.block_table = [0] * -(-num_tokens // bs)
        return req

    for i, start in enumerate(range(0, c.max_num_batched_tokens, bs)):
        n = min(bs, c.max_num_batched_tokens - start)
        steps[0].scheduled.append(ScheduledRequest(request(i, n, 0), n, samples=True))
    for i in range(c.max_num_seqs):
        req = request(i, c.max_model_len, c.max_model_len - 1)
        steps[1].scheduled.append(ScheduledRequest(req, 1, samples=True, is_decode=True))
    return steps
