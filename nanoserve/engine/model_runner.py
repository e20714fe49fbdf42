"""§4 ("one forward step") and §5: run one scheduled step on the model.

Selective batching (Orca): the new tokens of *all* scheduled requests, prefill chunks and decodes
alike, are flattened into one batch of rows. The linear layers don't care where a request ends; only
attention does, told by the `AttentionMetadata` built here (with each new token's KV slot). Rows:
decodes (one new token each, then static batching's idle rows), then prefill chunks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

import torch

from nanoserve.config import DTYPES, EngineConfig
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from nanoserve.layers.attention import AttentionMetadata, select_backend
from nanoserve.layers.sampler import Sampler
from nanoserve.models.loader import load_model
from nanoserve.sampling_params import SamplingParams


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    sample_indices: list[int]  # the row of each sampling request's last token
    sample_requests: list[Request]


def prepare_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    """The step's rows, in the order above. Reads `out` and its requests; changes nothing."""
    # (request, first position, number of new tokens, samples?)
    decode_rows = [(s.request, s.request.num_computed_tokens, 1, s.samples)
                   for s in out.scheduled if s.is_decode]
    # An idle row recomputes its last computed position: pure waste (§2).
    decode_rows += [(req, req.num_computed_tokens - 1, 1, False) for req in out.idle_rows]
    prefill_rows = [(s.request, s.request.num_computed_tokens, s.num_new_tokens, s.samples)
                    for s in out.scheduled if not s.is_decode]
    input_ids, positions, slots, sample_indices, sample_requests = [], [], [], [], []
    cu_q, cu_k = [0], [0]
    for req, start, n, samples in decode_rows + prefill_rows:
        chunk = range(start, start + n)
        input_ids.extend(req.token_ids[start:start + n])
        positions.extend(chunk)
        slots.extend(req.block_table[p // block_size] * block_size + p % block_size for p in chunk)
        if samples:
            sample_indices.append(len(positions) - 1)
            sample_requests.append(req)
    for _, start, n, _ in prefill_rows:
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + start + n)

    def to_device(values: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    def block_tables(rows: list) -> torch.Tensor:  # padding -> block 0, never read
        width = max((len(r[0].block_table) for r in rows), default=0)
        table = [r[0].block_table + [0] * (width - len(r[0].block_table)) for r in rows]
        return torch.tensor(table, dtype=torch.int32).reshape(len(rows), width).to(device)

    meta = AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64), num_decode_tokens=len(decode_rows),
        decode_context_lens=to_device([start + 1 for _, start, _, _ in decode_rows]),
        decode_block_tables=block_tables(decode_rows), num_prefill_tokens=cu_q[-1],
        cu_seqlens_q=to_device(cu_q), cu_seqlens_k=to_device(cu_k),
        max_seqlen_q=max((n for _, _, n, _ in prefill_rows), default=0),
        max_seqlen_k=max((start + n for _, start, n, _ in prefill_rows), default=0),
        prefill_block_tables=block_tables(prefill_rows))
    return ModelInputs(to_device(input_ids, torch.int64), to_device(positions, torch.int64),
                       meta, sample_indices, sample_requests)


def fast_paths() -> list[Callable[[ModelRunner], None]]:
    """The optional fast paths (nanoserve/accel/ ships one), found as vLLM finds its plugins, by
    entry point: the chapter core imports none of them. `enforce_eager=True` skips them all."""
    return [ep.load() for ep in entry_points(group="nanoserve.fast_paths")]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        """`config` is resolved (resolve_config): no "auto" or None is left in it."""
        self.config, self.block_size = config, config.block_size
        self.device, self.dtype = torch.device(config.device), DTYPES[config.dtype]
        self.backend = select_backend(self.device, self.dtype, config.attention_backend)
        torch.manual_seed(config.seed)
        self.model, self.hf_config = load_model(model_dir, self.dtype, self.device)
        self.attn_layers = self.model.attention_layers()
        self.sampler = Sampler(config.seed)
        self.num_kv_blocks = config.num_kv_blocks or self._kv_blocks_from_memory()
        self._allocate_kv_cache()
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        if not config.enforce_eager:
            for optimize in fast_paths():  # may swap modules of self.model, or the model itself
                optimize(self)

    def kv_bytes_per_block(self) -> int:
        layer = self.attn_layers[0]  # K and V of block_size tokens, in every layer
        return (2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads * layer.head_dim
                * self.dtype.itemsize)

    def _kv_blocks_from_memory(self) -> int:
        budget = self._cuda_kv_budget() if self.device.type == "cuda" else \
            int(self.config.kv_cache_memory_gib * 2**30)
        num_blocks = budget // self.kv_bytes_per_block() - 1  # the sink block is in budget too
        if num_blocks < 1:
            raise ValueError("the KV cache memory budget is smaller than one block; raise "
                             "kv_cache_memory_gib / gpu_memory_utilization or set num_kv_blocks")
        return num_blocks

    def _cuda_kv_budget(self) -> int:
        """Memory left for KV after the weights and a warm-up forward's peak activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # The warm-up: one full step of fresh sequences, one per block of a scratch cache.
        step, num_tokens = SchedulerOutput(), self.config.max_num_batched_tokens
        for i, start in enumerate(range(0, num_tokens, self.block_size)):
            n = min(self.block_size, num_tokens - start)
            req = Request(f"warmup-{i}", [0] * n, SamplingParams(max_tokens=1))
            req.block_table = [i]
            step.scheduled.append(ScheduledRequest(req, n, samples=False))
        self._allocate_kv_cache(num_blocks=len(step.scheduled))
        inputs = prepare_inputs(step, self.block_size, self.device)
        self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
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

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> dict[str, int | str]:
        """Run the step; return each sampling request's token (or the sampler's error)."""
        inputs = prepare_inputs(out, self.block_size, self.device)
        meta = inputs.attn_metadata
        hidden = self.model(inputs.input_ids, inputs.positions, meta)
        if not inputs.sample_requests:
            return {}
        logits = self.model.compute_logits(hidden[inputs.sample_indices])
        reqs = inputs.sample_requests
        token_ids = self.sampler(logits, [r.sampling_params for r in reqs],
                                 [r.generator for r in reqs])
        return {r.request_id: t for r, t in zip(reqs, token_ids)}
