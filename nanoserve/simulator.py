"""§5 without a model, and §2, §3, §6.3 step by step. `KVReadingRunner` runs a step like the
ModelRunner (through the real `step_inputs`), but its "KV cache" holds token ids: written at each
new token's seat, read back through a sampling row's block table and hashed into its next token. So
a wrong seat, a stale or wrongly shared block or a bad prefix-cache hit changes the output.
`simulate()` drives the real schedulers and BlockManager with it, recording each step with trace.py;
scripts/reader/simulate.py draws the chapter's figures from that."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.model_runner import step_inputs
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.static_scheduler import StaticScheduler
from nanoserve.engine.trace import Tracer
from nanoserve.sampling_params import SamplingParams


def next_token(token_ids: Sequence[int], vocab_size: int = 1000) -> int:
    """An order-sensitive hash in [0, vocab_size - 1), so vocab_size - 1 can be an EOS never hit."""
    h = 0
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return h % (vocab_size - 1)


class KVReadingRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000) -> None:
        self.block_size, self.vocab_size = block_size, vocab_size
        self.kv: list[int | None] = [None] * (num_blocks * block_size)  # token id per seat

    def execute_model(self, out: SchedulerOutput) -> dict[str, int]:
        step, reqs = step_inputs(out, self.block_size)
        inputs = step.to(torch.device("cpu"))
        meta, bs = inputs.attn_metadata, self.block_size
        positions = inputs.positions.tolist()
        for seat, token in zip(meta.slot_mapping.tolist(), inputs.input_ids.tolist()):
            self.kv[seat] = token
        cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
        sampled = {}
        for row, req in zip(step.sample_indices, reqs):
            if row < meta.num_decode_tokens:  # a decode row reads its whole context
                table = meta.decode_block_tables[row].tolist()
                context_len = int(meta.decode_context_lens[row])
            else:  # a prefill row sees the chunk's keys up to itself (causal)
                q = row - meta.num_decode_tokens
                j = next(j for j in range(len(cu_q) - 1) if q < cu_q[j + 1])
                table = meta.prefill_block_tables[j].tolist()
                context_len = cu_k[j + 1] - cu_k[j] - (cu_q[j + 1] - q) + 1
            if positions[row] != context_len - 1:
                raise RuntimeError(f"{req.request_id}: position {positions[row]} but "
                                     f"context length {context_len}")
            read = [self.kv[table[p // bs] * bs + p % bs] for p in range(context_len)]
            if None in read:
                raise RuntimeError(f"{req.request_id} read a KV seat never written "
                                     f"(position {read.index(None)})")
            sampled[req.request_id] = next_token(read, self.vocab_size)
        return sampled


@dataclass
class SimRequest:
    """A request of exactly `output_len` tokens (EOS ignored), due from step `arrival_step + 1`."""

    name: str  # one character: the request's letter in the grid
    prompt_len: int
    output_len: int
    arrival_step: int = 0


@dataclass
class Simulation:
    policy: str
    num_seats: int
    records: list[dict]  # the trace's step records (nanoserve/trace.py), steps 1..N
    notes: list[str]  # each preemption (victim and why) and each recompute

    def steps_of(self, name: str) -> list[int]:
        """The steps in which `name` computed (a prefill chunk or a decode, not idle)."""
        return [rec["step"] for rec in self.records for r in rec["rows"]
                if r["request"] == name and r["role"] != "idle"]

    def admitted(self, name: str) -> list[int]:
        return [rec["step"] for rec in self.records if name in rec["admitted"]]

    def grid(self) -> list[str]:
        """Per seat, a character per step: the request's letter while it computes, '/' an
        idle static row (§2), '!' its request was just preempted, '.' an empty seat."""
        cells = [["."] * len(self.records) for _ in range(self.num_seats)]
        for i, rec in enumerate(self.records):
            for r in rec["rows"]:
                cells[r["seat"]][i] = "/" if r["role"] == "idle" else r["request"]
            for p in rec["preempted"]:
                cells[p["seat"]][i] = "!"
        return ["".join(row) for row in cells]

    def summary(self) -> str:
        text, total = "".join(self.grid()), len(self.records) * self.num_seats
        useful, idle = sum(c.isalpha() for c in text), text.count("/")
        return (f"{len(self.records)} steps x {self.num_seats} seats = {total} seat-steps: "
                f"useful {useful} ({useful / total:.2%}), idle rows {idle} "
                f"({idle / total:.2%}), empty {total - useful - idle}")


def simulate(jobs: list[SimRequest], policy: str = "fcfs", num_seats: int = 4,
             num_blocks: int = 256, block_size: int = 4, token_budget: int = 256,
             trace: str | None = None) -> Simulation:
    """`trace`: also append the run to this JSON-lines file (nanoserve/trace.py)."""
    static = policy == "static"  # §2's baseline, in the chapter's FCFS order
    config = EngineConfig(max_num_seqs=num_seats, max_num_batched_tokens=token_budget,
                          max_model_len=num_blocks * block_size,
                          scheduling_policy="fcfs" if static else policy,
                          batching="static" if static else "continuous",
                          enable_prefix_caching=False)  # a preempted request recomputes all
    sched = (StaticScheduler if static else Scheduler)(config, num_blocks, block_size)
    runner = KVReadingRunner(num_blocks, block_size)
    tracer = Tracer(trace or None, config, sched.block_manager, source="simulator")
    # Notes name the running request refused a block (it forces the preemption, §6.2).
    refused, allocate = [], sched.block_manager.allocate_slots

    def allocate_and_listen(req: Request, *args: object, **kwargs: object) -> bool:
        ok = allocate(req, *args, **kwargs)
        if not ok and req.status == RequestStatus.RUNNING:
            refused.append(req.request_id)
        return ok

    sched.block_manager.allocate_slots = allocate_and_listen
    rule = "PRIORITY victim = lowest priority" if policy == "priority" else \
        "FCFS victim = last admitted"
    pending, records, notes, victims = sorted(jobs, key=lambda j: j.arrival_step), [], [], set()
    while pending or sched.has_unfinished_requests():
        step = len(records) + 1
        while pending and pending[0].arrival_step < step:
            job = pending.pop(0)
            prompt = [(ord(job.name[0]) * 7 + i) % 997 for i in range(job.prompt_len)]
            sched.add_request(Request(job.name, prompt, SamplingParams(
                max_tokens=job.output_len, ignore_eos=True)))
        out = sched.schedule()
        if out.is_empty and not out.preempted and sched.has_unfinished_requests():
            raise RuntimeError(f"step {step}: nothing scheduled although requests wait")
        finished = [] if out.is_empty else sched.update_from_output(out, runner.execute_model(out))
        records.append(tracer.record(out, finished, sched))
        for row in records[-1]["rows"]:
            if row["request"] in victims and row["request"] in records[-1]["admitted"]:
                notes.append(f"step {step}: {row['request']} resumes and recomputes "
                             f"{row['end'] - row['start']} tokens (prompt + generated)")
        for victim, needy in zip([r.request_id for r in out.preempted], refused):
            victims.add(victim)
            notes.append(f"step {step}: {victim} preempted: no free KV block for {needy}'s "
                         f"next token; {rule} = {victim}; to the front of waiting, KV dropped")
        refused.clear()
    return Simulation(policy, num_seats, records, notes)
