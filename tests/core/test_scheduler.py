"""§5–§6 unit tests with a fake model runner: block accounting, the order of decisions in
one schedule step, the victims FCFS and PRIORITY pick, static batching's idle rows, and
prefix caching's hashing, verification and eviction order."""

from __future__ import annotations

import hashlib
from array import array

import pytest

from nanoserve.engine.block_manager import BlockManager, hash_block
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.sampling_params import SamplingParams
from tests.common.fake_engine import FakeEngine, expected_output


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    """request_id -> number of new tokens, in scheduling order."""
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def assert_no_leak(engine: FakeEngine) -> None:
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_all_requests_finish_with_their_tokens_and_no_leak():
    engine = FakeEngine(num_kv_blocks=16, block_size=4, max_num_batched_tokens=8)
    prompts = {f"r{i}": list(range(1 + i, 6 + 3 * i)) for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add(rid, prompt, max_tokens=5 + i if (i := int(rid[1:])) else 5)
    finished = engine.run()
    assert len(finished) == 6
    for req in finished:
        assert req.output_token_ids == expected_output(prompts[req.request_id],
                                                       req.sampling_params.max_tokens)
    assert_no_leak(engine)


def test_running_first_then_admission_within_budget():
    engine = FakeEngine(max_num_batched_tokens=10, max_num_seqs=8)
    engine.add("a", [1] * 6, max_tokens=3)
    engine.add("b", [2] * 6, max_tokens=3)
    out = engine.scheduler.schedule()
    # a takes 6 tokens; b gets the 4 left: its prefill is chunked and mixes with a's.
    assert list(scheduled(out)) == ["a", "b"]
    assert scheduled(out) == {"a": 6, "b": 4}
    assert out.num_scheduled_tokens == 10 == out.token_budget
    assert [s.samples for s in out.scheduled] == [True, False]
    engine.scheduler.update_from_output(out, {"a": 7})
    out = engine.scheduler.schedule()
    # Step 2: a decodes (1 token) and b finishes its prefill (2 tokens), in one batch.
    assert scheduled(out) == {"a": 1, "b": 2}


def test_max_num_seqs_caps_running():
    engine = FakeEngine(max_num_seqs=2)
    for i in range(4):
        engine.add(f"r{i}", [i + 1] * 3, max_tokens=4)
    out = engine.scheduler.schedule()
    assert len(out.scheduled) == 2 and len(engine.scheduler.waiting) == 2
    engine.run()
    assert_no_leak(engine)


def fill_running(engine: FakeEngine, priorities: list[int]) -> None:
    """Admit one request per priority, each owning exactly one full block."""
    for i, priority in enumerate(priorities):
        engine.add(f"r{i}", [i + 1] * 3, max_tokens=10, priority=priority, arrival_time=float(i))
    engine.step()  # prefill 3 tokens each and sample a 4th
    engine.step()  # compute the 4th: one full block each; the 5th needs a new block


def test_fcfs_preempts_the_last_running_request():
    engine = FakeEngine(num_kv_blocks=4, block_size=4, max_num_seqs=4)
    fill_running(engine, [0, 0, 0, 0])
    out = engine.scheduler.schedule()  # every request needs a 2nd block; none is free
    assert [r.request_id for r in out.preempted] == ["r3", "r2"]
    assert list(scheduled(out)) == ["r0", "r1"]
    # §6.3: preempted requests forget their KV and wait at the front, latest-preempted first.
    waiting = list(engine.scheduler.waiting)
    assert [r.request_id for r in waiting] == ["r2", "r3"]
    assert all(r.num_computed_tokens == 0 and r.status == RequestStatus.PREEMPTED
               for r in waiting)


def test_priority_preempts_the_largest_priority_then_latest_arrival():
    engine = FakeEngine(num_kv_blocks=4, block_size=4, max_num_seqs=4,
                        scheduling_policy="priority")
    fill_running(engine, [1, 5, 0, 5])  # r1 and r3 are least important; r3 arrived last
    out = engine.scheduler.schedule()
    assert [r.request_id for r in out.preempted] == ["r3", "r1"]
    assert sorted(scheduled(out)) == ["r0", "r2"]


def test_priority_victim_already_scheduled_gives_its_budget_back():
    engine = FakeEngine(num_kv_blocks=3, block_size=4, scheduling_policy="priority")
    engine.add("low", [1] * 3, max_tokens=8, priority=9, arrival_time=0.0)
    engine.add("high", [2] * 3, max_tokens=10, priority=0, arrival_time=1.0)
    engine.step()
    engine.step()  # both hold one full block; one block is left
    out = engine.scheduler.schedule()
    # "low" runs first and takes the last block; "high" then needs one, and the victim
    # is "low", although it was already scheduled: it leaves the batch and the budget.
    assert [r.request_id for r in out.preempted] == ["low"]
    assert scheduled(out) == {"high": 1}
    engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
    engine.run()
    assert engine.requests["low"].output_token_ids == expected_output([1] * 3, 8)
    assert_no_leak(engine)


def test_priority_self_preemption_ends_the_running_loop():
    """§6.2 (`if blocks is None: break`), as in vLLM V1: 2 blocks, running = [low, high],
    each holding one full block. "low" needs a 2nd block; the least important request is
    "low" itself, so it evicts itself, and the running loop stops there: "high" does not
    run in that step. (nanoserve before this rule went on and ran "high" in the same step
    with the block "low" gave back.)"""
    engine = FakeEngine(num_kv_blocks=2, block_size=4, scheduling_policy="priority")
    low = engine.add("low", [1] * 3, max_tokens=5, priority=9, arrival_time=0.0)
    engine.step()  # low: prefill
    high = engine.add("high", [2] * 3, max_tokens=5, priority=0, arrival_time=1.0)
    engine.step()  # low decodes (its 4th token fills its block); high is admitted
    assert list(engine.scheduler.running) == [low, high]
    out = engine.scheduler.schedule()
    assert out.preempted == [low]
    assert scheduled(out) == {}  # the old loop gave {"high": 1} here
    assert out.is_empty
    engine.scheduler.update_from_output(out, {})
    out = engine.scheduler.schedule()  # the next step: high runs, low waits for room
    assert scheduled(out) == {"high": 1} and not out.admitted
    engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
    engine.run()
    assert low.output_token_ids == expected_output([1] * 3, 5)
    assert high.output_token_ids == expected_output([2] * 3, 5)
    assert_no_leak(engine)


def test_prefix_lookup_is_counted_once_at_admission():
    """A request that waits for room is looked up every step but counted once."""
    engine = FakeEngine(num_kv_blocks=3, block_size=4)
    engine.add("a", list(range(8)), max_tokens=2)
    b = engine.add("b", list(range(8)) + [9, 9, 9], max_tokens=1)  # needs 3 blocks
    engine.run()
    assert [b in out.admitted for out in engine.outputs] == [False, False, True]
    bm = engine.scheduler.block_manager
    assert bm.prefix_cache_queries == 8 + 11  # not 8 + 3 * 11: b was looked up 3 times
    assert bm.prefix_cache_hits == 8 == b.num_cached_tokens  # a's two full blocks


def test_a_request_that_needs_the_whole_cache_preempts_itself_and_finishes():
    engine = FakeEngine(num_kv_blocks=3, block_size=4)
    engine.add("a", [1] * 5, max_tokens=20)  # capped at 12 tokens = the whole cache
    engine.add("b", [2] * 5, max_tokens=4)
    finished = engine.run()
    a = next(r for r in finished if r.request_id == "a")
    assert a.num_tokens == 12 and a.finish_reason.value == "length"
    assert_no_leak(engine)


def test_static_policy_keeps_idle_rows_until_the_batch_drains():
    engine = FakeEngine(scheduling_policy="static", max_num_seqs=2)
    engine.add("short", [1, 2], max_tokens=2)
    engine.add("long", [3, 4], max_tokens=6)
    engine.add("next", [5, 6], max_tokens=2)
    finished_at = {}
    for step in range(20):
        for req in engine.step():
            finished_at[req.request_id] = step
        if not engine.scheduler.has_unfinished_requests():
            break
    idle = [len(out.idle_rows) for out in engine.outputs]
    assert sum(idle) == 4  # "short" idles while "long" makes its last 4 tokens
    assert finished_at["short"] == finished_at["long"]  # the batch leaves together
    assert finished_at["next"] > finished_at["long"]  # and only then is "next" admitted
    assert engine.requests["short"].output_token_ids == expected_output([1, 2], 2)
    assert_no_leak(engine)


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1))


