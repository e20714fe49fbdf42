"""Static vs continuous batching, measured: the numbers behind chapter 2.2 §2, §3 and §7.

§2 claims that static batching wastes most slot-steps when output lengths are skewed (8
requests, the longest 500 steps, the other 7 about 50: ~79% of slot-steps idle). §3 claims
that iteration-level scheduling removes that waste: a finished request leaves at once and a
waiting one takes its slot in the next step. §7 says latency (TTFT, TPOT, E2E, p95/p99)
depends on load. This script runs the *same work* on four systems and measures all three:

  continuous  nanoserve, FCFS scheduler (§3, §6)
  static      nanoserve, "static" policy: a batch enters only when the previous one is done,
              and finished requests keep computing wasted "idle rows" until then (§2)
  hf-static   transformers `generate` on left-padded batches of max_num_seqs prompts
  hf-cb       transformers' own continuous batching (`init_continuous_batching`)

Same work means: the same chat-templated prompt token ids, and exactly the requested number
of output tokens per request (EOS ignored / suppressed). Useful tokens = the sum of the
requested lengths; whatever a system computes beyond that is waste.

    python bench.py                        # longtail workload, all four systems
    python bench.py --workload chapter     # §2's example, with its picture
    python bench.py --quick                # smaller, ~1 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

SYSTEMS = ("continuous", "static", "hf-static", "hf-cb")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_SIZE = 16  # KV block (page) size, the same for nanoserve and hf-cb
SLOT_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"

# -- workloads ------------------------------------------------------------------------------


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


QUICK_MAX_TOKENS = 96  # --quick: 16 requests in 8 slots, outputs clipped to 96 tokens


def longtail_lengths(rng: np.random.Generator, n: int, quick: bool) -> list[int]:
    """Long-tailed output lengths, like real chat traffic (most answers short, a few very
    long): lognormal with median 32 and sigma 1.2, rounded and clipped to [8, 512]
    (--quick: [8, 96]). Mean ~ 65, p90 ~ 150, max of 64 draws ~ 400-512."""
    hi = QUICK_MAX_TOKENS if quick else 512
    return np.clip(np.round(rng.lognormal(math.log(32), 1.2, n)), 8, hi).astype(int).tolist()


def make_workload(name: str, tokenizer, num_requests: int, seed: int, quick: bool,
                  arrival_rate: float | None, max_num_seqs: int | None) -> Workload:
    rng = np.random.default_rng(seed)
    if name == "chapter":
        lengths = chapter_lengths(quick)
        words = rng.integers(10, 40, len(lengths))
        seqs, desc = max_num_seqs or 8, "§2: 8 requests, output lengths " + str(lengths)
    else:
        n = min(num_requests, 16) if quick else num_requests
        lengths = longtail_lengths(rng, n, quick)
        words = rng.integers(5, 120, n)  # prompts of ~40..200 tokens with the template
        seqs = max_num_seqs or (8 if quick else 16)
        desc = (f"{n} requests, output lengths lognormal(median 32, sigma 1.2) clipped to "
                f"[8, {QUICK_MAX_TOKENS if quick else 512}] (seed {seed}): sum {sum(lengths)}, "
                f"mean {np.mean(lengths):.0f}, max {max(lengths)}")
    arrivals = poisson_arrivals(rng, len(lengths), arrival_rate)
    if arrival_rate:
        desc += f"; Poisson arrivals at {arrival_rate} req/s"
    jobs = [Job(chat_ids(tokenizer, prompt_text(rng, int(w))), int(n), a)
            for w, n, a in zip(words, lengths, arrivals)]
    return Workload(name, jobs, seqs, desc)


# -- results --------------------------------------------------------------------------------


@dataclass
class Result:
    """What one system did with one workload. A "request-step" is one request computing in
    one engine step; it is useful if the request needs that computation (a prefill chunk or
    a decode of a token it will return), wasted if the request is already done (§2)."""

    system: str
    wall_s: float
    num_steps: int
    max_num_seqs: int
    useful_tokens: int
    prompt_tokens: int
    useful_request_steps: int
    wasted_request_steps: int
    ttft: list[float | None]
    tpot: list[float | None]
    e2e: list[float]
    preemptions: int | None = None
    peak_kv_usage: float | None = None
    notes: list[str] = field(default_factory=list)
    # steps x slots; 0 = empty slot, j+1 = job j computes usefully, -(j+1) = wasted row
    timeline: list[list[int]] | None = None

    @property
    def output_tps(self) -> float:
        return self.useful_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.useful_tokens + self.prompt_tokens) / self.wall_s

    @property
    def utilisation(self) -> float:
        """Useful request-steps / slot-steps: the fraction of the batch doing real work."""
        return self.useful_request_steps / max(1, self.num_steps * self.max_num_seqs)

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("ttft", "tpot", "e2e", "timeline")}
        d.update(output_tps=self.output_tps, total_tps=self.total_tps,
                 utilisation=self.utilisation)
        for name in ("ttft", "tpot", "e2e"):
            for p in (50, 95, 99):
                d[f"{name}_p{p}"] = percentile(getattr(self, name), p)
        return d


def percentile(values: list[float | None], p: float) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.percentile(present, p)) if present else None


def check_lengths(system: str, jobs: list[Job], lengths: list[int]) -> None:
    """A benchmark that silently did different work would be worse than none."""
    bad = [(i, j.max_tokens, n) for i, (j, n) in enumerate(zip(jobs, lengths)) if n != j.max_tokens]
    if bad:
        raise RuntimeError(f"{system}: requests got the wrong number of tokens "
                           f"(job, wanted, got): {bad[:5]}")


def assign_slots(steps: list[list[tuple[int, bool]]], num_slots: int) -> list[list[int]]:
    """Turn "who computed in each step" into a slots x steps picture: a request keeps the
    lowest slot that was free when it first appeared, until a step without it."""
    slot_of: dict[int, int] = {}
    grid = []
    for rows in steps:
        present = {job for job, _ in rows}
        for job in [j for j in slot_of if j not in present]:
            del slot_of[job]
        for job, _ in rows:
            if job not in slot_of:
                used = set(slot_of.values())
                slot_of[job] = min(s for s in range(num_slots + len(rows)) if s not in used)
        line = [0] * max(num_slots, max(slot_of.values(), default=-1) + 1)
        for job, useful in rows:
            line[slot_of[job]] = job + 1 if useful else -(job + 1)
        grid.append(line[:num_slots])
    return grid


# -- nanoserve ------------------------------------------------------------------------------


def kv_blocks_for(jobs: list[Job], max_num_seqs: int) -> int:
    """Enough KV blocks for the max_num_seqs largest requests at once (no preemption)."""
    need = sorted((-(-(len(j.prompt_ids) + j.max_tokens) // BLOCK_SIZE) for j in jobs),
                  reverse=True)
    return sum(need[:max_num_seqs]) + max_num_seqs


def run_nanoserve(model_dir: str | None, jobs: list[Job], policy: str, max_num_seqs: int,
                  dtype: str = "float32", max_num_batched_tokens: int = 512,
                  num_kv_blocks: int | None = None) -> Result:
    from nanoserve import LLM, SamplingParams

    system = "continuous" if policy == "fcfs" else policy
    llm = LLM(model_dir, scheduling_policy=policy, max_num_seqs=max_num_seqs, dtype=dtype,
              max_num_batched_tokens=max_num_batched_tokens, block_size=BLOCK_SIZE,
              num_kv_blocks=num_kv_blocks or kv_blocks_for(jobs, max_num_seqs),
              max_model_len=max(len(j.prompt_ids) + j.max_tokens for j in jobs),
              enable_prefix_caching=False)  # prompts share a chat-template prefix: keep the
    # prefill work identical to the HF systems, which recompute it
    llm.generate([jobs[0].prompt_ids], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up

    job_of: dict[str, int] = {}
    outputs: dict[int, object] = {}
    steps: list[list[tuple[int, bool]]] = []
    peak_kv, order = 0.0, sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    start = time.monotonic()
    while order or llm.has_unfinished_requests():
        now = time.monotonic() - start
        while order and jobs[order[0]].arrival <= now:  # arrivals enter between steps (§4)
            i = order.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=jobs[i].max_tokens,
                                    ignore_eos=True)
            job_of[llm.add_request(jobs[i].prompt_ids, params)] = i
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, jobs[order[0]].arrival - now))  # idle until the next arrival
            continue
        for out in llm.step():
            outputs[job_of[out.request_id]] = out
        sched = llm.last_scheduler_output
        steps.append([(job_of[r.request_id], True) for r in sched.scheduled]
                     + [(job_of[r.request_id], False) for r in sched.idle_rows])
        peak_kv = max(peak_kv, llm.stats().kv_cache_usage)
    wall = time.monotonic() - start

    outs = [outputs[i] for i in range(len(jobs))]
    check_lengths(system, jobs, [len(o.token_ids) for o in outs])
    # The engine stamps arrival when add_request ran, up to one step after the job's
    # arrival time: add that lateness back so queueing delay is fully counted (§7).
    late = [o.metrics.arrival_time - (start + j.arrival) for o, j in zip(outs, jobs)]
    return Result(
        system, wall, len(steps), max_num_seqs,
        useful_tokens=sum(j.max_tokens for j in jobs),
        prompt_tokens=sum(len(j.prompt_ids) for j in jobs),
        useful_request_steps=sum(u for s in steps for _, u in s),
        wasted_request_steps=sum(not u for s in steps for _, u in s),
        ttft=[o.metrics.ttft + d for o, d in zip(outs, late)],
        tpot=[o.metrics.tpot for o in outs],
        e2e=[o.metrics.e2e + d for o, d in zip(outs, late)],
        preemptions=llm.stats().num_preemptions, peak_kv_usage=peak_kv,
        timeline=assign_slots(steps, max_num_seqs),
        notes=[f"max_num_batched_tokens {max_num_batched_tokens}, "
               f"{llm.scheduler.block_manager.num_blocks} KV blocks of {BLOCK_SIZE}"])


# -- transformers ---------------------------------------------------------------------------


def load_hf(model_dir: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype],
                                                 attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def run_hf_static(model_dir: str, jobs: list[Job], max_num_seqs: int,
                  dtype: str = "float32") -> Result:
    """Batches of max_num_seqs prompts, in arrival order, all available at t=0. Each batch
    generates as many positions as its longest request; min_new_tokens = max_new_tokens
    forbids EOS, so every row computes every position: exactly §2's waste. A request's
    own tokens are the first max_tokens of its row; the rest is thrown away."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model, tokenizer = load_hf(model_dir, dtype)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    class StepClock(LogitsProcessor):  # called once per generated position
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(batch: list[Job]) -> tuple[torch.Tensor, list[float]]:
        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids)
                             for j in batch])
        longest, clock = max(j.max_tokens for j in batch), StepClock()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                             min_new_tokens=longest, do_sample=False, pad_token_id=pad,
                             logits_processor=LogitsProcessorList([clock]))
        return out[:, width:], clock.times

    generate([Job(jobs[0].prompt_ids, 2)])  # warm-up
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    n = len(jobs)
    ttft, tpot, e2e, lengths = [None] * n, [None] * n, [0.0] * n, [0] * n
    num_steps, computed_rows, start = 0, 0, time.perf_counter()
    for b in range(0, len(order), max_num_seqs):
        idx = order[b:b + max_num_seqs]
        tokens, times = generate([jobs[i] for i in idx])
        done = time.perf_counter()
        num_steps += tokens.shape[1]
        computed_rows += tokens.numel()
        for i in idx:  # the caller gets nothing until the whole batch returns
            lengths[i] = tokens[:, :jobs[i].max_tokens].shape[1]
            ttft[i], e2e[i] = times[0] - start, done - start
            if jobs[i].max_tokens > 1:
                tpot[i] = (done - times[0]) / (jobs[i].max_tokens - 1)
    wall = time.perf_counter() - start
    check_lengths("hf-static", jobs, lengths)
    useful = sum(j.max_tokens for j in jobs)
    return Result(
        "hf-static", wall, num_steps, max_num_seqs, useful_tokens=useful,
        prompt_tokens=sum(len(j.prompt_ids) for j in jobs),
        useful_request_steps=useful,
        wasted_request_steps=computed_rows - useful,
        ttft=ttft, tpot=tpot, e2e=e2e,
        notes=["all requests at t=0 (no arrivals)", "TTFT = the batch's first sampled token; "
               "E2E = when generate() returns the batch", "padded dense KV cache: no KV usage"])


