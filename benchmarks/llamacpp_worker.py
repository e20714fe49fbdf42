"""Runs llama.cpp (llama-cpp-python 0.3.36's low-level API) on a job and writes what it did as JSON.

It runs with .venv-llamacpp/bin/python in a process of its own, never inside nanoserve's venv;
benchmarks/llamacpp_system.py writes the job file and reads the result file:

    .venv-llamacpp/bin/python benchmarks/llamacpp_worker.py JOB.json RESULT.json

Two modes (job["mode"]):

  step      decode step time, for scripts/bench/step_times.py, one step at a time between
            nanoserve's (so that both engines meet the machine in the same moments): commands on
            standard input, a line each, answered a line each on standard output (the worker's
            own prints and llama.cpp's go to standard error). First the worker answers with its
            info (one JSON line); then "rows R": R sequences prefilled to `context` tokens (the
            same token ids as step_times' nanoserve rows), answered "ready"; "step": one timed
            step in which every sequence decodes one token at exactly `context` tokens of
            context (one llama_decode of an R-token batch, then the logits' argmax; the decoded
            token is removed again, untimed, as step_times re-runs the same batch), answered with
            its seconds. End of input ends it. No result file.
  workload  bench.py's `llamacpp` system: the prompt ids and exact output lengths of a
            workload, served with continuous batching the way llama.cpp's server runs its slots:
            max_num_seqs sequence ids; each step is one llama_decode holding one token for every
            decoding sequence, then prompt chunks of sequences still prefilling, then newly
            admitted requests (a waiting request takes the lowest free sequence id), up to
            max_num_batched_tokens; greedy argmax; a finished sequence's KV is removed and its
            sequence id reused. All requests at t=0 (arrival times are ignored, as for vLLM).

The llama.cpp context: one KV stream per sequence (kv_unified false, as the server with -np N),
flash attention and the KV cache type as llama.cpp defaults them (auto, f16) unless the job sets
"flash_attn" (auto / on / off) or "kv_type" (f16 / f32 / bf16); n_threads = n_threads_batch =
job["threads"]. The scheduling (Scheduler) is plain Python, importable without llama.cpp, so
that its plumbing is tested in nanoserve's venv.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # ggml_type values (ggml.h)
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
CTX_PAD = 256  # llama.cpp pads each sequence's context to a multiple of 256


def step_tokens(row: int, context: int) -> list[int]:
    """Row `row`'s context + 1 tokens: the ids step_times.decode_batch gives nanoserve's rows."""
    return [(13 * row + j) % 5000 + 10 for j in range(context + 1)]


def padded(n: int) -> int:
    return -(-n // CTX_PAD) * CTX_PAD


# --- the scheduler: which tokens go into each llama_decode (no llama.cpp here) ---------------

@dataclass
class Slot:
    """A running request: its sequence id, how much of its prompt is in the KV cache, and the
    tokens it has generated so far."""

    job: int
    seq: int
    prompt: list[int]
    max_tokens: int
    fed: int = 0
    out: list[int] = field(default_factory=list)


@dataclass
class Entry:
    """One token of a batch: llama_batch's token, pos, seq_id and logits flag."""

    slot: Slot
    token: int
    pos: int
    logits: bool