def test_prefix_cache_hit_needs_computed_full_blocks_and_recomputes_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(8)))
    assert bm.get_computed_blocks(a) == ([], 0) and bm.allocate_slots(a, 8)
    b = make_request("b", list(range(8)))
    assert bm.get_computed_blocks(b) == ([], 0)  # a's KV is not computed yet: no promise
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    # Fully cached 8-token prompt: only the first block is reused, the last token recomputes.
    assert bm.get_computed_blocks(b) == (a.block_table[:1], 4)
    c = make_request("c", list(range(4)) + [9, 9, 9, 9, 9])
    assert bm.get_computed_blocks(c) == (a.block_table[:1], 4)


def test_freed_cached_blocks_are_reused_until_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_request("a", [1, 2, 3]), make_request("b", [5, 6, 7])
    for req in (a, b):
        bm.allocate_slots(req, 3)
        req.num_computed_tokens = 3
        bm.cache_full_blocks(req)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4
    # The two non-full tail blocks are taken first, then a's block (freed before b's).
    d = make_request("d", [8] * 6)
    bm.allocate_slots(d, 6)
    assert bm.get_computed_blocks(make_request("a2", [1, 2, 3])) == ([], 0)
    assert bm.get_computed_blocks(make_request("b2", [5, 6, 7]))[1] == 2