def run_hf_cb(model_dir: str, jobs: list[Job], max_num_seqs: int, dtype: str = "float32",
              max_num_batched_tokens: int = 512, num_kv_blocks: int | None = None) -> Result:
    """transformers' continuous batching manager, sized like nanoserve: same slots, token
    budget, page size and number of KV blocks; sdpa attention, no CUDA graphs, no prefix
    sharing. Per-request max_new_tokens and eos_token_id=-1 (never stops early)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, tokenizer = load_hf(model_dir, dtype)
    forwards: list[int] = []  # requests per forward pass = per engine step

    def count(module, args, kwargs) -> None:
        cu = kwargs.get("cu_seq_lens_q")
        forwards.append(int((cu.diff() > 0).sum()) if cu is not None else 0)

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id,
                           max_new_tokens=max(j.max_tokens for j in jobs))
    cb = ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=num_kv_blocks or kv_blocks_for(jobs, max_num_seqs),
        max_batch_tokens=max_num_batched_tokens, max_requests_per_batch=max_num_seqs,
        use_cuda_graph=False, auto_switch_to_flash=False, allow_block_sharing=False,
        use_async_batching=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        collect(manager, [Job(jobs[0].prompt_ids, 2)], time.perf_counter())  # warm-up
        hook = model.model.register_forward_pre_hook(count, with_kwargs=True)
        start = time.perf_counter()
        outs = collect(manager, jobs, start)
        wall = time.perf_counter() - start
        hook.remove()
    finally:
        manager.stop(block=True)
    check_lengths("hf-cb", jobs, [len(o.generated_tokens) for o in outs])
    # created_time is when collect() added the request, a little after its arrival time.
    arrived = [o.created_time - (start + j.arrival) for o, j in zip(outs, jobs)]
    useful = sum(j.max_tokens for j in jobs)
    return Result(
        "hf-cb", wall, len(forwards), max_num_seqs, useful_tokens=useful,
        prompt_tokens=sum(len(j.prompt_ids) for j in jobs),
        useful_request_steps=sum(forwards), wasted_request_steps=0,
        ttft=[o.timestamps[0] - o.created_time + d for o, d in zip(outs, arrived)],
        tpot=[(o.lifespan[1] - o.timestamps[0]) / (len(o.timestamps) - 1)
              if len(o.timestamps) > 1 else None for o in outs],
        e2e=[o.lifespan[1] - o.created_time + d for o, d in zip(outs, arrived)],
        notes=["per-request max_new_tokens", f"page_size {BLOCK_SIZE}, {cb.num_blocks} blocks, "
               f"max_batch_tokens {max_num_batched_tokens}, sdpa"])


def collect(manager, jobs: list[Job], start: float) -> list:
    """Add each job at its arrival time and wait for all results, in job order."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    results: dict[str, object] = {}
    while order or len(results) < len(jobs):
        now = time.perf_counter() - start
        while order and jobs[order[0]].arrival <= now:
            i = order.pop(0)
            manager.add_request(jobs[i].prompt_ids, request_id=f"job{i}",
                                max_new_tokens=jobs[i].max_tokens, eos_token_id=-1,
                                record_timestamps=True)
        wait = jobs[order[0]].arrival - now if order else 1.0
        out = manager.get_result(timeout=max(0.001, wait))
        if out is not None and out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"hf-cb request {out.request_id} failed: {out.error}")
            results[out.request_id] = out
        elif out is None and not order and not manager.is_running():
            raise RuntimeError("hf-cb: the generation thread died")
    return [results[f"job{i}"] for i in range(len(jobs))]


