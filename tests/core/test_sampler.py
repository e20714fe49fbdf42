"""§4 ("one forward step"): the Sampler on distributions whose answer is known.

Every knob is checked against a number worked out by hand, through the public call (the
tokens drawn) and, where the draw would hide it, through `filtered_probs`:
- top_p keeps the smallest prefix of the sorted distribution whose mass reaches top_p: the
  token that crosses the mass is kept, every token after it is dropped; equal
  probabilities at the boundary are cut the same way (a prefix, not "all the ties");
- top_k keeps exactly k tokens;
- temperature divides the logits: < 1 sharpens, > 1 flattens (measured on the filtered
  probabilities and on the empirical frequencies of seeded draws);
- a request's own seeded generator makes its draws reproducible and independent of the
  engine's generator and of its batch neighbours; temperature 0 is the argmax.

Probabilities are powers of two (or equal logits), so the boundary arithmetic is exact.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nanoserve.layers.sampler import Sampler, SamplingMetadata, filtered_probs
from nanoserve.sampling_params import SamplingParams

# Sorted descending on purpose only in P; the logits below are shuffled so that the
# sampler's own sort (and its `order` back to token ids) is exercised.
P = [0.5, 0.25, 0.125, 0.0625, 0.0625]
TOKENS = [3, 0, 4, 1, 2]  # token id of P[i]
VOCAB = len(P)


def logits_of(probs_by_token: dict[int, float], vocab: int = VOCAB) -> torch.Tensor:
    out = torch.full((vocab,), -math.inf)
    for token, p in probs_by_token.items():
        out[token] = math.log(p)
    return out


LOGITS = logits_of(dict(zip(TOKENS, P)))


def kept(params: SamplingParams, logits: torch.Tensor = LOGITS) -> dict[int, float]:
    """Token id -> filtered (unnormalised) probability, for the tokens that survive."""
    meta = SamplingMetadata.build([params], [None], logits.shape[-1], logits.device)
    probs, ids = filtered_probs(logits.unsqueeze(0).float(), meta)
    ids = range(probs.shape[1]) if ids is None else ids[0].tolist()
    return {t: float(p) for t, p in zip(ids, probs[0]) if p > 0}


def draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS,
         seed: int = 0) -> Counter[int]:
    """n draws in one call (n rows of the same logits), from one seeded sampler."""
    sampler = Sampler(seed)
    tokens, _ = sampler(logits.unsqueeze(0).repeat(n, 1), [params] * n, [None] * n)
    return Counter(tokens)


# -- top_p --------------------------------------------------------------------------------


@pytest.mark.parametrize("top_p, num_kept", [
    (0.3, 1),    # 0.5 alone reaches 0.3
    (0.5, 1),    # exactly reached by the first token: nothing more
    (0.6, 2),    # 0.5 < 0.6: the crossing token (0.25) is kept, 0.125 is not
    (0.75, 2),   # 0.5 + 0.25 reaches 0.75 exactly
    (0.8, 3),
    (0.9, 4),    # 0.875 < 0.9: the first of the two tied 0.0625 crosses it, the other goes
    (1.0, 5),
])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p, num_kept):
    survivors = kept(SamplingParams(top_p=top_p))
    assert len(survivors) == num_kept
    # A prefix of the sorted order (the two 0.0625 ties may come in either order).
    assert set(TOKENS[:min(num_kept, 3)]) <= set(survivors)
    # The kept tokens keep their relative probabilities (0.5 : 0.25 : ...).
    for token, p in zip(TOKENS, P):
        if token in survivors:
            assert survivors[token] / survivors[TOKENS[0]] == pytest.approx(p / P[0])


def test_top_p_draws_only_from_the_kept_prefix_in_proportion():
    counts = draw(SamplingParams(top_p=0.6), n=1200)
    assert set(counts) == {3, 0}  # 0.5 and the crossing 0.25; never 0.125 or below
    assert counts[3] / 1200 == pytest.approx(2 / 3, abs=0.04)


def test_top_p_cuts_a_tie_to_the_prefix_that_reaches_the_mass():
    uniform = torch.zeros(8)  # eight tied tokens of 1/8: the mass is exact
    assert len(kept(SamplingParams(top_p=0.5), uniform)) == 4
    assert len(kept(SamplingParams(top_p=0.3), uniform)) == 3  # 2/8 < 0.3 <= 3/8
    assert len(kept(SamplingParams(top_p=0.125), uniform)) == 1
    counts = draw(SamplingParams(top_p=0.5), n=400, logits=uniform)
    assert len(counts) == 4


# -- top_k --------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_top_k_keeps_exactly_the_k_most_likely(top_k):
    survivors = kept(SamplingParams(top_k=top_k))
    assert set(survivors) == set(TOKENS[:top_k])
    counts = draw(SamplingParams(top_k=top_k), n=600)
    assert set(counts) == set(TOKENS[:top_k])


def test_top_k_on_ties_keeps_exactly_k_and_disabled_keeps_all():
    assert len(kept(SamplingParams(top_k=3), torch.zeros(8))) == 3
    assert len(kept(SamplingParams(top_k=None))) == VOCAB
    assert len(kept(SamplingParams(top_k=-1))) == VOCAB


def test_top_k_and_top_p_together_take_the_smaller_set():
    # top_k=3 renormalises to 4/7, 2/7, 1/7; top_p=0.8 then needs 4/7 + 2/7 = 6/7.
    assert set(kept(SamplingParams(top_k=3, top_p=0.8))) == set(TOKENS[:2])
    assert set(kept(SamplingParams(top_k=2, top_p=1.0))) == set(TOKENS[:2])


# -- temperature --------------------------------------------------------------------------

TWO = logits_of({0: 0.6, 1: 0.4}, vocab=2)


def normalised(params: SamplingParams, logits: torch.Tensor) -> dict[int, float]:
    survivors = kept(params, logits)
    total = sum(survivors.values())
    return {t: p / total for t, p in survivors.items()}


@pytest.mark.parametrize("temperature, p0", [
    (1.0, 0.6),
    (0.5, 0.36 / (0.36 + 0.16)),                       # p^2, renormalised: sharper
    (2.0, math.sqrt(0.6) / (math.sqrt(0.6) + math.sqrt(0.4))),  # sqrt(p): flatter
])
def test_temperature_sharpens_and_flattens(temperature, p0):
    params = SamplingParams(temperature=temperature)
    assert normalised(params, TWO)[0] == pytest.approx(p0, abs=1e-5)
    counts = draw(params, n=1500, logits=TWO)
    assert counts[0] / 1500 == pytest.approx(p0, abs=0.035)


def test_low_temperature_concentrates_on_the_argmax():
    counts = draw(SamplingParams(temperature=0.05), n=500)
    assert counts == Counter({TOKENS[0]: 500})  # 0.5 vs 0.25 at T=0.05: 2^-20 odds


def test_temperature_applies_before_top_p():
    # At T=0.5 the probabilities become 16:4:1:(1/4):(1/4) / 21.5; 16/21.5 = 0.744 reaches
    # top_p=0.7 alone, while at T=1 the same top_p needs two tokens.
    assert len(kept(SamplingParams(temperature=0.5, top_p=0.7))) == 1
    assert len(kept(SamplingParams(temperature=1.0, top_p=0.7))) == 2


# -- greedy and seeds ---------------------------------------------------------------------


def test_greedy_is_the_argmax_whatever_the_other_knobs():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, top_p=0.1, top_k=3)] * 6
    assert Sampler()(logits, params, [None] * 6)[0] == logits.argmax(dim=-1).tolist()


def test_mixed_batch_maps_each_row_to_its_own_tokens():
    """Greedy and sampled rows in one batch: each sampled row's token comes from its own
    logits (top_k=1 makes the sampled answer known: its argmax)."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1),
              SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=2.0),
              SamplingParams(top_p=1e-6)]
    assert Sampler()(logits, params, [None] * 5)[0] == logits.argmax(dim=-1).tolist()


