"""§4 ("one forward step"): turn each sampling row's logits into its next token.

Greedy rows (temperature below 1e-5) take the argmax, exactly as HF `generate` does. Others are
scaled by temperature, cut by top-k and top-p, and drawn in float32 from the request's own generator
if it has a seed, else the engine's. A row that cannot be sampled (NaN logits, no token with a
finite probability) gets an error message instead of a token: only its request fails."""

from __future__ import annotations

import torch

from nanoserve.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int | str]:
        """logits [rows, vocab], a params and generator (or None) per row -> token or error str."""
        # max in the logits' own dtype: the same first-maximum index as argmax in float32 (the
        # widening is exact), without a float32 copy of every row. It propagates NaN: a row
        # holding one has it as its maximum (O(rows) check).
        top, greedy = logits.max(dim=-1)
        nan_rows = top.isnan().tolist()
        token_ids: list[int | str] = ["sampling failed: the logits contain NaN" if nan else t
                                      for nan, t in zip(nan_rows, greedy.tolist())]
        rows = [i for i, p in enumerate(params) if not p.greedy and not nan_rows[i]]
        if not rows:
            return token_ids
        probs, order = self._filtered_probs(logits[rows].float().cpu(), [params[i] for i in rows])
        # Draw in vocabulary order, not sorted order: a last-bit change of the logits (another
        # batch shape) then moves probabilities a little instead of swapping near-tied tokens.
        probs = torch.zeros_like(probs).scatter_(1, order, probs)
        # Every row is checked before anything is drawn, so a bad row never consumes random
        # numbers that a neighbour (sharing the engine's generator) would have drawn.
        ok = (probs.isfinite().all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
        for j, i in enumerate(rows):
            if not ok[j]:
                token_ids[i] = "sampling failed: no token has a finite, non-zero probability"
            else:
                token_ids[i] = int(torch.multinomial(
                    probs[j], 1, generator=generators[i] or self.generator))
        return token_ids

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted probabilities (descending) and their vocabulary order; 0 outside top-k, top-p."""
        # min(): a huge temperature (even inf) stays finite in float32, so -inf / t = -inf, not NaN.
        temperature = torch.tensor([min(p.temperature, 3e38) for p in params]).unsqueeze(1)
        logits, order = (logits / temperature).sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        rank = torch.arange(vocab).unsqueeze(0)
        top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params]).unsqueeze(1)
        logits = logits.masked_fill(rank >= top_k, float("-inf"))
        probs = logits.softmax(dim=-1)
        # top-p: keep the smallest prefix whose mass reaches top_p, and the first token
        # always (a top_p below float32's smallest rounds to 0).
        top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill((mass_before >= top_p) & (rank > 0), 0.0)
        return probs, order
