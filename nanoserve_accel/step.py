"""§4's decode step on a CPU with no torch op in it: the CPU's counterpart of replaying a CUDA
graph. Where every row of a step decodes and samples greedily, the step's host lists go to C as
they are (ctypes arrays, not tensors), csrc/layer.c's decode_model runs the model, the LM head's
C GEMM its logits and csrc/fused.c's `largest` each row's token, into buffers made once. The same
calls the modules make (FusedDecoderModel, CLinear, c_largest), so the same tokens; what goes is
the Python and the torch ops around them (~30 small tensors and dispatches a step), each slow
after the step's weights have streamed through the caches.

2-core Zen 3 VM (AVX2, lscpu family 25 model 1), SmolLM2-135M, 240 tokens of context, this step
over the runner's own, alternated step by step on one runner, pairwise medians: bf16 one row
0.948 and 0.942 (150 pairs each), fp32 one row 0.947 (100), bf16 16 rows 1.011 (40: level)."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from nanoserve.layers.sampler import ERRORS, NAN_LOGITS
from nanoserve_accel.layer import FusedDecoderModel
from nanoserve_accel.linear import CLinear

if TYPE_CHECKING:
    from nanoserve.engine.model_runner import ModelRunner, StepInputs
    from nanoserve.engine.request import Request

_I32, _I64 = ctypes.c_int32, ctypes.c_int64


class DecodeStep:
    """runner.decode_step: (StepInputs, the sampling requests) -> each row's token (or error
    message), or None where the step is not one it takes (then the runner's own path runs)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.model, self.head = runner.model.model, runner.model.lm_head
        self.rows = self.model.max_rows
        if self.head.max_rows is not None:
            self.rows = min(self.rows, self.head.max_rows)
        self.done = ctypes.c_int(0)
        self.grow(1)

    def grow(self, n: int) -> None:
        """Buffers for n rows, kept for the steps after (a step's rows never exceed max_rows)."""
        self.hidden = torch.empty(n, self.head.k, dtype=self.head.dtype)
        self.logits = torch.empty(n, self.head.n, dtype=self.head.dtype)
        self.top, self.tokens = (ctypes.c_float * n)(), (_I64 * n)()

    def takes(self, step: StepInputs, reqs: list[Request]) -> bool:
        model, n = self.model, len(step.input_ids)
        return (0 < n <= self.rows and step.num_decode_tokens == n == len(step.sample_indices)
                and all(r.sampling_params.greedy and r.sampling_params.logprobs is None
                        for r in reqs)
                and model.bound is not None and model.fused[0].attn.k_cache is model.bound
                and model.bound_tables())  # bound by a step of the modules' path before

    def __call__(self, step: StepInputs, reqs: list[Request]) -> list[int | str] | None:
        if not self.takes(step, reqs):
            return None
        n, model, head = len(step.input_ids), self.model, self.head
        if n > len(self.hidden):
            self.grow(n)
        tables = step.decode_block_tables
        width = len(tables[0])
        bad = model.lib.decode_model(
            ctypes.byref(model.model_args), model.args, len(model.fused),
            (_I64 * n)(*step.input_ids), (_I64 * n)(*step.positions), self.hidden.data_ptr(),
            (_I64 * n)(*step.slot_mapping), (_I32 * (n * width))(*(b for t in tables for b in t)),
            (_I32 * n)(*step.decode_context_lens), n, width, ctypes.byref(self.done))
        if bad != -1:  # a value the C refuses: the modules' path raises the error naming it
            return None
        head.gemm(self.hidden.data_ptr(), head.w_ptr, head.bias_ptr, self.logits.data_ptr(),
                  head.n, n, head.k, *head.flag)
        model.lib.largest(self.logits.data_ptr(), n, head.n, self.top, self.tokens,
                          head.dtype == torch.bfloat16)
        return [ERRORS[NAN_LOGITS] if top != top else token  # NaN: the sampler's error
                for top, token in zip(self.top[:n], self.tokens[:n])]


def decode_step(runner: ModelRunner) -> DecodeStep | None:
    """A DecodeStep where the model's decode step is one C call and the LM head a C GEMM."""
    model, head = runner.model.model, runner.model.lm_head
    if (runner.config.tensor_parallel_size != 1 or type(model) is not FusedDecoderModel
            or not isinstance(head, CLinear) or head.dtype != model.fused[0].dtype):
        return None
    return DecodeStep(runner)