class Scheduler:
    """llama.cpp server-style slots: every step, one token for each decoding sequence first,
    then prompt chunks (sequences still prefilling, then admitted requests) up to the budget."""

    def __init__(self, prompts: list[list[int]], max_tokens: list[int], max_num_seqs: int,
                 budget: int) -> None:
        if any(n < 1 for n in max_tokens) or any(not p for p in prompts):
            raise ValueError("every request needs a prompt and max_tokens >= 1")
        self.prompts, self.max_tokens, self.budget = prompts, max_tokens, budget
        self.waiting = deque(range(len(prompts)))
        self.free = list(range(max_num_seqs))
        self.running: list[Slot] = []

    def unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self) -> list[Entry]:
        entries = [Entry(s, s.out[-1], len(s.prompt) + len(s.out) - 1, True)
                   for s in self.running if s.fed == len(s.prompt)]
        queue, left = [s for s in self.running if s.fed < len(s.prompt)], self.budget - len(entries)
        while left > 0:
            if queue:
                slot = queue.pop(0)
            elif self.waiting and self.free:  # admit: the lowest free sequence id
                self.free.sort()
                job = self.waiting.popleft()
                slot = Slot(job, self.free.pop(0), self.prompts[job], self.max_tokens[job])
                self.running.append(slot)
            else:
                break
            n = min(left, len(slot.prompt) - slot.fed)
            entries += [Entry(slot, slot.prompt[p], p, p == len(slot.prompt) - 1)
                        for p in range(slot.fed, slot.fed + n)]
            slot.fed, left = slot.fed + n, left - n
        return entries

    def commit(self, entries: list[Entry], sampled: list[int]) -> list[Slot]:
        """Hand each logits entry its sampled token (in batch order); returns the requests that
        are now done, their sequence ids freed for reuse."""
        wanted = [e for e in entries if e.logits]
        if len(wanted) != len(sampled):
            raise ValueError(f"{len(sampled)} sampled tokens for {len(wanted)} logits rows")
        for e, token in zip(wanted, sampled):
            e.slot.out.append(token)
        done = [s for s in self.running if len(s.out) == s.max_tokens]
        for s in done:
            self.running.remove(s)
            self.free.append(s.seq)
        return done


# --- llama.cpp ------------------------------------------------------------------------------

class Engine:
    """A model and a context with `n_seq` sequences of up to `n_ctx_seq` tokens each."""

    def __init__(self, gguf: str, n_seq: int, n_ctx_seq: int, n_batch: int, threads: int,
                 kv_type: str | None = None, flash_attn: str = "auto") -> None:
        import llama_cpp as L
        import numpy as np

        self.L, self.np = L, np
        # llama.cpp logs every graph it builds (debug level, ~100 lines a decode): errors only.
        self.log = L.llama_log_callback(quiet_log)  # kept: llama.cpp holds only the pointer
        L.llama_log_set(self.log, None)
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.ctx = None
        self.new_context(n_seq, n_ctx_seq, n_batch, threads, kv_type, flash_attn)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def new_context(self, n_seq: int, n_ctx_seq: int, n_batch: int, threads: int,
                    kv_type: str | None = None, flash_attn: str = "auto") -> None:
        L = self.L
        if self.ctx:
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
        p = L.llama_context_default_params()
        p.n_seq_max, p.kv_unified = n_seq, False
        p.n_ctx = n_seq * padded(n_ctx_seq)
        p.n_batch = p.n_ubatch = n_batch
        p.n_threads = p.n_threads_batch = threads
        if kv_type:
            p.type_k = p.type_v = KV_TYPES[kv_type]
        p.flash_attn_type = FLASH_ATTN[flash_attn]
        self.ctx = L.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.kv_type = {v: k for k, v in KV_TYPES.items()}.get(p.type_k, str(p.type_k))
        self.flash_attn = flash_attn

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (seq, token, pos, logits) entries; the argmax of every logits
        row, in batch order."""
        b, L = self.batch, self.L
        if len(entries) > self.n_batch:
            raise ValueError(f"{len(entries)} tokens > n_batch {self.n_batch}")
        for i, (seq, token, pos, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = sum(bool(e[3]) for e in entries)
        if not rows:
            return []
        # the logits rows are stored in batch order of the entries that asked for them
        logits = self.np.ctypeslib.as_array(L.llama_get_logits(self.ctx),
                                            shape=(rows, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def drop(self, seq: int, from_pos: int = -1) -> None:
        """Remove sequence `seq`'s KV cells from `from_pos` on (-1: all of them)."""
        self.L.llama_memory_seq_rm(self.mem, seq, from_pos, -1)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    def info(self) -> dict:
        import llama_cpp

        return {"llama_cpp_python": llama_cpp.__version__, "kv_type": self.kv_type,
                "flash_attn": self.flash_attn,
                "n_ctx_seq": self.L.llama_n_ctx_seq(self.ctx),
                "system_info": self.L.llama_print_system_info().decode().strip()}


def quiet_log(level: int, text: bytes, user_data) -> None:
    if level == 3:  # GGML_LOG_LEVEL_ERROR
        sys.stderr.write(text.decode(errors="replace"))


