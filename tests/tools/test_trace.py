"""The JSON-lines trace (issue 11): record fields and types, the seat ("seat") rules of the
chapter's figures, and a real short LLM run whose records must agree with what happened."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import FinishReason, Request, RequestStatus
from nanoserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from nanoserve.engine.trace import Tracer
from tests.common.tiny_model import tiny_model_dir

HEADER_TYPES = {"type": str, "name": str, "policy": str, "max_num_seqs": int,
                "token_budget": int, "num_blocks": int, "block_size": int, "source": str}
STEP_TYPES = {"type": str, "step": int, "time_ms": (float, type(None)), "t_s": (float, type(None)),
              "token_budget": int,
              "num_scheduled_tokens": int, "num_waiting": int, "num_running": int,
              "num_free_blocks": int, "num_blocks": int, "rows": list, "admitted": list,
              "preempted": list, "finished": list}


def req(rid: str, prompt_len: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8))


class FakeScheduler:
    """What the tracer reads of a scheduler: the two queues and the block counts."""

    def __init__(self) -> None:
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.block_manager = SimpleNamespace(num_free_blocks=10, num_blocks=12)


def step(tracer: Tracer, sched: FakeScheduler, *, run=(), idle=(), admit=(), preempt=(),
         finish=(), time_ms=None) -> dict:
    """Play one step by hand: `run` = (request, n) computed this step (advanced here, as
    update_from_output does), `finish` = requests that leave the engine this step."""
    for r in admit:
        sched.running.append(r)
    for r in preempt:
        sched.running.remove(r)
        r.num_computed_tokens, r.status = 0, RequestStatus.PREEMPTED
        sched.waiting.insert(0, r)
    scheduled = []
    for r, n in run:
        samples = r.num_computed_tokens + n == r.num_tokens
        decode = n == 1 and r.num_computed_tokens >= r.num_prompt_tokens  # as the scheduler's
        scheduled.append(ScheduledRequest(r, n, samples, decode))
        r.num_computed_tokens += n
        if samples:
            r.token_ids.append(7)
    for r in finish:
        r.status, r.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
        if r in sched.running:  # a static idle row has left `running` already
            sched.running.remove(r)
    out = SchedulerOutput(scheduled=scheduled, token_budget=16, idle_rows=list(idle),
                          preempted=list(preempt), admitted=list(admit))
    return tracer.step_record(out, list(finish), sched, time_ms)


def seats(record: dict) -> dict[str, int]:
    return {row["request"]: row["seat"] for row in record["rows"]}


def new_tracer(path: str = "unused.jsonl", policy: str = "fcfs") -> Tracer:
    static = policy == "static"
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16,
                          scheduling_policy="fcfs" if static else policy,
                          batching="static" if static else "continuous")
    return Tracer(path, config, BlockManager(12, 4), source="test")


def test_header_and_step_fields_and_types(tmp_path):
    path = tmp_path / "t.jsonl"
    tracer, sched = new_tracer(str(path)), FakeScheduler()
    a, b = req("0"), req("1")
    sched.running += [a, b]
    out = SchedulerOutput([ScheduledRequest(a, 4, True), ScheduledRequest(b, 3, False)],
                          token_budget=16, idle_rows=[], preempted=[], admitted=[a, b])
    a.num_computed_tokens, b.num_computed_tokens = 4, 3
    a.token_ids.append(5)
    tracer.record(out, [], sched, time_ms=12.34567)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["type"] for x in lines] == ["run", "step"]
    header, rec = lines
    for record, types in ((header, HEADER_TYPES), (rec, STEP_TYPES)):
        assert set(record) == set(types)
        for key, typ in types.items():
            assert isinstance(record[key], typ), key
    assert header["policy"] == "fcfs" and header["source"] == "test"
    assert rec["time_ms"] == 12.346 and rec["num_scheduled_tokens"] == 7
    assert (rec["num_running"], rec["num_waiting"], rec["num_free_blocks"]) == (2, 0, 10)
    assert rec["rows"] == [{"request": "0", "seat": 0, "role": "prefill", "start": 0, "end": 4},
                           {"request": "1", "seat": 1, "role": "prefill", "start": 0, "end": 3}]
    assert rec["admitted"] == ["0", "1"]
    # A second step appends one line, with no second header.
    sched.running.remove(a)
    a.status, a.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
    a.num_computed_tokens = 5
    out = SchedulerOutput([ScheduledRequest(a, 1, True, is_decode=True)], 16, [], [], [])
    tracer.record(out, [a], sched)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["type"] for x in lines] == ["run", "step", "step"]
    assert lines[2]["step"] == 2 and lines[2]["time_ms"] is None
    assert lines[2]["rows"][0]["role"] == "decode"
    assert lines[2]["finished"] == [{"request": "0", "reason": "stop"}]


def test_lowest_free_seat_freed_at_finish_and_preempt():
    tracer, sched = new_tracer(), FakeScheduler()
    a, b, c, d, e = (req(str(i)) for i in range(5))
    rec = step(tracer, sched, admit=[a, b, c], run=[(a, 4), (b, 4), (c, 4)])
    assert seats(rec) == {"0": 0, "1": 1, "2": 2}
    rec = step(tracer, sched, run=[(a, 1), (b, 1), (c, 1)], finish=[b])
    assert seats(rec) == {"0": 0, "1": 1, "2": 2}  # b still sits in its seat this step
    assert rec["finished"] == [{"request": "1", "reason": "length"}]
    rec = step(tracer, sched, admit=[d], run=[(a, 1), (c, 1), (d, 4)])
    assert seats(rec)["3"] == 1  # the lowest free seat, not the next unused one
    rec = step(tracer, sched, preempt=[a], run=[(c, 1), (d, 1)])
    assert [(p["request"], p["seat"]) for p in rec["preempted"]] == [("0", 0)]
    assert "recompute" in rec["preempted"][0]["reason"]
    assert "FCFS" in rec["preempted"][0]["reason"]
    rec = step(tracer, sched, admit=[e], run=[(c, 1), (d, 1), (e, 4)])
    assert seats(rec) == {"2": 2, "3": 1, "4": 0}  # the victim's seat is free again
    rec = step(tracer, sched, admit=[a], run=[(c, 1), (d, 1), (e, 1), (a, 5)])
    assert seats(rec)["0"] == 3  # the victim comes back to the lowest free seat
    assert rec["rows"][-1] == {"request": "0", "seat": 3, "role": "prefill", "start": 0,
                               "end": 5}  # recompute: prompt and its output token again


def test_static_keeps_idle_seats_until_the_batch_leaves():
    tracer, sched = new_tracer(policy="static"), FakeScheduler()
    a, b, c = req("0", 2), req("1", 2), req("2", 2)
    rec = step(tracer, sched, admit=[a, b, c], run=[(a, 2), (b, 2), (c, 2)])
    # `a` is done: StaticScheduler takes it out of `running` and keeps its row computing
    # (an idle row) with its seat until the batch leaves; it is not "finished" yet.
    a.status = RequestStatus.FINISHED
    sched.running.remove(a)
    rec = step(tracer, sched, run=[(b, 1), (c, 1)], idle=[a])
    assert rec["rows"][0] == {"request": "0", "seat": 0, "role": "idle"}
    assert seats(rec) == {"0": 0, "1": 1, "2": 2} and rec["finished"] == []
    b.status = RequestStatus.FINISHED
    sched.running.remove(b)  # done in that step: only its scheduled row tells it is there
    rec = step(tracer, sched, run=[(c, 1)], idle=[a, b])
    assert seats(rec) == {"0": 0, "1": 1, "2": 2}
    rec = step(tracer, sched, run=[(c, 1)], idle=[a, b], finish=[a, b, c])
    assert [r["role"] for r in rec["rows"]] == ["idle", "idle", "decode"]
    d = req("3")
    rec = step(tracer, sched, admit=[d], run=[(d, 4)])
    assert seats(rec) == {"3": 0}  # the whole batch left: every seat is free


def test_static_victim_admitted_in_the_same_step_takes_then_frees_its_seat():
    tracer, sched = new_tracer(policy="static"), FakeScheduler()
    a, b = req("0"), req("1")
    rec = step(tracer, sched, admit=[a, b], preempt=[b], run=[(a, 4)])
    assert seats(rec) == {"0": 0}
    assert [(p["request"], p["seat"]) for p in rec["preempted"]] == [("1", 1)]
    c = req("2")
    rec = step(tracer, sched, admit=[c], run=[(a, 1), (c, 4)])
    assert seats(rec) == {"0": 0, "2": 1}


def test_a_request_aborted_between_steps_frees_its_seat():
    tracer, sched = new_tracer(), FakeScheduler()
    a, b, c = req("0"), req("1"), req("2")
    step(tracer, sched, admit=[a, b], run=[(a, 4), (b, 4)])
    sched.running.remove(a)  # LLM.abort: the scheduler drops it, no finish event
    rec = step(tracer, sched, admit=[c], run=[(b, 1), (c, 4)])
    assert seats(rec) == {"1": 1, "2": 0}


def read_runs(path) -> list[tuple[dict, list[dict]]]:
    runs = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "run":
            runs.append((record, []))
        else:
            runs[-1][1].append(record)
    return runs


# 7 blocks force a preemption by decode growth; 6 no longer do, since admission reserves a
# request's whole sequence (vLLM's scheduler_reserve_full_isl) and so never over-admits.
@pytest.mark.parametrize("policy,num_kv_blocks", [("fcfs", 64), ("fcfs", 7), ("static", 64)])
def test_real_llm_run_agrees_with_its_trace(tmp_path, capsys, policy, num_kv_blocks):
    """A real short run on the tiny model: every record agrees with the requests' outputs,
    and the --trace text line shows the same budget and waiting count."""
    path = tmp_path / "run.jsonl"
    llm = LLM(tiny_model_dir(), max_num_seqs=3, max_num_batched_tokens=16, block_size=4,
              num_kv_blocks=num_kv_blocks, trace_file=str(path), trace=True,
              **({"batching": "static"} if policy == "static" else {"scheduling_policy": policy}))
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([13, 3, 9, 21, 5])]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (6, 2, 9, 4, 7)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    [(header, steps)] = read_runs(path)
    assert header == {"type": "run", "name": "static" if policy == "static" else "continuous",
                      "policy": "fcfs", "max_num_seqs": 3, "token_budget": 16,
                      "num_blocks": num_kv_blocks, "block_size": 4, "source": "engine"}
    assert [s["step"] for s in steps] == list(range(1, llm.num_steps + 1))
    text = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert len(text) == len(steps)
    for line, s in zip(text, steps):
        assert f"| budget {s['num_scheduled_tokens']}/16 | waiting {s['num_waiting']} |" in line
    computed = {o.request_id: [] for o in outputs}  # (start, end) ranges, in order
    finished, seat_of = {}, {}
    for s in steps:
        assert s["num_scheduled_tokens"] <= s["token_budget"] == 16
        work = [r for r in s["rows"] if r["role"] != "idle"]
        assert s["num_scheduled_tokens"] == sum(r["end"] - r["start"] for r in work)
        seats = [r["seat"] for r in s["rows"]]
        assert len(set(seats)) == len(seats) and all(0 <= k < 3 for k in seats)
        assert s["num_running"] <= 3 and 0 <= s["num_free_blocks"] <= s["num_blocks"]
        for p in s["preempted"]:  # recompute: the victim starts again from token 0
            computed[p["request"]].append("preempted")
            seat_of.pop(p["request"], None)
        for r in s["rows"]:
            assert seat_of.setdefault(r["request"], r["seat"]) == r["seat"]  # seat kept
            if r["role"] != "idle":
                computed[r["request"]].append((r["start"], r["end"]))
                one_output_token = r["end"] - r["start"] == 1 \
                    and r["start"] >= len(prompts[int(r["request"])])
                assert (r["role"] == "decode") == one_output_token
        for f in s["finished"]:
            finished[f["request"]] = f["reason"]
            seat_of.pop(f["request"])
    assert finished == {o.request_id: o.finish_reason for o in outputs}
    for o, prompt in zip(outputs, prompts):
        ranges = computed[o.request_id]
        last = ranges[len(ranges) - ranges[::-1].index("preempted"):] if "preempted" in ranges \
            else ranges  # the ranges of the last (successful) admission
        assert last[0][0] % 4 == 0  # 0, or whole blocks found in the prefix cache
        assert all(x[1] == y[0] for x, y in zip(last, last[1:]))  # contiguous
        assert last[-1][1] == len(prompt) + len(o.token_ids) - 1  # the last token is not fed
    if num_kv_blocks == 7:
        assert any(s["preempted"] for s in steps), "the small KV pool should force a preemption"
    if policy == "static":
        assert any(r["role"] == "idle" for s in steps for r in s["rows"])


def test_trace_to_starts_a_new_run_that_leaves_out_the_warm_up(tmp_path):
    llm = LLM(tiny_model_dir(), max_num_seqs=2, max_num_batched_tokens=16, block_size=4,
              num_kv_blocks=32)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # not traced
    path = tmp_path / "bench.jsonl"
    llm.trace_to(str(path), source="bench")
    llm.generate([[9, 10, 11, 12, 13]], SamplingParams(max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    [(header, steps)] = read_runs(path)
    assert header["source"] == "bench" and header["name"] == "continuous"
    assert [s["step"] for s in steps] == [1, 2, 3]  # the tracer's own steps, from 1
    assert [[(r["request"], r["seat"], r["role"]) for r in s["rows"]] for s in steps] == \
        [[("1", 0, "prefill")], [("1", 0, "decode")], [("1", 0, "decode")]]
