"""§1: the decoder's linear layers, as vLLM and nano-vllm write them: one GEMM serves every row of
the step, and inputs that share an activation are merged into one weight (q, k, v into `qkv_proj`;
gate, up into `gate_up_proj`), so a layer makes four GEMM calls, not seven. The loader fills a
merged weight from HF's separate tensors, each through `weight_loader` (models/loader.py).

Each layer is also a tensor-parallel one, a constructor argument away (Megatron's split, vLLM's
names): a `ColumnParallelLinear` holds this rank's slice of the outputs (its heads, its part of the
MLP), a `RowParallelLinear` this rank's slice of the inputs and sums the partial outputs of all
ranks (one all-reduce). With `tp_size=1`, the default, both are a plain `nn.Linear`."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoserve.utils import divide


class ColumnParallelLinear(nn.Linear):
    """y = x W^T + b for this rank's output columns. `output_sizes`: the merged parts (q, k, v;
    gate, up; or one), each split over the ranks: this rank holds its slice of each, in a row."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0, name: str = "output size") -> None:
        self.output_sizes = [divide(size, tp_size, name) for size in output_sizes]
        super().__init__(input_size, sum(self.output_sizes), bias=bias)
        self.tp_size, self.tp_rank = tp_size, tp_rank

    def full_shape(self, param: nn.Parameter, part: int) -> tuple[int, ...]:
        """The checkpoint tensor's shape for part `part` of `param`, all ranks' rows."""
        return (self.output_sizes[part] * self.tp_size, *param.shape[1:])

    def weight_loader(self, param: nn.Parameter, loaded, part: int = 0) -> None:
        """Copy this rank's rows of part `part` of a checkpoint tensor (weight or bias), reading
        only those (`loaded`: a tensor, or a safetensors slice)."""
        size, start = self.output_sizes[part], sum(self.output_sizes[:part])
        rows = loaded[self.tp_rank * size:(self.tp_rank + 1) * size]
        param.data.narrow(0, start, size).copy_(rows)


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r W_r^T, + b once: this rank holds slice `tp_rank` of the inputs
    (the heads or MLP columns its ColumnParallelLinear computed)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0, name: str = "input size") -> None:
        super().__init__(divide(input_size, tp_size, name), output_size, bias=bias)
        self.tp_size, self.tp_rank = tp_size, tp_rank

    def full_shape(self, param: nn.Parameter, part: int) -> tuple[int, ...]:
        return tuple(param.shape) if param.dim() == 1 else (self.out_features,
                                                            self.in_features * self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded, part: int = 0) -> None:
        """This rank's columns of the weight; the bias whole (rank 0 adds it)."""
        size = self.in_features
        param.data.copy_(loaded[:] if param.dim() == 1 else
                         loaded[:, self.tp_rank * size:(self.tp_rank + 1) * size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary (tp_size > 1): a token outside them embeds as zeros
    here, and the sum over ranks (one all-reduce) is its embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_size: int, tp_rank: int) -> None:
        self.shard = divide(vocab_size, tp_size, "vocab_size")
        super().__init__(self.shard, hidden_size)
        self.tp_size, self.start = tp_size, tp_rank * self.shard

    def full_shape(self, param: nn.Parameter, part: int) -> tuple[int, ...]:
        return (self.shard * self.tp_size, param.shape[1])

    def weight_loader(self, param: nn.Parameter, loaded, part: int = 0) -> None:
        param.data.copy_(loaded[self.start:self.start + self.shard])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.shard)
        y = F.embedding(local.clamp(0, self.shard - 1), self.weight) * inside.unsqueeze(1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of this rank's vocabulary rows, gathered on rank 0 for the sampler; None elsewhere."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.gather(F.linear(hidden, self.weight))

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        first = dist.get_rank() == 0
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if first else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1) if first else None
