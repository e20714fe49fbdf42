"""§5–§6: rules where nanoserve follows vLLM 0.32's V1 scheduler and BlockPool to the letter
(issue 28): admission reserves the whole sequence, long_prefill_token_threshold caps only
competing prefills, resumptions' prefix lookups are counted apart, the free-block order, and
PRIORITY ties broken by arrival. Model-free: the FakeEngine and the BlockManager alone."""

from __future__ import annotations

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.sampling_params import SamplingParams
from tests.common.fake_engine import FakeEngine, expected_output


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def assert_no_leak(engine: FakeEngine) -> None:
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


# -- rule 1: admission reserves the blocks of the whole current sequence ------------------


def test_admission_reserves_the_whole_prompt_not_only_its_first_chunk():
    """3 blocks of 4. A's 8-token prompt takes 2; 1 block and 4 tokens of budget are left.
    B's 9-token prompt would fit a 4-token first chunk, but its whole sequence needs 3
    blocks: it stays waiting (vLLM's scheduler_reserve_full_isl=True)."""
    engine = FakeEngine(num_kv_blocks=3, block_size=4, max_num_batched_tokens=12)
    engine.add("A", list(range(8)), max_tokens=2)
    b = engine.add("B", list(range(10, 19)), max_tokens=2)
    out = engine.scheduler.schedule()
    assert scheduled(out) == {"A": 8}
    assert list(engine.scheduler.waiting) == [b] and b.status == RequestStatus.WAITING
    engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
    engine.run()
    assert b.output_token_ids == expected_output(list(range(10, 19)), 2)
    assert b.num_preemptions == 0
    assert_no_leak(engine)


def test_a_preempted_request_waits_until_its_prompt_and_outputs_fit():
    """A and B (3-token prompts) share 3 blocks of 4; B is preempted holding 5 tokens
    (prompt + 2 generated). One block is free afterwards: a 3-token chunk of B would fit,
    its 5 tokens (2 blocks) do not, so B is not readmitted until A has left."""
    engine = FakeEngine(num_kv_blocks=3, block_size=4, max_num_batched_tokens=4,
                        enable_prefix_caching=False)
    a = engine.add("A", [1] * 3, max_tokens=8)
    b = engine.add("B", [2] * 3, max_tokens=8)
    while b.status != RequestStatus.PREEMPTED:
        engine.step()
    bm = engine.scheduler.block_manager
    assert b.num_tokens == 5 and bm.num_free_blocks == 1
    readmitted_while_a_ran = False
    while engine.scheduler.has_unfinished_requests():
        a_running = a.status == RequestStatus.RUNNING
        engine.step()
        readmitted_while_a_ran |= a_running and b in engine.outputs[-1].admitted
    assert not readmitted_while_a_ran, "B was readmitted with room for a chunk, not its 5 tokens"
    assert b.num_preemptions == 1  # readmitted once, with room for all it holds
    assert a.output_token_ids == expected_output([1] * 3, 8)
    assert b.output_token_ids == expected_output([2] * 3, 8)
    assert_no_leak(engine)


# -- rule 2: long_prefill_token_threshold caps a prefill only when requests compete -------


def test_long_prefill_threshold_does_not_cap_a_request_alone():
    engine = FakeEngine(long_prefill_token_threshold=4)
    engine.add("A", list(range(10)), max_tokens=2)
    assert scheduled(engine.scheduler.schedule()) == {"A": 10}


def test_long_prefill_threshold_caps_while_another_request_waits():
    engine = FakeEngine(long_prefill_token_threshold=4, max_num_seqs=1)
    engine.add("A", list(range(10)), max_tokens=2)
    engine.add("B", [7, 8], max_tokens=1)  # waits: max_num_seqs=1, but it competes
    assert scheduled(engine.scheduler.schedule()) == {"A": 4}


def test_long_prefill_threshold_stops_capping_once_the_other_request_left():
    """A (10 tokens) and B (2 tokens, 1 output) compete in step 1: A is capped at 4. B
    finishes in step 1; in step 2 A is the only request left and takes its 6 tokens."""
    engine = FakeEngine(long_prefill_token_threshold=4)
    a = engine.add("A", list(range(10)), max_tokens=2)
    engine.add("B", [7, 8], max_tokens=1)
    engine.step()
    assert scheduled(engine.outputs[-1]) == {"A": 4, "B": 2}
    engine.step()
    assert scheduled(engine.outputs[-1]) == {"A": 6}
    engine.run()
    assert a.output_token_ids == expected_output(list(range(10)), 2)
    assert_no_leak(engine)