def seeded_draws(seed: int, engine_seed: int, neighbours: int) -> list[int]:
    """Eight draws of one seeded request, one per step, batched with unseeded neighbours."""
    logits = torch.zeros(1 + neighbours, 64)  # uniform over 64 tokens: every draw matters
    params = [SamplingParams(seed=seed)] * (1 + neighbours)
    gen = torch.Generator().manual_seed(seed)
    sampler = Sampler(engine_seed)
    return [sampler(logits, params, [gen] + [None] * neighbours)[0][0] for _ in range(8)]


def test_seeded_draws_are_reproducible_and_independent_of_the_batch():
    first = seeded_draws(seed=7, engine_seed=0, neighbours=0)
    assert seeded_draws(seed=7, engine_seed=0, neighbours=0) == first
    # The request's own generator decides, not the engine's or the neighbours' draws.
    assert seeded_draws(seed=7, engine_seed=123, neighbours=3) == first
    # ...and the seed matters: another seed gives other tokens (64^8 sequences).
    assert seeded_draws(seed=8, engine_seed=0, neighbours=0) != first


def test_a_seeded_row_draws_from_its_own_generator_after_a_greedy_row():
    """Rows 1 and 2 are seeded, row 0 greedy: the sampled rows' positions among the sampled
    rows (0, 1) are not their batch rows (1, 2), and each must still draw from its own
    request's generator, exactly as alone."""
    logits = torch.zeros(3, 64)  # uniform over 64 tokens: every draw matters
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=7), SamplingParams(seed=8)]
    gens = [None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    batched = [Sampler(0)(logits, params, gens)[0][1:] for _ in range(8)]
    alone = {s: seeded_draws(seed=s, engine_seed=0, neighbours=0) for s in (7, 8)}
    assert [t for t, _ in batched] == alone[7]
    assert [t for _, t in batched] == alone[8]


def test_unseeded_draws_follow_the_engine_seed():
    logits = torch.zeros(16, 64)
    params = [SamplingParams()] * 16
    def tokens(engine_seed: int) -> list:
        return Sampler(engine_seed)(logits, params, [None] * 16)[0]

    assert tokens(5) == tokens(5)
    assert tokens(5) != tokens(6)


# -- on the device: one draw, one small readback ----------------------------------------


class HostReads(TorchFunctionMode):
    """Records every read to the host (tolist, item, cpu, numpy, a .to() onto the CPU) and
    every random draw a sampler makes."""

    def __init__(self) -> None:
        super().__init__()
        self.reads, self.draws = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tolist", "item", "cpu", "numpy") or (
                name == "to" and args[0].device.type != "cpu"  # (a host list's upload is not)
                and "cpu" in map(str, [*args[1:], *kwargs.values()])):
            self.reads.append((name, tuple(args[0].shape)))
        if name in ("exponential_", "multinomial", "rand", "rand_like", "uniform_"):
            self.draws.append((name, tuple(a for a in args if isinstance(a, int))))
        return func(*args, **kwargs)


