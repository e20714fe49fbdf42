"""§4 ("one forward step") and §5: run one scheduled step on the model.

Selective batching (Orca): the new tokens of *all* scheduled requests are flattened into
one batch of `num_tokens` rows, whatever mix of prefill chunks and decodes they are. The
linear layers don't care where a request ends; only attention does, and it learns that
from the explicit `AttentionMetadata` built here. K/V of every new token is written into
the paged cache at the slot given by `slot_mapping`.

Row order (the invariant `AttentionMetadata` documents): decode rows first (requests with
exactly one new token, then the static policy's idle rows), then prefill chunks.
"""

from __future__ import annotations

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.cuda_graph import CUDAGraphRunner
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Request
from nanoserve.layers.attention import AttentionMetadata, select_backend
from nanoserve.layers.cpu_linear import cpu_has_bf16_matmul, pack_linears
from nanoserve.layers.sampler import Sampler
from nanoserve.models.loader import load_model
from nanoserve.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device_and_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = config.dtype
    if dtype == "auto":
        # bf16 on a CPU only where it has bf16 matmul units; emulated bf16 is slower than fp32.
        dtype = "bfloat16" if device.startswith("cuda") or cpu_has_bf16_matmul() else "float32"
    return torch.device(device), DTYPES[dtype]


