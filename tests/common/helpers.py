"""Test helpers: run a model without the engine, on inputs built by the engine's own
`step_inputs` from a hand-made step."""

from __future__ import annotations

import torch

from nanoserve.engine.model_runner import ModelInputs, step_inputs
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from nanoserve.layers.attention import Attention, get_backend
from nanoserve.sampling_params import SamplingParams


def bind_kv_cache(
    model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> None:
    """Give every Attention module of `model` its own zeroed paged K and V cache."""
    backend = get_backend("torch")
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        attn.bind(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), backend)


def make_inputs(seqs: list[tuple[list[int], int, list[int]]], block_size: int) -> ModelInputs:
    """One step as the scheduler would describe it. `seqs`: (block_table, num_cached,
    new_token_ids) per request; the new tokens of request i are at positions num_cached ..
    num_cached + len(new_token_ids) - 1. Decodes (one new token) must come first, because
    `step_inputs` puts them first and callers read the rows in `seqs` order."""
    step = SchedulerOutput()
    for i, (table, cached, new_ids) in enumerate(seqs):
        if len(new_ids) == 1 and i > 0 and len(seqs[i - 1][2]) > 1:
            raise ValueError("decode rows (one new token) must come first")
        req = Request(f"r{i}", [0] * cached + list(new_ids), SamplingParams())
        req.block_table, req.num_computed_tokens = list(table), cached
        step.scheduled.append(ScheduledRequest(req, len(new_ids), samples=True,
                                               is_decode=len(new_ids) == 1))
    return step_inputs(step, block_size)[0].to(torch.device("cpu"))


def run_step(
    model, token_ids: list[int], seqs: list[tuple[list[int], int, int]], block_size: int
) -> torch.Tensor:
    """One forward over the flattened new tokens of `seqs` ((block_table, num_cached,
    num_new) per request, `token_ids` the new tokens of all, in order); returns logits
    [num_tokens, V]."""
    new_ids, start = [], 0
    for _, _, n in seqs:
        new_ids.append(token_ids[start:start + n])
        start += n
    inputs = make_inputs([(t, c, ids) for (t, c, _), ids in zip(seqs, new_ids)], block_size)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        return model.compute_logits(hidden)
