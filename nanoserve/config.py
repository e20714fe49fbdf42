"""Engine configuration (vLLM's names): the knobs of §6.2 and §7, the KV cache (§5), the device.
Checked when built, then resolved against the machine and the model's config.json (`resolve_config`
fills every "auto"/None), both before any memory is allocated. Every bad value is a ValueError
that names the field and the allowed range."""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass, replace
from functools import partial

import torch
from transformers import PretrainedConfig

from nanoserve.utils import check_field, cpu, divide, is_int

SCHEDULING_POLICIES = ("fcfs", "priority")
BATCHING = ("continuous", "static")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION_BACKENDS = ("auto", "flash-attn", "torch")
USAGE_CONTEXTS = ("llm", "server")
# vLLM 0.32's defaults (EngineArgs.get_batch_defaults), (max_num_seqs, max_num_batched_tokens) for
# the LLM class and the API server. On a CPU nanoserve keeps its own (docs/benchmarks.md: level
# in throughput with vLLM's 256 / 4096 and 128 / 2048 on 2 cores, about half the median TTFT).
GPU_160GB = {"llm": (1024, 16384), "server": (1024, 16384)}
GPU_70GB = {"llm": (1024, 16384), "server": (1024, 8192)}  # and not an A100
GPU_OTHER = {"llm": (256, 8192), "server": (256, 2048)}
CPU_DEFAULTS = {"llm": (32, 1024), "server": (32, 1024)}


@dataclass
class EngineConfig:
    dtype: str = "auto"  # "auto" = bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16, else fp32
    device: str = "auto"  # "auto" = cuda if available, else cpu
    max_num_seqs: int | None = None  # at most this many requests in `running`; None: the table
    max_num_batched_tokens: int | None = None  # the token budget of one step (§6.2); None: same
    max_model_len: int | None = None  # prompt + output tokens; None = the model's limit
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # cap on one request's tokens per step
    block_size: int | None = None  # None = vLLM's: 128 on a CPU, 16 on CUDA, 256 flash-attn
    num_kv_blocks: int | None = None  # None = sized from the memory budget below
    kv_cache_memory_gib: float = 1.0  # CPU: memory budget of the KV cache
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the GPU the engine may use
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority": the waiting queue's order (§6.1)
    batching: str = "continuous"  # or "static": §2's static batching, for comparison
    attention_backend: str = "auto"  # "auto", "flash-attn" or "torch"
    enforce_eager: bool = False  # True: no CUDA graphs and no torch.compile (vLLM's meaning)
    torch_compile: bool | None = None  # compile the small element-wise modules; None: on CUDA
    enable_fast_paths: bool = True  # the fast-path plugins (nanoserve_accel), if installed
    usage_context: str = "llm"  # "llm" or "server": whose defaults apply (vLLM's UsageContext)
    tensor_parallel_size: int = 1  # processes the model is split over (engine/workers.py)
    max_logprobs: int = 20  # the most a request may ask for (vLLM's; -1: the vocabulary)
    seed: int = 0  # for requests that sample without their own seed
    trace: bool = False  # print one line per step (also: NANOSERVE_TRACE=1)
    trace_file: str | None = None  # append one JSON line per step (nanoserve/trace.py)
    skip_tokenizer_init: bool = False  # no tokenizer: prompts must be token ids

    def __post_init__(self) -> None:
        need = partial(check_field, self)
        for name, low in (("max_model_len", 2), ("block_size", 1), ("num_kv_blocks", 1),
                          ("long_prefill_token_threshold", 1), ("max_num_seqs", 1),
                          ("max_num_batched_tokens", 1)):
            value = getattr(self, name)
            need(value is None or (is_int(value) and value >= low), name,
                 f"None or an integer >= {low}")
        need(is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
             "tensor_parallel_size", "an integer >= 1")
        need(is_int(self.max_logprobs) and self.max_logprobs >= -1, "max_logprobs", "an int >= -1")
        need(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "> 0")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]")
        for name, allowed in (("scheduling_policy", SCHEDULING_POLICIES), ("batching", BATCHING),
                              ("attention_backend", ATTENTION_BACKENDS),
                              ("dtype", ("auto", *TORCH_DTYPES)),
                              ("usage_context", USAGE_CONTEXTS),
                              ("torch_compile", (None, True, False))):
            need(getattr(self, name) in allowed, name, f"one of {allowed}")
        gpu = re.fullmatch(r"cuda(?::(\d+))?", str(self.device))  # one that torch sees
        need(self.device in ("auto", "cpu") or gpu and int(gpu[1] or 0) < torch.cuda.device_count(),
             "device", "'auto', 'cpu' or a CUDA device torch sees ('cuda', 'cuda:N')")
        need(self.trace_file is None or (isinstance(self.trace_file, str) and self.trace_file),
             "trace_file", "None or a file path")
        # No chunking means none at all: a per-request chunk cap would contradict it.
        need(self.enable_chunked_prefill or self.long_prefill_token_threshold is None,
             "long_prefill_token_threshold", "None when enable_chunked_prefill is False")
        tokens, model_len = self.max_num_batched_tokens, self.max_model_len
        if not self.enable_chunked_prefill and tokens and model_len and tokens < model_len:
            raise ValueError(f"max_num_batched_tokens ({tokens}) must be >= max_model_len "
                             f"({model_len}) when enable_chunked_prefill is False: otherwise a "
                             "long prompt could never be scheduled in one step")


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") or cpu.has_native_bf16() else "float32"