# -- reporting ------------------------------------------------------------------------------


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def throughput_table(results: list[Result]) -> str:
    lines = ["| system | wall s | output tok/s | total tok/s | steps | slot util | wasted rows "
             "| preempt | peak KV |", "|" + "---|" * 9]
    for r in results:
        lines.append(f"| {r.system} | {r.wall_s:.1f} | {r.output_tps:.1f} | {r.total_tps:.1f} "
                     f"| {r.num_steps} | {r.utilisation:.1%} | {r.wasted_request_steps} "
                     f"| {fmt(r.preemptions, digits=0)} | {fmt(r.peak_kv_usage, 100, 0)}"
                     f"{'' if r.peak_kv_usage is None else '%'} |")
    return "\n".join(lines)


def latency_table(results: list[Result]) -> str:
    lines = ["| system | TTFT p50/p95/p99 s | TPOT p50/p95/p99 ms | E2E p50/p95/p99 s |",
             "|---|---|---|---|"]
    for r in results:
        def triple(values: list, scale: float, digits: int) -> str:
            return " / ".join(fmt(percentile(values, p), scale, digits) for p in (50, 95, 99))
        lines.append(f"| {r.system} | {triple(r.ttft, 1, 2)} | {triple(r.tpot, 1000, 0)} "
                     f"| {triple(r.e2e, 1, 2)} |")
    return "\n".join(lines)


