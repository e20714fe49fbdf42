"""§4 ("one forward step") and §5: run one scheduled step on the model.

Selective batching (Orca): the new tokens of *all* scheduled requests, prefill chunks and decodes
alike, are flattened into one batch of rows. The linear layers don't care where a request ends; only
attention does, told by the `AttentionMetadata` built here (with each new token's KV slot). Rows:
decodes (one new token each, then static batching's idle rows), then prefill chunks.

On a GPU the inputs go up as pinned, asynchronous copies, the sampled tokens are all that comes
back, and decode steps replay CUDA graphs (cuda_graph.py) unless `enforce_eager`."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import torch
import torch.distributed as dist

from nanoserve.config import TORCH_DTYPES, EngineConfig
from nanoserve.engine.cuda_graph import CUDAGraphRunner, compile_elementwise, cuda_kv_budget
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.workers import Workers, init_rank, receive, torchrun_rank
from nanoserve.layers.attention import AttentionMetadata, get_backend
from nanoserve.layers.sampler import Logprob, Sampler, to_device
from nanoserve.models.loader import load_model


@dataclass
class StepInputs:
    """A step's rows as host lists (step_inputs): what tensor-parallel rank 0 sends the others."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    num_decode_tokens: int
    decode_context_lens: list[int]
    decode_block_tables: list[list[int]]  # padded to the widest (block 0: never read)
    cu_seqlens_q: list[int]
    cu_seqlens_k: list[int]
    max_seqlen_q: int
    max_seqlen_k: int
    prefill_block_tables: list[list[int]]
    sample_indices: list[int]  # the row of each sampling request's last token

    def to(self, device: torch.device) -> ModelInputs:
        def table(rows: list[list[int]]) -> torch.Tensor:
            width = len(rows[0]) if rows else 0
            return to_device([x for r in rows for x in r], device).view(len(rows), width)

        meta = AttentionMetadata(
            slot_mapping=to_device(self.slot_mapping, device, torch.int64),
            num_decode_tokens=self.num_decode_tokens, num_prefill_tokens=self.cu_seqlens_q[-1],
            decode_context_lens=to_device(self.decode_context_lens, device),
            decode_block_tables=table(self.decode_block_tables),
            cu_seqlens_q=to_device(self.cu_seqlens_q, device),
            cu_seqlens_k=to_device(self.cu_seqlens_k, device), max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k, prefill_block_tables=table(self.prefill_block_tables))
        return ModelInputs(to_device(self.input_ids, device, torch.int64),
                           to_device(self.positions, device, torch.int64), meta,
                           to_device(self.sample_indices, device, torch.int64))


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampling] int64


@dataclass
class ModelRunnerOutput:
    token_ids: dict[str, int | str]  # each sampling request's token (or the sampler's error)
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)  # where asked for


def step_inputs(out: SchedulerOutput, block_size: int) -> tuple[StepInputs, list[Request]]:
    """The step's rows, in the order above, and the requests that sample; changes nothing."""
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

    def block_tables(rows: list) -> list[list[int]]:
        width = max((len(r[0].block_table) for r in rows), default=0)
        return [r[0].block_table + [0] * (width - len(r[0].block_table)) for r in rows]

    step = StepInputs(
        input_ids, positions, slots, len(decode_rows),
        [start + 1 for _, start, _, _ in decode_rows], block_tables(decode_rows), cu_q, cu_k,
        max((n for _, _, n, _ in prefill_rows), default=0),
        max((start + n for _, start, n, _ in prefill_rows), default=0),
        block_tables(prefill_rows), sample_indices)
    return step, sample_requests