def prefill(engine: Engine, rows: int, context: int) -> None:
    """Rows 0..rows-1 each filled with step_tokens(row)[:context], n_batch tokens a decode."""
    entries = [(r, t, p, False) for r in range(rows)
               for p, t in enumerate(step_tokens(r, context)[:context])]
    for i in range(0, len(entries), engine.n_batch):
        engine.decode(entries[i:i + engine.n_batch])


def run_steps(job: dict, commands: TextIO, replies: TextIO) -> None:
    """Step mode's loop (the module's docstring): `commands` in, a line out for each."""
    context = job["context"]
    options = job.get("kv_type"), job.get("flash_attn") or "auto"
    t0 = time.perf_counter()
    engine = Engine(job["gguf"], 1, context + 1, 512, job["threads"], *options)
    info = {"startup_s": time.perf_counter() - t0, "threads": job["threads"], **engine.info()}
    replies.write(json.dumps(info) + "\n")
    replies.flush()
    batch: list[tuple[int, int, int, bool]] = []
    for line in commands:
        command, *arg = line.split()
        if command == "rows":
            rows = int(arg[0])
            engine.new_context(rows, context + 1, max(512, rows), job["threads"], *options)
            prefill(engine, rows, context)
            batch = [(r, step_tokens(r, context)[context], context, True) for r in range(rows)]
            answer = "ready"
        elif command == "step" and batch:
            t = time.perf_counter()
            engine.decode(batch)
            answer = repr(time.perf_counter() - t)
            for seq, _, _, _ in batch:
                engine.drop(seq, context)  # back to `context` tokens: the same step again
        else:
            raise SystemExit(f"unknown command {line.strip()!r} (rows R, then step)")
        replies.write(answer + "\n")
        replies.flush()


def run_workload(job: dict) -> dict:
    prompts, max_tokens, seqs = job["prompts"], job["max_tokens"], job["max_num_seqs"]
    budget = job["max_num_batched_tokens"]
    t0 = time.perf_counter()
    engine = Engine(job["gguf"], seqs, job["max_model_len"], max(budget, seqs), job["threads"],
                    job.get("kv_type"), job.get("flash_attn") or "auto")
    startup = time.perf_counter() - t0
    warm = Scheduler(prompts[:1], [2], 1, budget)  # warm-up: the first prompt, two tokens
    while warm.unfinished():
        entries = warm.plan()
        warm.commit(entries, engine.decode([(e.slot.seq, e.token, e.pos, e.logits)
                                            for e in entries]))
    engine.clear()
    first_token = time.perf_counter() - t0

    sched, n = Scheduler(prompts, max_tokens, seqs, max(budget, seqs)), len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    first, done_at = [0.0] * n, [0.0] * n
    steps: list[list[int]] = []
    start = time.perf_counter()
    while sched.unfinished():
        entries = sched.plan()
        before = {id(e.slot): len(e.slot.out) for e in entries}
        done = sched.commit(entries, engine.decode([(e.slot.seq, e.token, e.pos, e.logits)
                                                    for e in entries]))
        now = time.perf_counter() - start
        slots = list({id(e.slot): e.slot for e in entries}.values())
        steps.append([s.job for s in slots])
        for s in slots:
            if before[id(s)] == 0 and s.out:
                first[s.job] = now
        for s in done:
            engine.drop(s.seq)
            tokens[s.job], done_at[s.job] = s.out, now
    wall = time.perf_counter() - start
    return {"mode": "workload", "startup_s": startup, "first_token_s": first_token,
            "wall_s": wall, "token_ids": tokens, "ttft": first, "e2e": done_at,
            "steps": steps, "threads": job["threads"], **engine.info()}


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    if job.get("mode") == "step":
        # The answers on a copy of standard output; fd 1 itself then goes to standard error, so
        # that nothing llama.cpp prints from C can get between them.
        replies = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        return run_steps(job, sys.stdin, replies)
    if job.get("mode") != "workload":
        raise SystemExit(f"unknown mode {job.get('mode')!r}; choose from step, workload")
    with open(result_path, "w") as f:
        json.dump(run_workload(job), f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.split("\n\n")[1].strip())
    main(sys.argv[1], sys.argv[2])