def best_utilisation(jobs: list[Job], max_num_seqs: int) -> float:
    """An upper bound for any scheduler: a request needs at least max_tokens steps (one
    prefill step, then one decode per further token), and all work needs
    sum(max_tokens) / max_num_seqs steps."""
    useful = sum(j.max_tokens for j in jobs)
    min_steps = max(max(j.max_tokens for j in jobs), -(-useful // max_num_seqs))
    return useful / (min_steps * max_num_seqs)


def ratio_lines(results: list[Result]) -> list[str]:
    by = {r.system: r for r in results}
    if "continuous" not in by:
        return []
    c = by["continuous"].output_tps
    return [f"continuous / {s}: {c / by[s].output_tps:.2f}x output tok/s"
            for s in SYSTEMS[1:] if s in by]


def text_timeline(r: Result, width: int = 100) -> str:
    """One line per slot: a letter per request computing usefully, '/' for a wasted row
    of a finished request (§2's hatched cells), '.' for an empty slot; k steps per char."""
    grid = r.timeline or []
    k = max(1, -(-len(grid) // width))
    lines = [f"{r.system}: {len(grid)} steps, {k} step(s) per character"]
    for slot in range(r.max_num_seqs):
        chars = []
        for g in range(0, len(grid), k):
            cells = [row[slot] for row in grid[g:g + k]]
            useful = [c for c in cells if c > 0]
            if useful:
                chars.append(SLOT_CHARS[(useful[-1] - 1) % len(SLOT_CHARS)])
            else:
                chars.append("/" if any(c < 0 for c in cells) else ".")
        lines.append(f"  slot {slot:2d} |{''.join(chars)}|")
    return "\n".join(lines)


def draw_png(results: list[Result], path: Path, title: str) -> bool:
    """Slots x steps, one colour per request, hatched = computing for a finished request,
    white = empty slot; static above continuous, on the same step axis (§2, §3 figures)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    panels = [r for r in results if r.timeline]
    panels.sort(key=lambda r: r.system != "static")
    if not panels:
        return False
    cmap = plt.get_cmap("tab20")
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.28 * panels[0].max_num_seqs
                                                       * len(panels)),
                             sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], panels):
        for slot in range(r.max_num_seqs):
            for first, length, code in runs([row[slot] for row in r.timeline]):
                if code == 0:
                    continue
                colour = cmap((abs(code) - 1) % 20)
                ax.broken_barh([(first, length)], (slot - 0.4, 0.8), facecolor=colour,
                               alpha=1.0 if code > 0 else 0.35, hatch=None if code > 0 else "///",
                               edgecolor="none" if code > 0 else "grey", linewidth=0)
        ax.set_ylim(r.max_num_seqs - 0.5, -0.5)
        ax.set_ylabel("slot")
        ax.set_title(f"{r.system}: {len(r.timeline)} steps, slot utilisation "
                     f"{r.utilisation:.0%}, {r.wall_s:.1f} s", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("engine step")
    fig.legend(handles=[Patch(facecolor=cmap(0), label="computing (one colour per request)"),
                        Patch(facecolor=cmap(0), alpha=0.35, hatch="///",
                              label="wasted: computing for a finished request"),
                        Patch(facecolor="white", edgecolor="grey", label="empty slot")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(textwrap.fill(title, 110), fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def runs(cells: list[int]) -> list[tuple[int, int, int]]:
    """(first step, length, code) of each run of equal cells."""
    out, first = [], 0
    for i in range(1, len(cells) + 1):
        if i == len(cells) or cells[i] != cells[first]:
            out.append((first, i - first, cells[first]))
            first = i
    return out


def machine_info() -> dict:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                   if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        cpu = platform.processor() or "unknown"
    import transformers

    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M")}


# -- main -----------------------------------------------------------------------------------


def run_system(system: str, model_dir: str, wl: Workload, args: argparse.Namespace) -> Result:
    runners: dict[str, Callable[[], Result]] = {
        "continuous": lambda: run_nanoserve(model_dir, wl.jobs, "fcfs", wl.max_num_seqs,
                                            args.dtype, args.max_num_batched_tokens),
        "static": lambda: run_nanoserve(model_dir, wl.jobs, "static", wl.max_num_seqs,
                                        args.dtype, args.max_num_batched_tokens),
        "hf-static": lambda: run_hf_static(model_dir, wl.jobs, wl.max_num_seqs, args.dtype),
        "hf-cb": lambda: run_hf_cb(model_dir, wl.jobs, wl.max_num_seqs, args.dtype,
                                   args.max_num_batched_tokens),
    }
    return runners[system]()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("longtail", "chapter"), default="longtail")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--model", default=None, help="HF-style directory (default: bundled SmolLM2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="batch slots (default: 8 for chapter, 16 for longtail)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=64, help="longtail only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arrival-rate", type=float, default=None,
                   help="Poisson arrivals (requests/s); default: all at t=0. hf-static "
                        "ignores it (static batches of whatever is there at t=0)")
    p.add_argument("--quick", action="store_true", help="a smaller workload (~1 min)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice, one per core)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results (default bench_results/<workload>.json)")
    p.add_argument("--png", type=Path, default=None,
                   help="timeline picture (default bench_results/<workload>.png)")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    return args


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from nanoserve.utils.bundled import default_model_dir

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_dir()
    wl = make_workload(args.workload, AutoTokenizer.from_pretrained(model_dir),
                       args.num_requests, args.seed, args.quick, args.arrival_rate,
                       args.max_num_seqs)
    print(f"workload {wl.name}: {wl.description}; max_num_seqs {wl.max_num_seqs}; "
          f"prompt tokens {sum(len(j.prompt_ids) for j in wl.jobs)}; dtype {args.dtype}; "
          f"torch threads {torch.get_num_threads()}")
    results, loads = [], {}
    for system in args.systems:
        print(f"running {system} ...", end=" ", flush=True)
        results.append(run_system(system, model_dir, wl, args))
        # 1-minute load average, ours included: well above 1 + the threads we use means
        # someone else was computing too, and the timings are not trustworthy.
        loads[system] = os.getloadavg()[0]
        print(f"{results[-1].wall_s:.1f} s (load average {loads[system]:.1f})", flush=True)

    print()
    print(throughput_table(results))
    print()
    print(latency_table(results))
    print()
    best = best_utilisation(wl.jobs, wl.max_num_seqs)
    print(f"best possible slot utilisation for this workload: {best:.1%} "
          "(bound: no fewer steps than the longest request, nor than all work / slots)")
    for line in ratio_lines(results):
        print(line)
    for r in results:
        for note in r.notes:
            print(f"note ({r.system}): {note}")
        if r.timeline:
            print(text_timeline(r))

    out = args.out or Path("bench_results") / f"{wl.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None
                                                        else sys.argv[1:])),
        "machine": machine_info(), "workload": {
            "name": wl.name, "description": wl.description, "max_num_seqs": wl.max_num_seqs,
            "output_lengths": [j.max_tokens for j in wl.jobs],
            "prompt_lengths": [len(j.prompt_ids) for j in wl.jobs],
            "arrivals": [j.arrival for j in wl.jobs]},
        "load_average_after": loads, "best_utilisation": best,
        "results": [r.summary() for r in results],
        "ratios": ratio_lines(results), "timelines": {r.system: r.timeline for r in results
                                                      if r.timeline}}, indent=1))
    print(f"wrote {out}")
    png = args.png or Path("bench_results") / f"{wl.name}.png"
    if draw_png(results, png, f"{wl.name}: {wl.description}"):
        print(f"wrote {png}")
    return results


if __name__ == "__main__":
    main()
