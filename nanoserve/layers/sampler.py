"""§4 ("one forward step"): turn each sampling row's logits into its next token, on the logits'
device, for the whole batch at once (vLLM V1's sampler): nothing of [rows, vocab] leaves the
device, and the only transfer back is one small tensor, the tokens.

Greedy rows (temperature below 1e-5) take the argmax, exactly as HF `generate` does. The others are
scaled by their temperature, cut by top-k and top-p (batched tensor ops, each row its own knobs),
and drawn in one go: token = argmax(probs / q) with q = -log(U) ~ Exp(1), which picks token i
with probability probs[i] (the "exponential race"). A request with a seed draws its q from its own
generator, so no neighbour consumes its random numbers; the others share the engine's.
A row that cannot be sampled (NaN logits, no token with a finite probability) gets an error message
instead of a token: only its request fails. `logprobs`, where asked for, are the model's own
(log-softmax of the raw logits, vLLM's default): the sampled token (and rank), and the top N."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.sampling_params import SamplingParams

NAN_LOGITS, NO_PROBABILITY = -1, -2  # error codes in the token tensor
ERRORS = {NAN_LOGITS: "sampling failed: the logits contain NaN",
          NO_PROBABILITY: "sampling failed: no token has a finite, non-zero probability"}


@dataclass
class Logprob:
    """vLLM's: a token's log-probability, its rank (1 = most likely) and text (the engine's)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SamplingMetadata:
    """The step's sampling knobs as tensors on the logits' device, one row per sampling request."""

    rows: torch.Tensor | None  # indices of the rows that sample (None: all rows are greedy)
    temperature: torch.Tensor | None  # [len(rows)] float32, and the knobs of those rows:
    top_k: torch.Tensor | None  # int64, vocab where off; None: no row uses top-k
    top_p: torch.Tensor | None  # float32; None: no row uses top-p
    generators: dict[int, torch.Generator]  # position in `rows` -> that request's generator
    num_logprobs: list[int | None]  # per row: how many top logprobs (None: none)

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              vocab_size: int, device: torch.device) -> SamplingMetadata:
        rows = [i for i, p in enumerate(params) if not p.greedy]
        num_logprobs = [p.logprobs for p in params]
        if not rows:
            return cls(None, None, None, None, {}, num_logprobs)
        sampled = [params[i] for i in rows]

        temperature = to_device([p.temperature for p in sampled], device, torch.float32)
        top_k = None if all(p.top_k is None for p in sampled) else to_device(
            [min(p.top_k or vocab_size, vocab_size) for p in sampled], device, torch.int64)
        top_p = None if all(p.top_p == 1.0 for p in sampled) else to_device(
            [p.top_p for p in sampled], device, torch.float32)
        seeded = {j: generators[i] for j, i in enumerate(rows) if generators[i] is not None}
        return cls(to_device(rows, device, torch.int64), temperature, top_k, top_p, seeded,
                   num_logprobs)


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int32,
              ) -> torch.Tensor:
    """A host list on `device`: on CUDA through pinned memory and an asynchronous copy (torch's
    caching host allocator reuses the pinned blocks, and knows when a copy is done with one)."""
    tensor = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return tensor.to(device, non_blocking=True)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device).manual_seed(seed)  # the engine's
        # What filters the rows that sample, and what finds each row's largest logit (max in the
        # logits' own dtype: argmax's first maximum, without a float32 copy; NaN propagates): a
        # fast path may swap in faster ones that compute the same (nanoserve_accel, on a CPU).
        self.filter, self.largest = filtered_probs, lambda logits: logits.max(dim=-1)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 ) -> tuple[list[int | str], list[dict[int, Logprob] | None]]:
        """logits [rows, vocab], a params and generator (or None) per row -> each row's token
        (or error message), and its logprobs (None where not asked for)."""
        meta = SamplingMetadata.build(params, generators, logits.shape[1], logits.device)
        top, tokens = self.largest(logits)
        if meta.rows is not None:
            probs, ids = self.filter(logits[meta.rows].float(), meta)
            drawn = self.draw(probs, ids, logits.shape[1], meta.generators)
            tokens = tokens.index_put((meta.rows,), drawn)
        tokens = tokens.masked_fill(top.isnan(), NAN_LOGITS)
        token_list = [ERRORS.get(t, t) for t in tokens.tolist()]  # the step's one readback
        logprobs = [None] * len(token_list)
        if any(n is not None for n in meta.num_logprobs):
            logprobs = top_logprobs(logits, tokens, meta.num_logprobs)
        return token_list, logprobs

    def draw(self, probs: torch.Tensor, ids: torch.Tensor | None, vocab: int,
             generators: dict[int, torch.Generator]) -> torch.Tensor:
        """The module's exponential race, one q per token of the vocabulary whoever the candidates
        are (a last-bit change of the logits, in another batch, then moves probabilities a little
        instead of swapping the noise of near-ties). NO_PROBABILITY: a row with nothing to draw."""
        u = torch.rand(probs.shape[0], vocab, device=probs.device, generator=self.generator)
        for j, generator in generators.items():
            u[j] = torch.rand(vocab, device=probs.device, generator=generator)
        q = u.log_().neg_()  # U = 0 gives q = inf: that token is never drawn
        if ids is not None:
            q = q.gather(1, ids)
        best = (probs / q).argmax(dim=-1)
        tokens = best if ids is None else ids.gather(1, best.unsqueeze(1)).squeeze(1)
        return tokens.masked_fill(~(probs.sum(dim=-1) > 0), NO_PROBABILITY)  # also NaN sums


