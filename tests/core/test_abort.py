"""Aborts and errors: requests that leave the engine early must not leak KV.

- `LLM.abort(request_id)` for waiting, running and preempted requests, through the real
  LLM (tiny random model) and through the Scheduler on the model-free FakeEngine (every
  policy, shared prefix blocks): the blocks come back, the next `step()` reports the
  request with finish_reason "abort", unknown/finished ids are a no-op returning False,
  and every other request still gets exactly its unperturbed output.
- An exception inside the model forward: through `generate()` (which aborts its own
  requests) and through a manual `add_request`/`step()` loop (which keeps them tracked,
  so later steps finish them). Either way no block stays with an untracked request.
"""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.request import FinishReason, RequestStatus
from tests.common.fake_engine import FakeEngine, expected_output
from tests.common.tiny_model import tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[10 + i, 200 + i, 3000 + i, 40 + i, 500 + i] for i in range(5)]


def small_llm(**config) -> LLM:
    """8 blocks of 4 tokens for requests of up to 17 tokens: three running requests
    cannot all fit, so preemption is certain."""
    config = {"num_kv_blocks": 8, "block_size": 4, "max_num_seqs": 3, "dtype": "float32", **config}
    return LLM(tiny_model_dir(), **config)


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs with a cache large enough that nothing is ever preempted."""
    llm = LLM(tiny_model_dir(), num_kv_blocks=64, block_size=4, dtype="float32")
    prompts = PROMPTS + [[7, 8, 9, 10, 11, 12, 13]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


def all_free(llm: LLM) -> bool:
    bm = llm.scheduler.block_manager
    return bm.num_free_blocks == bm.num_blocks


def status_of(llm: LLM, request_id: str) -> RequestStatus | None:
    for req in list(llm.scheduler.running) + list(llm.scheduler.waiting):
        if req.request_id == request_id:
            return req.status
    return None


# -- abort through the real LLM ---------------------------------------------------------


def test_abort_waiting_running_and_preempted_through_llm(reference):
    llm = small_llm()
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    prompt_of = dict(zip(ids, PROMPTS))
    outputs = {i: o for o in llm.step() for i in [o.request_id]}
    assert status_of(llm, ids[4]) == RequestStatus.WAITING  # max_num_seqs is 3

    def abort_and_check(request_id: str) -> None:
        """Abort now; the very next step() must report it, and its blocks are back."""
        used_before = llm.scheduler.block_manager.num_blocks - \
            llm.scheduler.block_manager.num_free_blocks
        req = next(r for r in list(llm.scheduler.running) + list(llm.scheduler.waiting)
                   if r.request_id == request_id)
        held = len(req.block_table)
        assert llm.abort(request_id) is True
        bm = llm.scheduler.block_manager
        assert bm.num_blocks - bm.num_free_blocks == used_before - held  # no sharing here
        assert status_of(llm, request_id) is None  # in no queue any more
        step_outputs = {o.request_id: o for o in llm.step()}
        assert step_outputs[request_id].finish_reason == "abort"
        # An aborted request keeps the tokens it had generated, and they are correct.
        got = step_outputs[request_id].token_ids
        assert got == reference[tuple(prompt_of[request_id])][:len(got)]
        outputs.update(step_outputs)

    abort_and_check(ids[4])  # waiting, never scheduled

    # Step until someone is preempted (certain with this pool), then abort it.
    preempted = None
    while preempted is None:
        outputs.update((o.request_id, o) for o in llm.step())
        preempted = next((r.request_id for r in llm.scheduler.waiting
                          if r.status == RequestStatus.PREEMPTED), None)
    abort_and_check(preempted)

    running = next(r for r in llm.scheduler.running if r.request_id != ids[0])
    assert running.block_table and running.num_output_tokens > 0
    abort_and_check(running.request_id)

    while llm.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.step())
    aborted = {ids[4], preempted, running.request_id}
    assert {i for i in ids if outputs[i].finish_reason == "abort"} == aborted
    for i in set(ids) - aborted:  # the survivors are untouched by the aborts
        assert outputs[i].finish_reason == "length"
        assert outputs[i].token_ids == reference[tuple(prompt_of[i])]
    assert all_free(llm)

    # Unknown, finished and already aborted ids: no-op, False, and no output later.
    for request_id in ["no-such-id", ids[0], preempted]:
        assert llm.abort(request_id) is False
    assert llm.step() == [] and not llm.has_unfinished_requests()


def test_abort_before_any_step_and_twice():
    llm = small_llm()
    a = llm.add_request(PROMPTS[0], GREEDY)
    assert llm.abort(a) is True and llm.abort(a) is False
    assert llm.has_unfinished_requests()  # the abort output is still to be handed out
    [out] = llm.step()
    assert (out.request_id, out.finish_reason, out.token_ids) == (a, "abort", [])
    assert not llm.has_unfinished_requests() and all_free(llm)


# -- abort on the FakeEngine (every policy, shared prefixes) ----------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority", "static"])
def test_abort_every_state_on_fake_engine(policy):
    """Five requests share a 12-token prefix (3 full blocks, cached and shared), in a
    pool too small for all of them: abort one waiting, one preempted, one running."""
    eng = FakeEngine(num_kv_blocks=14, block_size=4, max_num_seqs=3, scheduling_policy=policy,
                     max_model_len=64, max_num_batched_tokens=16)
    prefix = list(range(100, 112))
    prompts = {f"r{i}": prefix + [i, i + 1] for i in range(5)}
    for i, (rid, p) in enumerate(prompts.items()):
        eng.add(rid, p, max_tokens=20, priority=i % 2)
    sched, bm = eng.scheduler, eng.scheduler.block_manager

    def by_status(status):
        return [r for r in list(sched.running) + list(sched.waiting) if r.status == status]

    done = {}
    aborted = set()
    targets = ["waiting", "preempted", "running"]  # abort one of each, in this order
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            break
        groups = {"waiting": by_status(RequestStatus.WAITING),
                  "preempted": by_status(RequestStatus.PREEMPTED),
                  "running": [r for r in sched.running if not r.is_finished]}
        if targets and groups[targets[0]]:
            victim = groups[targets.pop(0)][-1]
            refs = [bm.blocks[b].ref_count for b in victim.block_table]
            shared = [b for b, n in zip(victim.block_table, refs) if n > 1]
            free_before = bm.num_free_blocks
            assert sched.finish_request(victim.request_id, FinishReason.ABORT) is victim
            assert victim.finish_reason.value == "abort" and not victim.block_table
            # Its own blocks come back; shared prefix blocks only lose one reference.
            assert bm.num_free_blocks == free_before + len(refs) - len(shared)
            assert all(bm.blocks[b].ref_count >= 1 for b in shared)
            aborted.add(victim.request_id)
        done.update((r.request_id, r) for r in eng.step())
    assert not sched.has_unfinished_requests()
    assert not targets, f"the workload never reached: {targets}"
    assert sched.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks
    for rid, p in prompts.items():
        if rid not in aborted:
            assert done[rid].output_token_ids == expected_output(p, 20)
    for rid in prompts:  # everything has left: every abort is now a no-op
        assert sched.finish_request(rid, FinishReason.ABORT) is None


# -- an exception inside the model forward ----------------------------------------------


def fail_once(llm: LLM, monkeypatch, at_call: int) -> dict:
    """Make the step's forward raise on its `at_call`-th call (1-based), once: the runner's,
    which every step goes through (a fast path's decode step does not call the model's)."""
    runner = llm.model_runner
    real = runner.execute_model
    state = {"calls": 0, "raised": False}

    def forward(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == at_call:
            state["raised"] = True
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute_model", forward)
    return state


def test_forward_error_in_generate_frees_its_requests(reference, monkeypatch):
    llm = small_llm()
    # A request added by hand before generate(): not generate's to abort.
    other = llm.add_request(PROMPTS[4], GREEDY)
    state = fail_once(llm, monkeypatch, at_call=4)  # mid-way: blocks held, prefixes cached
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert state["raised"]
    sched = llm.scheduler
    tracked = [r.request_id for r in list(sched.running) + list(sched.waiting)]
    assert tracked == [other], "generate() must abort its own requests, and only those"
    bm = sched.block_manager
    held = {b for r in sched.running for b in r.block_table}
    assert bm.num_blocks - bm.num_free_blocks == len(held), "blocks held by untracked requests"

    # The engine is consistent: the survivor finishes, and generate works again.
    outputs = {}
    while llm.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.step())
    assert outputs[other].token_ids == reference[tuple(PROMPTS[4])]
    assert all_free(llm)
    again = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == [reference[tuple(p)] for p in PROMPTS[:3]]
    assert all_free(llm)


@pytest.mark.parametrize("at_call", [1, 3, 6])
def test_forward_error_in_step_keeps_requests_consistent(reference, monkeypatch, at_call):
    """step() leaves its scheduled requests tracked; the next steps redo the failed step
    (nothing was advanced) and finish every request with the right output."""
    llm = small_llm()
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    state = fail_once(llm, monkeypatch, at_call)
    outputs, errors = {}, 0
    while llm.has_unfinished_requests():
        try:
            outputs.update((o.request_id, o) for o in llm.step())
        except RuntimeError as e:
            assert "injected" in str(e)
            errors += 1
            sched, bm = llm.scheduler, llm.scheduler.block_manager
            held = {b for r in sched.running for b in r.block_table}
            # Every used block belongs to a request the scheduler still tracks.
            assert bm.num_blocks - bm.num_free_blocks == len(held)
            assert all(r.num_computed_tokens <= r.num_tokens for r in sched.running)
    assert state["raised"] and errors == 1
    for rid, p in zip(ids, PROMPTS):
        assert outputs[rid].finish_reason == "length"
        assert outputs[rid].token_ids == reference[tuple(p)]
    assert all_free(llm)


def test_forward_error_in_generate_static_policy_frees_finished_rows(monkeypatch):
    """Static policy: a request that finished keeps its blocks (an idle row) until its whole
    batch is done. If generate() fails in between, that request is generate's too, and must
    not stay behind holding blocks."""
    llm = small_llm(batching="static", num_kv_blocks=16)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    fail_once(llm, monkeypatch, at_call=4)  # the short request finished at call 2
    with pytest.raises(RuntimeError, match="injected forward failure"):
        llm.generate(PROMPTS[:2], [short, GREEDY], use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert all_free(llm)
    assert llm.step() == []  # nothing of the failed generate() comes out later


def test_abort_finished_static_row_before_its_batch_ends():
    """A static row that finished (with "length") but whose output is not out yet (its
    batch is still running) did finish: abort() is the documented no-op (False), its
    result is not rewritten, and its blocks come back when the batch drains (no leak)."""
    llm = small_llm(batching="static", num_kv_blocks=16)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    a = llm.add_request(PROMPTS[0], short)
    b = llm.add_request(PROMPTS[1], GREEDY)
    while not llm.scheduler.idle_rows:
        assert llm.step() == []
    held = llm.scheduler.idle_rows[0].block_table
    free_before = llm.scheduler.block_manager.num_free_blocks
    assert held and llm.abort(a) is False
    assert llm.scheduler.block_manager.num_free_blocks == free_before  # still its batch's
    outputs = {}
    while llm.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.step())
    assert outputs[a].finish_reason == "length" and len(outputs[a].token_ids) == 2
    assert outputs[b].finish_reason == "length" and len(outputs[b].token_ids) == 12
    assert all_free(llm)


def test_generate_keeps_outputs_of_requests_added_before_it(reference):
    llm = small_llm()
    prompts = list(reference)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    early = llm.add_request(list(prompts[0]), short)  # finishes while generate() runs
    outputs = llm.generate([list(prompts[1])], GREEDY, use_tqdm=False)
    assert outputs[0].token_ids == reference[prompts[1]]
    stray = []
    while llm.has_unfinished_requests():  # the early request's output is not lost
        stray += llm.step()
    assert [o.request_id for o in stray] == [early]
    assert stray[0].token_ids == reference[prompts[0]][:3]
    assert all_free(llm)
