"""Engine configuration (vLLM's names), validated when it is built: every bad value is a
ValueError that names the field and the allowed range, before any memory is allocated."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.layers.attention import ATTENTION_BACKENDS

SCHEDULING_POLICIES = ("fcfs", "priority", "static")


@dataclass
class EngineConfig:
    model: str | None = None  # HF-style directory; None = the bundled SmolLM2
    dtype: str = "auto"  # "auto" = bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16, else fp32
    device: str = "auto"  # "auto" = cuda if available, else cpu
    max_num_seqs: int = 32  # at most this many requests in `running`
    max_num_batched_tokens: int = 1024  # the token budget of one step (§6.2)
    max_model_len: int = 2048  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # cap on one request's tokens per step
    block_size: int | None = None  # None = 16 (torch attention) or 256 (flash-attn)
    num_kv_blocks: int | None = None  # None = sized from the memory budget below
    kv_cache_memory_gib: float = 1.0  # CPU: memory budget of the KV cache
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the GPU the engine may use
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs", "priority", or "static" (§2, for comparison)
    attention_backend: str = "auto"  # "auto", "flash-attn" or "torch"
    enforce_eager: bool = False  # True: the plain path (no CUDA graphs, no packed CPU weights)
    seed: int = 0  # for requests that sample without their own seed
    trace: bool = False  # print one line per step (also: NANOSERVE_TRACE=1)
    skip_tokenizer_init: bool = False  # no tokenizer: prompts must be token ids

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        need(is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        need(is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens", ">= 1")
        need(is_int(self.max_model_len) and self.max_model_len >= 2, "max_model_len", ">= 2")
        need(self.block_size is None or (is_int(self.block_size) and self.block_size >= 1),
             "block_size", "None or an integer >= 1")
        need(self.num_kv_blocks is None or (is_int(self.num_kv_blocks) and self.num_kv_blocks >= 1),
             "num_kv_blocks", "None or an integer >= 1")
        need(self.long_prefill_token_threshold is None or (
            is_int(self.long_prefill_token_threshold) and self.long_prefill_token_threshold >= 1),
             "long_prefill_token_threshold", "None or an integer >= 1")
        need(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "> 0")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]")
        need(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
             f"one of {SCHEDULING_POLICIES}")
        need(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
             f"one of {ATTENTION_BACKENDS}")
        need(self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:"),
             "device", "'auto', 'cpu', 'cuda' or 'cuda:N'")
        need(self.dtype in ("auto", "float32", "float16", "bfloat16"), "dtype",
             "one of ('auto', 'float32', 'float16', 'bfloat16')")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is False: "
                "otherwise a long prompt could never be scheduled in one step")