def filtered_probs(logits: torch.Tensor, meta: SamplingMetadata,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 logits [rows, vocab] -> probabilities after temperature, top-k and top-p, and the
    token id of each (None: the vocabulary's order). top-k keeps exactly k tokens; top-p the
    smallest sorted prefix whose mass reaches top_p (the crossing token kept, and the first)."""
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.top_k is None and meta.top_p is None:
        return logits.softmax(dim=-1), None
    values, ids = logits.sort(dim=-1, descending=True)
    return top_k_top_p(values, meta), ids


def top_k_top_p(values: torch.Tensor, meta: SamplingMetadata,
                norm: torch.Tensor | None = None) -> torch.Tensor:
    """Logits sorted in each row [rows, k] -> their probabilities after top-k and top-p. `norm`:
    the log of each row's whole mass [rows, 1] (None: of the values left after top-k)."""
    rank = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    if meta.top_k is not None:
        values = values.masked_fill(rank >= meta.top_k.unsqueeze(1), float("-inf"))
    probs = (values - (values.logsumexp(dim=-1, keepdim=True) if norm is None else norm)).exp()
    if meta.top_p is not None:  # (a top_p below float32's smallest rounds to 0: keep rank 0)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill((mass_before >= meta.top_p.unsqueeze(1)) & (rank > 0), 0.0)
    return probs


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None],
                 ) -> list[dict[int, Logprob] | None]:
    """For each row that asked: the sampled token's logprob and rank, and the top N tokens'."""
    asked = [i for i, n in enumerate(num_logprobs) if n is not None]
    index = torch.tensor(asked, device=logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)
    chosen = tokens[index].clamp_min(0).unsqueeze(1)  # an error row's entry is never read
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(max(num_logprobs[i] for i in asked), dim=-1)
    out: list[dict[int, Logprob] | None] = [None] * len(num_logprobs)
    for i, token, lp, rank, lps, ids in zip(asked, chosen[:, 0].tolist(),
                                            chosen_lp[:, 0].tolist(), ranks.tolist(),
                                            top_lp.tolist(), top_ids.tolist()):
        n = num_logprobs[i]
        out[i] = {token: Logprob(lp, rank)} | {t: Logprob(v, r + 1) for r, (t, v)
                                               in enumerate(zip(ids[:n], lps[:n]))}
    return out
