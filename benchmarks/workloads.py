"""The work every system gets: chat-templated prompt token ids, an exact output length per
request (EOS ignored), and an arrival time (chapter 2.2 §2's example, §7's load)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("longtail", "chapter", "vllm-longtail", "nano-vllm")
QUICK_MAX_TOKENS = 96  # --quick: 16 requests in 8 seats, outputs clipped to 96 tokens


@dataclass
class Job:
    """One request of a workload: what to send, how many tokens to get, and when."""

    prompt_ids: list[int]
    max_tokens: int
    arrival: float = 0.0  # seconds after the start of the run


@dataclass
class Workload:
    name: str
    jobs: list[Job]
    max_num_seqs: int
    description: str
    temperature: float = 0.0  # every request's (0: greedy, whose tokens systems must agree on)

    @property
    def useful_tokens(self) -> int:
        return sum(j.max_tokens for j in self.jobs)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(j.prompt_ids) for j in self.jobs)


TOPICS = ["the water cycle", "binary search", "the French revolution", "photosynthesis",
          "how vaccines work", "compound interest", "the TCP handshake", "black holes",
          "sourdough bread", "the Pythagorean theorem", "garbage collection", "plate tectonics",
          "the immune system", "hash tables", "the Roman empire", "solar panels"]
FILLER = ("Please be precise and use simple words. I am a student and I have read a little "
          "about this already but the textbook was confusing and my notes are incomplete. "
          "Give an example if it helps, and mention one common misconception. ").split()


def prompt_text(rng: np.random.Generator, num_words: int) -> str:
    """A question about a random topic, padded with filler words to about num_words."""
    topic = TOPICS[rng.integers(len(TOPICS))]
    words = [FILLER[i % len(FILLER)] for i in range(rng.integers(len(FILLER)), 10**6)]
    return f"Explain {topic}. " + " ".join(words[:max(0, num_words - 2)])


def chat_ids(tokenizer, text: str) -> list[int]:
    """The prompt as the instruct model expects it: chat template + generation prompt."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float | None) -> list[float]:
    """Arrival times of a Poisson process (rate requests/s), or all at t=0."""
    if not rate:
        return [0.0] * n
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


def chapter_lengths(quick: bool) -> list[int]:
    """§2: one request of 500 steps, seven of 20..80 (mean 50). --quick divides by 5."""
    lengths = [20, 500, 30, 40, 50, 60, 70, 80]
    return [max(2, n // 5) for n in lengths] if quick else lengths


def longtail_lengths(rng: np.random.Generator, n: int, hi: int) -> list[int]:
    """Long-tailed output lengths, like real chat traffic (most answers short, a few very
    long): lognormal with median 32 and sigma 1.2, rounded and clipped to [8, hi].
    With hi = 512: mean ~ 65, p90 ~ 150, max of 64 draws ~ 400-512."""
    return np.clip(np.round(rng.lognormal(math.log(32), 1.2, n)), 8, hi).astype(int).tolist()


def make_workload(name: str, tokenizer, num_requests: int, seed: int, quick: bool,
                  arrival_rate: float | None, max_num_seqs: int | None) -> Workload:
    """chapter: §2's 8 requests. longtail: prompts of ~40..200 tokens, outputs clipped to
    [8, 512]. vllm-longtail: the vLLM comparison's setting, prompts of ~40..90 tokens,
    outputs clipped to [8, 256]. nano-vllm: nano-vllm's bench.py (nano_vllm_workload).
    --quick: at most 16 requests in 8 seats, outputs <= 96."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    rng = np.random.default_rng(seed)
    if name == "nano-vllm":
        return nano_vllm_workload(rng, quick, max_num_seqs)
    if name == "chapter":
        lengths = chapter_lengths(quick)
        words = rng.integers(10, 40, len(lengths))
        seqs, desc = max_num_seqs or 8, "§2: 8 requests, output lengths " + str(lengths)
    else:
        n = min(num_requests, 16) if quick else num_requests
        hi = QUICK_MAX_TOKENS if quick else 512 if name == "longtail" else 256
        lengths = longtail_lengths(rng, n, hi)
        # words -> tokens with the template: 5..120 -> ~40..200, 6..52 -> ~40..90
        words = rng.integers(5, 120, n) if name == "longtail" else rng.integers(6, 52, n)
        seqs = max_num_seqs or (8 if quick else 16)
        desc = (f"{n} requests, output lengths lognormal(median 32, sigma 1.2) clipped to "
                f"[8, {hi}] (seed {seed}): sum {sum(lengths)}, "
                f"mean {np.mean(lengths):.0f}, max {max(lengths)}")
    arrivals = poisson_arrivals(rng, len(lengths), arrival_rate)
    if arrival_rate:
        desc += f"; Poisson arrivals at {arrival_rate} req/s"
    jobs = [Job(chat_ids(tokenizer, prompt_text(rng, int(w))), int(n), a)
            for w, n, a in zip(words, lengths, arrivals)]
    return Workload(name, jobs, seqs, desc)


def nano_vllm_workload(rng: np.random.Generator, quick: bool, max_num_seqs: int | None,
                       gpu: bool | None = None) -> Workload:
    """nano-vllm's bench.py: 256 requests of random token ids (0..10000), 100-1024 prompt and
    100-1024 output tokens each, sampled at temperature 0.6 with EOS ignored. Whole on a GPU; on
    a CPU (or --quick) 32 requests with lengths divided by 8, the same shape of work."""
    import torch

    gpu = torch.cuda.is_available() if gpu is None else gpu
    n, scale = (256, 1) if gpu and not quick else (32, 8)
    jobs = [Job(rng.integers(0, 10001, int(rng.integers(100, 1025)) // scale).tolist(),
                int(rng.integers(100, 1025)) // scale) for _ in range(n)]
    seqs = max_num_seqs or (256 if gpu and not quick else 32)
    return Workload("nano-vllm", jobs, seqs, f"nano-vllm's bench: {n} requests of random ids, "
                    f"prompts and outputs {100 // scale}-{1024 // scale} tokens",
                    temperature=0.6)
