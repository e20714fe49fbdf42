"""A CPU stand-in for CUDA-graph capture, so the plumbing around it (static buffers, padding
rows, the padding block) runs for real without a GPU."""

from __future__ import annotations

import torch

from nanoserve.engine.cuda_graph import CUDAGraphRunner


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
