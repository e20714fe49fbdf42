"""Engine configuration (vLLM's names): the knobs of §6.2 and §7, the KV cache (§5), the
device. Checked when built, then resolved against the machine and the model's config.json
(`resolve_config` fills every "auto"/None), both before any memory is allocated. Every bad
value is a ValueError that names the field and the allowed range."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from transformers import PretrainedConfig

from nanoserve.layers.attention import ATTENTION_BACKENDS, select_backend
from nanoserve.sampling_params import check_field, is_int
from nanoserve.utils import cpu

SCHEDULING_POLICIES = ("fcfs", "priority", "static")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    dtype: str = "auto"  # "auto" = bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16, else fp32
    device: str = "auto"  # "auto" = cuda if available, else cpu
    max_num_seqs: int = 32  # at most this many requests in `running`
    max_num_batched_tokens: int = 1024  # the token budget of one step (§6.2)
    max_model_len: int | None = None  # prompt + output tokens; None = the model's limit
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # cap on one request's tokens per step
    block_size: int | None = None  # None = vLLM's: 128 on a CPU, 16 on CUDA, 256 flash-attn
    num_kv_blocks: int | None = None  # None = sized from the memory budget below
    kv_cache_memory_gib: float = 1.0  # CPU: memory budget of the KV cache
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the GPU the engine may use
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs", "priority", or "static" (§2, for comparison)
    attention_backend: str = "auto"  # "auto", "flash-attn" or "torch"
    enforce_eager: bool = False  # True: the plain path (no CUDA graphs, no packed CPU weights)
    seed: int = 0  # for requests that sample without their own seed
    trace: bool = False  # print one line per step (also: NANOSERVE_TRACE=1)
    trace_file: str | None = None  # append one JSON line per step (nanoserve/trace.py)
    skip_tokenizer_init: bool = False  # no tokenizer: prompts must be token ids

    def __post_init__(self) -> None:
        need = partial(check_field, self)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            need(is_int(getattr(self, name)) and getattr(self, name) >= 1, name, ">= 1")
        for name, low in (("max_model_len", 2), ("block_size", 1), ("num_kv_blocks", 1),
                          ("long_prefill_token_threshold", 1)):
            value = getattr(self, name)
            need(value is None or (is_int(value) and value >= low), name,
                 f"None or an integer >= {low}")
        need(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "> 0")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]")
        for name, allowed in (("scheduling_policy", SCHEDULING_POLICIES),
                              ("attention_backend", ATTENTION_BACKENDS),
                              ("dtype", ("auto", *DTYPES))):
            need(getattr(self, name) in allowed, name, f"one of {allowed}")
        need(self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:"),
             "device", "'auto', 'cpu', 'cuda' or 'cuda:N'")
        need(self.trace_file is None or (isinstance(self.trace_file, str) and self.trace_file),
             "trace_file", "None or a file path")
        # No chunking means none at all: a per-request chunk cap would contradict it.
        need(self.enable_chunked_prefill or self.long_prefill_token_threshold is None,
             "long_prefill_token_threshold", "None when enable_chunked_prefill is False")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is "
                             "False: otherwise a long prompt could never be scheduled in one step")


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") or cpu.has_native_bf16() else "float32"


def resolve_block_size(backend_name: str, block_size: int | None, device: str) -> int:
    """flash-attn's paged KV needs multiples of 256 tokens; the torch twins, any. Defaults are
    vLLM's: 16 on CUDA; 128 on a CPU, where a block is one contiguous run of the cache and short
    runs stream slower through decode attention."""
    if backend_name == "flash-attn":
        if block_size is not None and block_size % 256 != 0:
            raise ValueError(f"block_size must be a multiple of 256 with flash-attn's paged KV, "
                             f"got {block_size}")
        return block_size or 256
    return block_size or (16 if device.startswith("cuda") else 128)


def resolve_config(config: EngineConfig, hf_config: PretrainedConfig) -> EngineConfig:
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = auto_device if config.device == "auto" else config.device
    dtype = resolve_dtype(config.dtype, device)
    backend = select_backend(torch.device(device), DTYPES[dtype], config.attention_backend).name
    model_limit = hf_config.max_position_embeddings
    max_model_len = config.max_model_len or model_limit  # as in vLLM: less only if asked for
    if max_model_len > model_limit:
        raise ValueError(f"max_model_len ({max_model_len}) must be <= the model's "
                         f"max_position_embeddings ({model_limit})")
    # replace() runs __post_init__ again, so the filled values are checked too.
    return replace(config, device=device, dtype=dtype, attention_backend=backend,
                   block_size=resolve_block_size(backend, config.block_size, device),
                   max_model_len=max_model_len)