def test_a_sampled_step_reads_back_only_the_tokens_and_draws_once():
    """16 rows at temperature 0.8, top-k 50, top-p 0.9 (two of them seeded): no [rows, vocab]
    tensor goes to the host, only the 16 tokens; one draw of noise for the batch, and one of
    its own row for each seeded request."""
    vocab, rows = 1000, 16
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)) * 3
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=s)
              for s in [None] * 14 + [1, 2]]
    gens = [None] * 14 + [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    sampler = Sampler(0)
    with HostReads() as seen:
        tokens, logprobs = sampler(logits, params, gens)
    assert seen.reads == [("tolist", (rows,))]
    assert seen.draws == [("rand", (rows, vocab))] + [("rand", (vocab,))] * 2
    assert len(tokens) == rows and all(isinstance(t, int) for t in tokens)
    assert logprobs == [None] * rows
    # top-k 50: every token is among its row's 50 most likely.
    top50 = logits.topk(50).indices
    assert all(t in top50[i] for i, t in enumerate(tokens))


def test_seeded_rows_draw_the_same_whatever_the_batch():
    """A seeded row with top-k / top-p draws the same tokens alone and among neighbours with
    other logits and other knobs, greedy and sampled, seeded and not."""
    vocab = 300
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(9)) * 2
    mine = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=21)

    def draws(neighbours: int) -> list[int]:
        g = torch.Generator().manual_seed(21)
        others = torch.randn(neighbours, vocab, generator=torch.Generator().manual_seed(3))
        logits = torch.cat([others[:neighbours // 2], row[None], others[neighbours // 2:]])
        params = [SamplingParams(temperature=t) for t in (0.0, 1.3, 0.5, 0.0)[:neighbours]]
        params.insert(neighbours // 2, mine)
        gens = [None] * (neighbours + 1)
        gens[neighbours // 2] = g
        sampler = Sampler(neighbours)
        return [sampler(logits, params, gens)[0][neighbours // 2] for _ in range(12)]

    assert draws(0) == draws(1) == draws(4)
