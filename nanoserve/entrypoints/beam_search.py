"""Beam search as vLLM does it (`LLM.beam_search`, and `use_beam_search` served), outside the
chapter's loop: each round asks the engine for one token of every live beam with the top 2 ×
beam_width logprobs, then keeps the beam_width best sequences (HF transformers' rule). A beam's
prompt is its whole sequence, so the prefix cache (§5) holds what earlier rounds computed and a
round prefills little more than each beam's last block; the scheduler never knows it searches."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

from nanoserve.entrypoints.prompts import prompt_tokens
from nanoserve.layers.sampler import Logprob
from nanoserve.sampling_params import SamplingParams
from nanoserve.utils import check_field, is_int


@dataclass
class BeamSearchParams:
    """vLLM's. `length_penalty`: a finished sequence scores its summed logprob over its length
    (the prompt's tokens included, as in vLLM) to this power. `temperature` only decides which
    token each beam samples beside its top 2 × beam_width (0: the most likely one)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # served: the EOS among a choice's tokens

    def __post_init__(self) -> None:
        need = partial(check_field, self)
        most = 10  # each round asks for 2 × beam_width logprobs: max_logprobs' 20 by default
        need(is_int(self.beam_width) and 1 <= self.beam_width <= most, "beam_width",
             f"an integer in [1, {most}]")
        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            need(isinstance(getattr(self, name), bool), name, "a bool")
        need(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
             "temperature", "a number >= 0")
        need(isinstance(self.length_penalty, (int, float)) and not isinstance(
            self.length_penalty, bool) and math.isfinite(self.length_penalty),
             "length_penalty", "a finite number")


@dataclass
class BeamSearchSequence:
    """A candidate: `tokens` start with the prompt's (vLLM's); a finished one ends in its EOS."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token
    cum_logprob: float = 0.0
    text: str | None = None  # set on the sequences returned
    finish_reason: str | None = None  # "stop" (an EOS) or "length"
    stop_reason: int | None = None  # the EOS token id


@dataclass
class BeamSearchOutput:
    """One prompt's best sequences, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search: `live()` beams want a token each; `advance()` takes their logprobs."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_token_ids: frozenset,
                 max_model_len: int) -> None:
        self.params, self.eos_token_ids = params, eos_token_ids
        self.num_prompt_tokens = len(prompt)
        self.beams = [BeamSearchSequence(list(prompt))]
        self.completed: list[BeamSearchSequence] = []
        self.rounds_left = min(params.max_tokens, max_model_len - len(prompt))

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.params.temperature, max_tokens=1,
                              logprobs=2 * self.params.beam_width)

    def live(self) -> list[BeamSearchSequence]:
        return self.beams if self.rounds_left > 0 else []

    def advance(self, logprobs: list[dict[int, Logprob] | None]) -> None:
        """Each live beam's next-token logprobs (None: it got no token). A candidate ending in an
        EOS is finished; of the others the beam_width most likely go on."""
        candidates = []
        for beam, entry in zip(self.beams, logprobs, strict=True):
            for token, lp in (entry or {}).items():
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry],
                                         beam.cum_logprob + lp.logprob)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    seq.finish_reason, seq.stop_reason = "stop", token
                    self.completed.append(seq)
                else:
                    candidates.append(seq)
        candidates.sort(key=lambda s: s.cum_logprob, reverse=True)  # all of one length
        self.beams = candidates[:self.params.beam_width]
        self.rounds_left -= 1

    def score(self, seq: BeamSearchSequence) -> float:
        """vLLM's (after HF's): the summed logprob over the length, EOS not counted."""
        length = len(seq.tokens) - (seq.finish_reason == "stop")
        return seq.cum_logprob / length ** self.params.length_penalty

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best of the finished and the still running, by score."""
        for beam in self.beams:
            beam.finish_reason = "length"
        return sorted(self.completed + self.beams, key=self.score,
                      reverse=True)[:self.params.beam_width]

    def generated(self, seq: BeamSearchSequence) -> tuple[list[int], list[int]]:
        """A served choice's token ids and the ids its text decodes: without the prompt's, and
        without the EOS (which its token ids keep with include_stop_str_in_output)."""
        ids = seq.tokens[self.num_prompt_tokens:]
        text_ids = ids[:-1] if seq.finish_reason == "stop" else ids
        return (ids if self.params.include_stop_str_in_output else text_ids), text_ids


def beam_search(llm, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """`LLM.beam_search`: every prompt's search, each round one `generate()` of all live beams.
    As vLLM's, a sequence's text is its whole sequence decoded, the prompt's tokens included."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    searches = []
    for prompt in prompts:  # every prompt checked before the first round
        ids, _ = prompt_tokens(prompt, llm.tokenizer)
        llm.processor.check_prompt(ids)
        searches.append(BeamSearch(ids, params, llm.processor.eos_token_ids,
                                   llm.scheduler.max_model_len_in_cache))
    while any(s.live() for s in searches):
        beams = [b for s in searches for b in s.live()]
        outputs = iter(llm.generate([b.tokens for b in beams], searches[0].sampling_params(),
                                    use_tqdm=False))
        for s in searches:
            s.advance([(next(outputs).logprobs or [None])[0] for _ in s.live()])
    results = []
    for s in searches:
        best = s.best()
        for seq in best:
            # vLLM's BeamSearchParams.skip_special_tokens, True: no <|im_start|> in the text
            seq.text = llm.tokenizer.decode(seq.tokens, skip_special_tokens=True) \
                if llm.tokenizer else ""
        results.append(BeamSearchOutput(best))
    return results
