"""The fast paths, one folder the reader can skip: nothing in the chapter core imports it. The core
finds `optimize` as vLLM finds its plugins, through an entry-point group (`nanoserve.fast_paths`
in pyproject.toml), and calls it once the model is loaded, unless `enable_fast_paths=False`.
It is the only place anything is swapped in, and it swaps whole modules:
  - CPU: every nn.Linear (the decoder's merged qkv_proj and gate_up_proj among them)
    becomes a packed GEMM (linear.py: oneDNN, csrc/linear.c or csrc/dpbf16.c, by CPU and row
    count), RMSNorm, RoPE and SiLU-and-multiply are one C call each (fused.py, csrc/fused.c),
    attention reads the paged KV cache in place (paged_attention.py, csrc/attention*.c: decode;
    prefill, bf16 on AVX512-BF16 and fp32 on AVX-512F),
    a decode step's layers are one C call of those kernels (layer.py, csrc/layer.c; longer
    steps run on a few row counts, which a server has oneDNN build as it starts), top-k and
    top-p filter the likeliest tokens only and each row's largest logit is found in C
    (sampler.py, csrc/fused.c); a greedy decode step runs as those C calls alone, no torch op
    between them (step.py); freed buffers stay in the heap
    (kernels.keep_freed_memory, process-wide); the weights, laid out, are moved onto 2 MB
    pages, and the KV cache is allocated on them (hugepages.py).
The results equal the plain path's (nanoserve_accel/tests/)."""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

from nanoserve_accel import kernels, plan
from nanoserve_accel.fused import fuse_elementwise
from nanoserve_accel.hugepages import huge_zeros, weights_on_huge_pages
from nanoserve_accel.layer import fuse_layers, warm_gemms
from nanoserve_accel.linear import replace_linears
from nanoserve_accel.paged_attention import with_decode_kernel, with_prefill_kernel
from nanoserve_accel.sampler import c_largest, candidate_probs
from nanoserve_accel.step import decode_step

if TYPE_CHECKING:
    from nanoserve.engine.model_runner import ModelRunner


def optimize(runner: ModelRunner) -> None:
    """Called once the model is loaded, before its KV cache is allocated and bound."""
    if runner.device.type != "cpu":
        return
    kernels.keep_freed_memory()  # no page faults for each step's buffers
    lib = kernels.compile_kernels()
    machine = plan.Machine.probe(lib)
    replace_linears(runner.model, lib, machine)  # the plan's GEMM for each
    runner.sampler.filter = candidate_probs  # top-k / top-p among the likeliest tokens
    if lib is not None:
        use_kernels(runner, lib, machine)
    weights_on_huge_pages(runner.model)  # laid out for good now: no more copies to come
    runner.kv_zeros = huge_zeros  # the KV cache on 2 MB pages too
    if runner.config.usage_context == "server":  # not in the first requests' latency
        warm_gemms(runner.model, runner.config.max_num_batched_tokens or 0)


def use_kernels(runner: ModelRunner, lib: ctypes.CDLL, machine: plan.Machine) -> None:
    """The C kernels' modules, where the library was built."""
    runner.sampler.largest = functools.partial(c_largest, lib)  # the greedy pick
    fuse_elementwise(runner.model, lib)  # RMSNorm, RoPE, SiLU-and-multiply: one call each
    if runner.backend.name == "torch":
        runner.backend = with_decode_kernel(runner.backend, lib)
        if plan.prefill_attention(machine, runner.dtype) != "torch twin":
            runner.backend = with_prefill_kernel(runner.backend, lib, machine)
        fuse_layers(runner.model, lib)  # a decode step's layers: one C call
        runner.decode_step = decode_step(runner)  # and, greedy, the whole step: no torch op