def fast_paths() -> list[tuple[str, Callable[[ModelRunner], None]]]:
    """The installed fast-path plugins (nanoserve_accel), found by entry point as vLLM finds its
    plugins; one that fails to load is skipped with a warning: the engine runs its plain path."""
    found = []
    for ep in entry_points(group="nanoserve.fast_paths"):
        try:
            found.append((ep.name, ep.load()))
        except Exception as e:  # e.g. its folder was deleted after it was installed
            logging.getLogger("nanoserve").warning(
                "fast path %r did not load, running the plain path: %r", ep.name, e)
    return found


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, rank: int = 0,
                 init_method: str | None = None) -> None:
        """`config` is resolved (no "auto" or None left). Tensor parallel: rank 0 starts the
        others (workers.py); on a rank > 0 this serves steps until rank 0 stops, then exits."""
        self.config, self.block_size = config, config.block_size
        self.device, self.dtype = torch.device(config.device), TORCH_DTYPES[config.dtype]
        self.backend = get_backend(config.attention_backend)
        tp, self.workers = config.tensor_parallel_size, None
        if tp > 1:
            rank = torchrun_rank() or rank
            if rank == 0:  # it starts the other ranks (unless torchrun did), then joins them
                self.workers = Workers(config, model_dir, worker_main)
            group = self.workers.group if rank == 0 else init_rank(config, rank, init_method)
        torch.manual_seed(config.seed)
        self.model, self.hf_config = load_model(model_dir, self.dtype, self.device, tp, rank)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.attn_layers = self.model.attention_layers()
        self.sampler = Sampler(config.seed, self.device)
        self.fast_paths, self.kv_zeros, self.decode_step = [], torch.zeros, None  # their hooks
        for name, optimize in fast_paths() if config.enable_fast_paths else []:
            optimize(self)  # may replace self.model's modules, backend, kv_zeros, decode_step
            self.fast_paths.append(name)
        if config.torch_compile:
            compile_elementwise(self.model)
        self.num_kv_blocks = config.num_kv_blocks or self._kv_blocks_from_memory()
        if tp > 1:  # every rank's cache holds the same blocks (of its own heads): the fewest
            blocks = torch.tensor([self.num_kv_blocks])
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=group)
            self.num_kv_blocks = int(blocks)
        self._allocate_kv_cache()
        self.kv_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.model = CUDAGraphRunner(self.model, config.max_num_seqs, self.max_blocks_per_seq,
                                         self.num_kv_blocks, self.block_size)  # the sink block
        if rank > 0:
            while (step := receive(group)) is not None:
                self.run(step)
            dist.destroy_process_group()
            sys.exit(0)

    def kv_bytes_per_block(self) -> int:
        layer = self.attn_layers[0]  # K and V of block_size tokens, in every layer
        return (2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads * layer.head_dim
                * self.dtype.itemsize)

    def _kv_blocks_from_memory(self) -> int:
        budget = cuda_kv_budget(self) if self.device.type == "cuda" else \
            int(self.config.kv_cache_memory_gib * 2**30)
        num_blocks = budget // self.kv_bytes_per_block() - 1  # the sink block is in budget too
        if num_blocks < 1:
            raise ValueError("the KV cache memory budget is smaller than one block; raise "
                             "kv_cache_memory_gib / gpu_memory_utilization or set num_kv_blocks")
        return num_blocks

    def run_alone(self, out: SchedulerOutput) -> None:
        """One step on this rank only, its tokens dropped (cuda_graph's warm-up, every rank's)."""
        step, reqs = step_inputs(out, self.block_size)
        if (logits := self.run(step)) is not None:
            self.sample(logits, reqs)

    def _allocate_kv_cache(self, num_blocks: int | None = None) -> None:
        """One tensor [2, layers, blocks + 1, block_size, kv_heads, head_dim]. The extra
        last block is a sink for padding rows (CUDA graphs): it belongs to no request."""
        num_blocks = num_blocks or self.num_kv_blocks
        layer = self.attn_layers[0]
        self.kv_cache = self.kv_zeros(2, len(self.attn_layers), num_blocks + 1, self.block_size,
                                      layer.num_kv_heads, layer.head_dim,
                                      dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.bind(self.kv_cache[0, i], self.kv_cache[1, i], self.backend)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; return each sampling request's token (or the sampler's error)."""
        step, reqs = step_inputs(out, self.block_size)
        if self.decode_step and (tokens := self.decode_step(step, reqs)) is not None:
            return ModelRunnerOutput({r.request_id: t for r, t in zip(reqs, tokens)})
        if self.workers is None:
            logits = self.run(step)
        else:  # tensor parallel: the other ranks run it too
            self.workers.send(step)
            try:
                logits = self.run(step)
            except RuntimeError as e:  # a collective failed: which rank is gone?
                self.workers.check(e)
        return self.sample(logits, reqs) if reqs else ModelRunnerOutput({})

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor | None:
        """The forward pass (every rank), and the sampling rows' logits (rank 0's)."""
        inputs = step.to(self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        if len(step.sample_indices) < len(hidden):  # else every row, in order: nothing to gather
            hidden = hidden[inputs.sample_indices]
        return self.model.compute_logits(hidden) if step.sample_indices else None

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> ModelRunnerOutput:
        token_ids, logprobs = self.sampler(logits, [r.sampling_params for r in reqs],
                                           [r.generator for r in reqs])
        return ModelRunnerOutput({r.request_id: t for r, t in zip(reqs, token_ids)},
                                 {r.request_id: lp for r, lp in zip(reqs, logprobs)
                                  if lp is not None})

    def shutdown(self) -> None:
        """Tensor parallel: stop the other ranks (a no-op with one)."""
        if self.workers is not None:
            self.workers.stop()
            self.workers = None


def worker_main(config: EngineConfig, model_dir: str, rank: int, init_method: str) -> None:
    """A rank > 0 started by rank 0 (workers.py): its shard of the model, stepping until told to
    stop. Ctrl-C goes to rank 0, which stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ModelRunner(config, model_dir, rank, init_method)  # returns only by exiting the process
