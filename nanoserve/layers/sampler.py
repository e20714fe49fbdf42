"""§4 ("one forward step"): turn each sampling row's logits into its next token.

Greedy rows (temperature 0) take the argmax, exactly as HF `generate` does. Other rows
are scaled by temperature, cut by top-k and top-p, and drawn from the request's own
generator when it has a seed (so its tokens don't depend on its batch neighbours), or
from the engine's generator otherwise.
"""

from __future__ import annotations

import torch

from nanoserve.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits: [num_rows, vocab]; one params and one (optional) generator per row."""
        token_ids = logits.argmax(dim=-1).tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return token_ids
        probs, order = self._filtered_probs(logits[rows].float().cpu(), [params[i] for i in rows])
        for j, i in enumerate(rows):
            choice = torch.multinomial(probs[j], 1, generator=generators[i] or self.generator)
            token_ids[i] = int(order[j, choice])
        return token_ids

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities over the vocabulary sorted descending (and that order), with
        top-k and top-p applied: tokens outside them get probability 0."""
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits, order = (logits / temperature).sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[1]).unsqueeze(0)
        top_k = torch.tensor([p.top_k or logits.shape[1] for p in params]).unsqueeze(1)
        logits = logits.masked_fill(rank >= top_k, float("-inf"))
        probs = logits.softmax(dim=-1)
        # top-p: keep the smallest prefix whose mass reaches top_p (the first token always).
        top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p, 0.0)
        return probs, order
