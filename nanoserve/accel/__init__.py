"""The fast paths, one folder the reader can skip: nothing in the chapter core imports it. The core
finds `optimize` as vLLM finds its plugins, through an entry-point group (`nanoserve.fast_paths`
in pyproject.toml), and calls it once the model and KV cache exist, unless `enforce_eager=True`.
It is the only place anything is swapped in, and it swaps whole modules:
  - CPU: q, k, v and gate, up are merged into one linear each (merged.py), and every nn.Linear
    becomes a packed GEMM (linear.py: oneDNN, csrc/linear.c or csrc/dpbf16.c, by CPU and row
    count), RMSNorm, RoPE and SiLU-and-multiply are one C call each (fused.py, csrc/fused.c),
    attention reads the paged KV cache in place (paged_attention.py, csrc/attention*.c: decode;
    bf16 prefill on AVX512-BF16),
    a decode step's layer is one C call of those kernels (layer.py, csrc/layer.c), and freed
    buffers stay in the heap (kernels.keep_freed_memory, process-wide);
  - CUDA: the model is wrapped in CUDA graphs for decode steps (cuda_graph.py).
The results equal the plain path's (tests/accel/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.accel import kernels
from nanoserve.accel.cuda_graph import CUDAGraphRunner
from nanoserve.accel.fused import fuse_elementwise
from nanoserve.accel.layer import fuse_layers
from nanoserve.accel.linear import replace_linears
from nanoserve.accel.merged import merge_projections
from nanoserve.accel.paged_attention import with_decode_kernel, with_prefill_kernel
from nanoserve.utils import cpu

if TYPE_CHECKING:
    from nanoserve.engine.model_runner import ModelRunner


def optimize(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        runner.model = CUDAGraphRunner(runner.model, runner.config.max_num_seqs,
                                       runner.max_blocks_per_seq, runner.num_kv_blocks,
                                       runner.block_size)  # the padding block: the sink
        return
    if runner.device.type != "cpu":
        return
    kernels.keep_freed_memory()  # no page faults for each step's buffers
    lib = kernels.compile_kernels()
    merge_projections(runner.model)  # q, k, v and gate, up: one GEMM each
    replace_linears(runner.model, lib)
    if lib is not None:
        fuse_elementwise(runner.model, lib)  # RMSNorm, RoPE, SiLU-and-multiply: one call each
    if lib is not None and runner.backend.name == "torch":
        runner.backend = with_decode_kernel(runner.backend, lib)
        if (runner.dtype == torch.bfloat16 and kernels.has_paged_prefill(lib)
                and "avx512_bf16" in cpu.cpu_flags()):
            runner.backend = with_prefill_kernel(runner.backend, lib)
        for attn in runner.attn_layers:  # the same cache, now read by the kernel
            attn.bind(attn.k_cache, attn.v_cache, runner.backend)
        fuse_layers(runner.model, lib)  # a decode step's layer: one C call