def resolve_block_size(backend_name: str, block_size: int | None) -> int:
    """flash-attn's paged KV needs blocks of a multiple of 256 tokens; the torch twins
    take any size, and small blocks waste less memory on a request's last block."""
    if backend_name == "flash-attn":
        if block_size is not None and block_size % 256 != 0:
            raise ValueError(f"block_size must be a multiple of 256 with flash-attn's paged KV, "
                             f"got {block_size}")
        return block_size or 256
    return block_size or 16


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.device, self.dtype = resolve_device_and_dtype(config)
        # Backend and block size first: their errors must come before loading any weights.
        self.backend = select_backend(self.device, self.dtype, config.attention_backend)
        self.block_size = resolve_block_size(self.backend.name, config.block_size)
        torch.manual_seed(config.seed)
        self.model, self.hf_config = load_model(model_dir, self.dtype, self.device)
        self.attn_layers = self.model.attention_layers()
        if self.device.type == "cpu" and not config.enforce_eager and \
                torch.backends.mkldnn.is_available():
            pack_linears(self.model)  # fp32 GEMMs without re-tiling the weights every call
        self.num_kv_blocks = config.num_kv_blocks or self._kv_blocks_from_memory()
        self._allocate_kv_cache()
        self.sampler = Sampler(config.seed)
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.graphs: CUDAGraphRunner | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = CUDAGraphRunner(self.model, config.max_num_seqs, self.max_blocks_per_seq,
                                          padding_block=self.num_kv_blocks,
                                          block_size=self.block_size)

    # -- KV cache ---------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        layer = self.attn_layers[0]
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads * \
            layer.head_dim * elem

    def _kv_blocks_from_memory(self) -> int:
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = int(self.config.kv_cache_memory_gib * 2**30)
        num_blocks = budget // self.kv_bytes_per_block() - 1  # the sink block is in budget too
        if num_blocks < 1:
            raise ValueError("the KV cache memory budget is smaller than one block; raise "
                             "kv_cache_memory_gib / gpu_memory_utilization or set num_kv_blocks")
        return num_blocks

    def _cuda_kv_budget(self) -> int:
        """Memory left for KV after the weights and a warm-up forward's peak activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.max_num_batched_tokens
        num_seqs = -(-num_tokens // self.block_size)
        self._allocate_kv_cache(num_blocks=num_seqs)  # a scratch cache for the warm-up
        last = num_tokens - self.block_size * (num_seqs - 1)
        seq_lens = [self.block_size] * (num_seqs - 1) + [last]
        self.warmup(seq_lens)
        peak = torch.cuda.max_memory_allocated(self.device)
        for attn in self.attn_layers:  # drop the scratch cache's last references
            attn.bind(torch.empty(0), torch.empty(0), self.backend)
        del self.kv_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use_by_others = total - free - torch.cuda.memory_allocated(self.device)
        return int(total * self.config.gpu_memory_utilization) - peak - in_use_by_others

    def _allocate_kv_cache(self, num_blocks: int | None = None) -> None:
        """One tensor [2, layers, blocks + 1, block_size, kv_heads, head_dim]. The extra
        last block is a sink for padding rows (CUDA graphs): it belongs to no request."""
        num_blocks = num_blocks or self.num_kv_blocks
        layer = self.attn_layers[0]
        self.kv_cache = torch.zeros(2, len(self.attn_layers), num_blocks + 1, self.block_size,
                                    layer.num_kv_heads, layer.head_dim,
                                    dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.bind(self.kv_cache[0, i], self.kv_cache[1, i], self.backend)

    def warmup(self, seq_lens: list[int]) -> None:
        """One forward over fresh sequences of these lengths, in blocks 0, 1, ..."""
        rows = []
        for i, n in enumerate(seq_lens):
            req = Request(f"warmup-{i}", [0] * n, SamplingParams(max_tokens=1))
            req.block_table = [i]
            rows.append((req, 0, n))
        self.model(*self.prepare_inputs([], rows)[:3])

    # -- one step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> dict[str, int]:
        """Run the step; return the sampled token of every request that samples."""
        decode_rows, prefill_rows = [], []
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            rows = decode_rows if n == 1 else prefill_rows
            rows.append((req, req.num_computed_tokens, n))
        for req in out.idle_rows:  # recompute the last computed position: pure waste
            decode_rows.append((req, req.num_computed_tokens - 1, 1))
        input_ids, positions, meta, sample_rows, sample_reqs = self.prepare_inputs(
            decode_rows, prefill_rows)
        if self.graphs is not None and meta.num_prefill_tokens == 0 and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        if not sample_reqs:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        token_ids = self.sampler(logits, [r.sampling_params for r in sample_reqs],
                                 [r.generator for r in sample_reqs])
        return {r.request_id: t for r, t in zip(sample_reqs, token_ids)}

    def prepare_inputs(self, decode_rows: list[tuple[Request, int, int]],
                       prefill_rows: list[tuple[Request, int, int]]):
        """Rows are (request, first position, number of tokens). Returns input_ids,
        positions, AttentionMetadata, the row index of each sampling request's last token,
        and those requests. Sampling rows: requests whose known tokens all get computed."""
        bs = self.block_size
        input_ids, positions, slots, sample_rows, sample_reqs = [], [], [], [], []
        for req, pos, _ in decode_rows:
            input_ids.append(req.token_ids[pos])
            positions.append(pos)
            slots.append(req.block_table[pos // bs] * bs + pos % bs)
            if pos + 1 == req.num_tokens and not req.is_finished:
                sample_rows.append(len(positions) - 1)
                sample_reqs.append(req)
        cu_q, cu_k = [0], [0]
        for req, start, n in prefill_rows:
            end = start + n
            input_ids.extend(req.token_ids[start:end])
            chunk_positions = range(start, end)
            positions.extend(chunk_positions)
            table = req.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in chunk_positions)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            if end == req.num_tokens:
                sample_rows.append(len(positions) - 1)
                sample_reqs.append(req)

        def to_device(values: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64),
            num_decode_tokens=len(decode_rows),
            decode_context_lens=to_device([pos + 1 for _, pos, _ in decode_rows]),
            decode_block_tables=self._block_tables([r for r, _, _ in decode_rows]),
            num_prefill_tokens=cu_q[-1],
            cu_seqlens_q=to_device(cu_q),
            cu_seqlens_k=to_device(cu_k),
            max_seqlen_q=max((n for _, _, n in prefill_rows), default=0),
            max_seqlen_k=max((start + n for _, start, n in prefill_rows), default=0),
            prefill_block_tables=self._block_tables([r for r, _, _ in prefill_rows]),
        )
        return (to_device(input_ids, torch.int64), to_device(positions, torch.int64), meta,
                sample_rows, sample_reqs)

    def _block_tables(self, reqs: list[Request], width: int | None = None) -> torch.Tensor:
        """Pad block tables to one width; padding points at block 0 and is never read,
        because attention stops at each request's context length."""
        width = width or max((len(r.block_table) for r in reqs), default=0)
        rows = [r.block_table + [0] * (width - len(r.block_table)) for r in reqs]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(reqs), width).to(self.device)