def gpu_of(device: str) -> tuple[str, float]:
    """The GPU's name and memory in GiB (what vLLM's defaults read)."""
    props = torch.cuda.get_device_properties(torch.device(device))
    return props.name, props.total_memory / 2**30


def batch_defaults(device: str, usage_context: str) -> tuple[int, int]:
    """The defaults above for this device: by GPU memory (an A100 counts as small), or the CPU's."""
    if not device.startswith("cuda"):
        return CPU_DEFAULTS[usage_context]
    name, gib = gpu_of(device)
    table = GPU_160GB if gib >= 160 else GPU_70GB if gib >= 70 and "a100" not in name.lower() \
        else GPU_OTHER
    return table[usage_context]


def flash_attn_missing(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if flash-attn can run here, else why not."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash_attn is not installed"
    try:
        importlib.import_module("flash_attn")
    except Exception as e:  # installed against another torch or CUDA: say so, loudly
        return f"flash_attn is installed but does not import ({type(e).__name__}: {e})"
    if device.type != "cuda":
        return f"device is {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype is {dtype}; flash-attn needs float16 or bfloat16"
    cc = torch.cuda.get_device_capability(device)
    return f"compute capability {cc[0]}.{cc[1]}; flash-attn 2 needs 8.0" if cc < (8, 0) else None


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The one place the attention backend is chosen: flash-attn where it can run, else the
    torch twins. "flash-attn" asked for where it cannot run is an error."""
    why = None if requested == "torch" else flash_attn_missing(device, dtype)
    if requested == "flash-attn" and why is not None:
        raise ValueError(f"attention_backend='flash-attn' cannot be used: {why}. Install it "
                         "with `pip install nanoserve[gpu]` on a CUDA machine, or use "
                         "attention_backend='auto'.")
    if requested == "auto" and why is not None and (device.type == "cuda" or "import" in why):
        logging.getLogger("nanoserve").warning("attention: torch twins, not flash-attn: %s", why)
    return "torch" if requested == "torch" or why is not None else "flash-attn"


def resolve_block_size(backend_name: str, block_size: int | None, device: str) -> int:
    """flash-attn's paged KV needs multiples of 256 tokens; the torch twins, any. Defaults are
    vLLM's: 16 on CUDA, 128 on a CPU (decode attention streams short runs of the cache slower)."""
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
    backend = resolve_attention_backend(config.attention_backend, torch.device(device),
                                        TORCH_DTYPES[dtype])
    model_limit = hf_config.max_position_embeddings
    max_model_len = config.max_model_len or model_limit  # as in vLLM: less only if asked for
    if max_model_len > model_limit:
        raise ValueError(f"max_model_len ({max_model_len}) must be <= the model's "
                         f"max_position_embeddings ({model_limit})")
    tp_sizes = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    for name in tp_sizes if config.tensor_parallel_size > 1 else ():  # each rank its share
        divide(getattr(hf_config, name), config.tensor_parallel_size, name)
    seqs, tokens = batch_defaults(device, config.usage_context)
    tokens = config.max_num_batched_tokens or (tokens if config.enable_chunked_prefill
                                               else max(tokens, max_model_len))
    # replace() runs __post_init__ again, so the filled values are checked too.
    return replace(config, device=device, dtype=dtype, attention_backend=backend,
                   block_size=resolve_block_size(backend, config.block_size, device),
                   max_model_len=max_model_len, max_num_seqs=config.max_num_seqs or seqs,
                   max_num_batched_tokens=tokens,
                   torch_compile=(device.startswith("cuda") and not config.enforce_eager)
                   if config.torch_compile is None else config.torch_compile)