def test_block_hashes_are_chained_sha256():
    """vLLM's since CVE-2025-25183: a block's hash covers its parent's (so it names the whole
    prefix), and no prompt can be crafted whose prefix collides with another's."""
    first = hash_block(None, [1, 2])
    assert first == hashlib.sha256(array("q", [1, 2]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", [3, 4]).tobytes()).digest()
    assert hash_block(first, [3, 4]) == second
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [9, 9, 7, 7, 5])
    for req in (a, b):
        bm.allocate_slots(req, 5)
        req.num_computed_tokens = 5
        bm.cache_full_blocks(req)
    assert bm.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5])) == (a.block_table[:2], 4)
    # [3, 4] is cached, but after [1, 2]: after [9, 9] it is another prefix, a miss.
    assert bm.get_computed_blocks(make_request("d", [9, 9, 3, 4, 5])) == (b.block_table[:1], 2)


# -- §6.2: "only if nothing was preempted", in steps where admission WOULD fit ---------


def test_priority_no_admission_in_a_step_that_preempted_although_blocks_are_free():
    """3 blocks of 4. A (priority 0) holds 1 block, B (priority 1) 2. C (priority 0, one
    token) arrives. A needs a 2nd block: B is the victim and frees 2, A takes 1, so 1 block
    is free and C (first in waiting, ahead of B) would fit: §6.2 still admits nobody."""
    engine = FakeEngine(num_kv_blocks=3, block_size=4, scheduling_policy="priority")
    a = engine.add("A", [1] * 3, max_tokens=6, priority=0, arrival_time=0.0)
    b = engine.add("B", [2] * 5, max_tokens=6, priority=1, arrival_time=1.0)
    engine.step()
    engine.step()  # A: 5 tokens, 4 computed (1 full block); B: 7 tokens in 2 blocks
    c = engine.add("C", [3], max_tokens=2, priority=0, arrival_time=2.0)
    out = engine.scheduler.schedule()
    assert out.preempted == [b] and scheduled(out) == {"A": 1}
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == 1 and engine.scheduler.waiting.peek() is c
    assert out.admitted == [] and c.status == RequestStatus.WAITING
    engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
    out = engine.scheduler.schedule()
    assert out.admitted == [c]  # the next step, without a preemption, admits it
    engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
    engine.run()
    for req, prompt in ((a, [1] * 3), (b, [2] * 5), (c, [3])):
        assert req.output_token_ids == expected_output(prompt, req.sampling_params.max_tokens)
    assert_no_leak(engine)


def test_fcfs_self_preempted_request_is_not_readmitted_in_the_same_step():
    """FCFS puts the victim at the front of waiting, so the candidate for admission is the
    victim itself. 3 blocks of 4, budget 4, no prefix cache: B evicts itself while 1 block
    is free, and a 3-token chunk of B (1 block) would fit the 3 tokens of budget left."""
    engine = FakeEngine(num_kv_blocks=3, block_size=4, max_num_batched_tokens=4,
                        enable_prefix_caching=False)
    engine.add("A", [1] * 3, max_tokens=6)
    b = engine.add("B", [2] * 5, max_tokens=4)
    engine.step()  # A: 3 tokens (samples); B: a 1-token chunk
    engine.step()  # A: 1; B: 3 more (4 of 5 computed, 1 block)
    out = engine.scheduler.schedule()  # A takes the free block; B needs one: none left
    assert out.preempted == [b] and scheduled(out) == {"A": 1}
    assert engine.scheduler.block_manager.num_free_blocks == 1
    assert out.admitted == [] and b.status == RequestStatus.PREEMPTED
    engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
    engine.run()
    assert b.output_token_ids == expected_output([2] * 5, 4)
    assert_no_leak(engine)