# -- rule 3: a resumption's prefix lookup is counted apart (vLLM's preempted_* counters) --


def test_prefix_cache_hit_rate_counts_first_admissions_only_resumptions_apart():
    """A and B (12-token prompts) fill 8 blocks; B is preempted once and resumes from its
    own 3 cached prompt blocks. Those 12 hit tokens are B's own recompute, not reuse: they
    go to preempted_queries / preempted_hits, and the hit rate stays that of first
    admissions (none of which hit)."""
    engine = FakeEngine(num_kv_blocks=8, block_size=4, max_model_len=64)
    engine.add("A", list(range(100, 112)), max_tokens=6)
    b = engine.add("B", list(range(200, 212)), max_tokens=10)
    engine.run()
    bm = engine.scheduler.block_manager
    assert b.num_preemptions == 1
    assert bm.prefix_cache_hit_rate == 0.0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (12 + 12, 0)
    assert bm.preempted_hits == 12 and bm.preempted_queries >= 12
    assert b.num_cached_tokens == 0  # the first admission's hit, as before


# -- rule 4: the free-block order of vLLM's BlockPool.free_blocks -------------------------


def test_free_puts_unhashed_blocks_at_the_head_tail_first_and_cached_ones_last():
    """A 4-block request, its first 2 blocks full, computed and cached, its last 2 not.
    Freed, its blocks go tail first: the unhashed run [3, 2] to the head of the free queue
    (reused first, the tail before the block before it), the cached [1, 0] to the back
    (evicted last, the prefix head after its tail)."""
    bm = BlockManager(num_blocks=6, block_size=4)
    req = Request("r", list(range(14)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(req, 14)
    assert req.block_table == [0, 1, 2, 3]
    req.num_computed_tokens = 8
    bm.cache_full_blocks(req)
    bm.free(req)
    assert list(bm.free_blocks) == [3, 2, 4, 5, 1, 0]


def test_free_of_an_uncached_request_leaves_its_blocks_reversed_at_the_head():
    """A 4-block request freed before any of its KV was computed: no block has a hash."""
    bm = BlockManager(num_blocks=6, block_size=4)
    req = Request("r", list(range(16)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(req, 16)
    bm.free(req)
    assert list(bm.free_blocks) == [3, 2, 1, 0, 4, 5]
    nxt = Request("s", [1], SamplingParams(max_tokens=1))
    assert bm.allocate_slots(nxt, 1) and nxt.block_table == [3]  # the tail is reused first


# -- rule 5: PRIORITY ties go by arrival time ---------------------------------------------


def test_priority_ties_go_by_arrival_a_preempted_request_before_later_arrivals():
    """Three requests of one priority, arrivals 0, 1, 2; max_num_seqs=2 keeps C waiting.
    When A needs a block, B is preempted: it arrived before C, so it waits ahead of C and
    is readmitted first."""
    engine = FakeEngine(num_kv_blocks=2, block_size=4, max_num_seqs=2,
                        scheduling_policy="priority")
    a = engine.add("A", [1] * 3, max_tokens=5, priority=0, arrival_time=0.0)
    b = engine.add("B", [2] * 3, max_tokens=5, priority=0, arrival_time=1.0)
    c = engine.add("C", [3] * 3, max_tokens=5, priority=0, arrival_time=2.0)
    engine.step()
    engine.step()  # A and B each hold one full block; C waits (max_num_seqs)
    out = engine.scheduler.schedule()
    assert out.preempted == [b]
    assert [r.request_id for r in engine.scheduler.waiting] == ["B", "C"]
    engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
    engine.run()
    first_admitted = [out.admitted for out in engine.outputs if out.admitted][1:]
    assert first_admitted[0] == [b]
    for req, prompt in ((a, [1] * 3), (b, [2] * 3), (c, [3] * 3)):
        assert req.output_token_ids == expected_output(prompt, 5)
    assert_no_leak(engine)
