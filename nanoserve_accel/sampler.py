"""§4's sampling on a CPU, cheaper: each row's largest logit in C (`c_largest`), and top-k and
top-p among each row's 1024 most likely tokens, not a sort of the whole vocabulary (a CPU sorts
16 rows of 49,152 logits in 38 ms, takes their top 1024 in 5 ms). The candidates suffice when
they hold every row's top-k, or its top-p mass; where they do not (a flat row), the plain sort
runs. Either way the probabilities, and so the draws (the noise is per vocabulary token), are
the plain sampler's. On a GPU the sort is cheap and checking that the candidates suffice would
cost a sync: only the CPU swaps these in."""

from __future__ import annotations

import ctypes

import torch

from nanoserve.layers.sampler import SamplingMetadata, filtered_probs, top_k_top_p

NUM_CANDIDATES = 1024


def candidate_probs(logits: torch.Tensor, meta: SamplingMetadata, k: int = NUM_CANDIDATES,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`filtered_probs`' answer, from the `k` most likely tokens of each row where they suffice."""
    if (meta.top_k is None and meta.top_p is None) or k >= logits.shape[1]:
        return filtered_probs(logits, meta)
    scaled = logits / meta.temperature.unsqueeze(1)
    values, ids = scaled.topk(k, dim=-1)
    if meta.top_k is None:
        within = torch.zeros(len(values), 1, dtype=torch.bool, device=values.device)
        kept = values
    else:  # a row whose top-k fits in the candidates: normalised over its k tokens, as plain
        within = meta.top_k.unsqueeze(1) <= k
        rank = torch.arange(k, device=values.device).unsqueeze(0)
        kept = values.masked_fill(rank >= meta.top_k.unsqueeze(1), float("-inf"))
    norm = torch.where(within, kept.logsumexp(dim=-1, keepdim=True),
                       scaled.logsumexp(dim=-1, keepdim=True))  # the others': the whole row's
    mass = (kept - norm).exp().sum(dim=-1, keepdim=True)
    need = torch.ones_like(mass) if meta.top_p is None else meta.top_p.unsqueeze(1)
    if not bool((within | (mass >= need)).all()):
        return filtered_probs(logits, meta)
    return top_k_top_p(values, meta, norm), ids


def c_largest(lib: ctypes.CDLL, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's `largest` (torch's max over the last dimension: a scalar loop on a CPU)
    through csrc/fused.c's; its values come back in float32 (the sampler asks which are NaN)."""
    if (logits.dim() != 2 or logits.device.type != "cpu" or not logits.is_contiguous()
            or logits.dtype not in (torch.float32, torch.bfloat16)):
        return logits.max(dim=-1)
    top = torch.empty(len(logits), dtype=torch.float32)
    tokens = torch.empty(len(logits), dtype=torch.int64)
    lib.largest(logits.data_ptr(), len(logits), logits.shape[1], top.data_ptr(),
                tokens.data_ptr(), logits.dtype == torch.bfloat16)
    return top, tokens