def test_priority_victim_refunds_its_budget_to_the_requests_after_it():
    """running = [low, high, x]. "low" is scheduled first (taking the last block), then
    evicted by "high": its token goes back to the step's budget, so "x", later in running,
    still runs. With a budget of 2, low's token, if not refunded, would leave x nothing."""
    engine = FakeEngine(num_kv_blocks=4, block_size=4, scheduling_policy="priority")
    low = engine.add("low", [1] * 3, max_tokens=8, priority=9, arrival_time=0.0)
    engine.step()
    engine.add("high", [2] * 4, max_tokens=8, priority=0, arrival_time=1.0)
    engine.add("x", [3], max_tokens=8, priority=0, arrival_time=2.0)
    engine.step()  # low and high: one full block each, x: 2 tokens in one block; 1 free
    engine.scheduler.config.max_num_batched_tokens = 2
    out = engine.scheduler.schedule()
    assert out.preempted == [low]
    assert scheduled(out) == {"high": 1, "x": 1}
    engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
    engine.run()
    assert low.output_token_ids == expected_output([1] * 3, 8)
    assert_no_leak(engine)


def test_a_partly_computed_chunk_registers_only_its_computed_full_blocks():
    """A 12-token prompt is computed in chunks. After 6 tokens its 2nd block is full of
    known (prompt) tokens but only half computed: it must not be hashed, or a request with
    the same prefix would read KV that was never written (§5)."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(12)))
    assert bm.allocate_slots(a, 6) and len(a.block_table) == 2
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 1
    assert bm.blocks[a.block_table[0]].block_hash is not None
    assert bm.blocks[a.block_table[1]].block_hash is None  # positions 6, 7 not computed
    assert bm.get_computed_blocks(make_request("b", list(range(12)))) == (a.block_table[:1], 4)
    assert bm.allocate_slots(a, 6)  # the rest of the prompt
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 3
    assert bm.get_computed_blocks(make_request("c", list(range(13)))) == (a.block_table, 12)


def test_hash_is_chained_from_the_parent_block():
    """Equal tokens after different prefixes are different KV (§5). b = [9,9,9,9][5,6,7,8]
    is cached first, then a = [1,2,3,4][5,6,7,8]: a request with a's prefix must get a's
    2nd block, not b's (same tokens, computed after another prefix)."""
    bm = BlockManager(num_blocks=8, block_size=4)
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    for req in (b, a):
        bm.allocate_slots(req, 9)
        req.num_computed_tokens = 9
        bm.cache_full_blocks(req)
    hits = bm.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert hits == (a.block_table[:2], 8)


def test_eviction_keeps_prefixes_as_long_as_possible():
    """§5's eviction order: a freed block with nothing reusable is taken before any cached
    block, even if freed later; among one request's cached blocks the tail goes first, so
    the prefix (the head, which every hit needs) survives longest."""
    bm = BlockManager(num_blocks=3, block_size=2)
    b, c = make_request("b", [1, 2, 3, 4]), make_request("c", [7])
    for req in (b, c):
        bm.allocate_slots(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        bm.cache_full_blocks(req)  # b: 2 cached blocks; c: a partial block, not cached
    bm.free(b)
    bm.free(c)
    lookup = make_request("b2", [1, 2, 3, 4, 5])
    assert bm.get_computed_blocks(lookup)[1] == 4
    assert bm.allocate_slots(make_request("d", [8]), 1)  # takes c's empty block
    assert bm.get_computed_blocks(lookup)[1] == 4
    assert bm.allocate_slots(make_request("e", [9]), 1)  # must evict: b's tail, not head
    assert bm.get_computed_blocks(lookup)[1] == 2


@pytest.mark.parametrize("policy", ["fcfs", "priority", "static"])
def test_no_chunked_prefill_means_no_chunk_in_any_policy(policy):
    """enable_chunked_prefill=False: every prompt is computed in one step. A static batch
    is admitted whole, so its prefills used to be cut by the budget anyway (30, 30, 4)."""
    engine = FakeEngine(num_kv_blocks=64, block_size=4, scheduling_policy=policy,
                        enable_chunked_prefill=False, max_num_batched_tokens=64,
                        max_model_len=64, max_num_seqs=4)
    prompts = {str(i): list(range(i, i + 30)) for i in range(3)}
    for rid, prompt in prompts.items():
        engine.add(rid, prompt, max_tokens=3)
    done = {r.request_id: r for r in engine.run()}
    assert all(s.samples for out in engine.outputs for s in out.scheduled)
    for rid, prompt in prompts.items():
        assert done[rid].output_token_ids == expected_output(prompt, 3)
