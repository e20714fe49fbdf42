"""Property-based tests (hypothesis) of the Scheduler + BlockManager on the FakeEngine.

Random workloads — prompt lengths 1..40 built from a few shared prefixes (so prefix caching
hits), outputs 1..30 tokens, 1..12 requests, priorities, arrivals between steps, aborts at
random steps — run under random engine settings: tiny KV pools, block sizes 1..8, token
budgets 1..64, max_num_seqs 1..8, fcfs/priority/static, chunked prefill and prefix caching
on/off.

After EVERY step the chapter's rules hold (`check_step`: nothing admitted in a step that
preempted, tokens scheduled <= token_budget, chunks <= long_prefill_token_threshold when
requests compete, running <= max_num_seqs) and the block accounting is exact
(`check_invariants`, including: every hashed block lies inside its request's computed
tokens). At the end every request that was not aborted has exactly the tokens
`expected_output` gives; the FakeRunner derives each token from the KV it reads back
through the block table, so no KV was lost, written to a wrong slot, reused stale or
skipped. All blocks are free, and the run took a bounded number of steps (no livelock).

Two deterministic tests check that prefix caching actually hits, and that a preempted
request resumes from its own cached blocks when they were not evicted.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.engine.block_manager import hash_block
from nanoserve.engine.request import FinishReason, RequestStatus
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.static_scheduler import StaticScheduler
from tests.common.fake_engine import FakeEngine, expected_output


def prefix_hash(token_ids: list[int], bs: int) -> bytes | None:
    """The chained hash of whole blocks of `token_ids`, computed afresh."""
    h = None
    for i in range(0, len(token_ids), bs):
        h = hash_block(h, token_ids[i:i + bs])
    return h


def check_invariants(sched: Scheduler) -> None:
    bm = sched.block_manager
    bs = bm.block_size
    # Conservation: every block is either free (ref_count 0, in the pool) or used.
    used = [b for b in bm.blocks if b.ref_count > 0]
    assert len(bm.free_blocks) + len(used) == bm.num_blocks
    for b in bm.blocks:
        assert b.ref_count >= 0
        assert (b.block_id in bm.free_blocks) == (b.ref_count == 0), b
    # ref_count == number of live requests holding the block: the running ones, and the
    # static scheduler's finished idle rows, which keep their blocks until the batch ends.
    idle = sched.idle_rows if isinstance(sched, StaticScheduler) else []
    for r in idle:
        assert r.status == RequestStatus.FINISHED
    owners: Counter[int] = Counter()
    for r in list(sched.running) + idle:
        assert len(set(r.block_table)) == len(r.block_table), "block twice in one table"
        owners.update(r.block_table)
    for b in bm.blocks:
        assert b.ref_count == owners[b.block_id], (b, owners[b.block_id])
    # Only a cached full prefix block may be shared, and it must hold exactly the tokens of
    # every request that uses it (otherwise one request would read another's KV).
    for block_id, n in owners.items():
        if n > 1:
            assert bm.enable_prefix_caching and bm.blocks[block_id].block_hash is not None
    for r in list(sched.running) + idle:
        assert r.status == RequestStatus.RUNNING or r in idle
        assert 0 <= r.num_computed_tokens <= r.num_tokens
        assert len(r.block_table) * bs >= r.num_computed_tokens, "computed tokens without KV"
        for i, block_id in enumerate(r.block_table):
            block = bm.blocks[block_id]
            if block.block_hash is not None:  # it names exactly this request's prefix
                assert block.block_hash == prefix_hash(r.token_ids[:(i + 1) * bs], bs)
                # §5: a hash promises computed KV: the block lies inside the computed tokens.
                assert (i + 1) * bs <= r.num_computed_tokens, f"{r.request_id}: block {i}"
        assert len(r.block_hashes) * bs <= r.num_computed_tokens
    for h, block_id in bm.cached_blocks.items():
        assert bm.blocks[block_id].block_hash == h
    # Waiting (new or preempted) requests hold nothing and remember no KV.
    running_ids = {id(r) for r in sched.running}
    for r in sched.waiting:
        assert id(r) not in running_ids
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.block_table == [] and r.num_computed_tokens == 0


def check_step(sched: Scheduler, out: SchedulerOutput, num_requests: int) -> None:
    """§6.2's rules for one schedule() step, as the chapter states them. `num_requests`:
    running or waiting when the step began (the chunk cap protects the others)."""
    config = sched.config
    assert out.token_budget == config.max_num_batched_tokens
    assert out.num_scheduled_tokens <= out.token_budget, "over the token budget"
    cap = (num_requests > 1 and config.long_prefill_token_threshold) or out.token_budget
    batch = [id(s.request) for s in out.scheduled]
    assert len(set(batch)) == len(batch), "a request twice in one step"
    for s in out.scheduled:
        assert 1 <= s.num_new_tokens <= cap, s
    assert not {id(r) for r in out.preempted} & set(batch), "a preempted request computes"
    seats = len(sched.running)
    if isinstance(sched, StaticScheduler):
        seats += len(sched.idle_rows)  # a finished row keeps its seat until the batch ends
    else:
        assert not (out.preempted and out.admitted), "admitted in a step that preempted"
    assert seats <= config.max_num_seqs, "more running requests than max_num_seqs"


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 8))
    prefixes = draw(st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=24),
                             min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        prefix = draw(st.sampled_from(prefixes))[:39]
        suffix = draw(st.lists(st.integers(0, 998), min_size=1, max_size=40 - len(prefix)))
        requests.append(dict(prompt=prefix + suffix, max_tokens=draw(st.integers(1, 30)),
                             priority=draw(st.integers(0, 3)), arrival=draw(st.integers(0, 15))))
    longest = max(len(r["prompt"]) for r in requests)
    # The pool must hold the longest prompt plus one token (LLM rejects anything else);
    # past that, tiny pools force preemption and the cache-capacity length cap.
    min_blocks = -(-(longest + 1) // block_size)
    num_kv_blocks = min_blocks + draw(st.integers(0, 12))
    max_model_len = draw(st.integers(longest + 1, 80))
    chunked = draw(st.booleans())
    if chunked:
        budget = draw(st.integers(1, 64))
    else:  # without chunking a whole prompt must fit in one step's budget
        budget = draw(st.integers(max_model_len, max_model_len + 64))
    config = dict(
        max_num_seqs=draw(st.integers(1, 8)), max_num_batched_tokens=budget,
        max_model_len=max_model_len, enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority", "static"])),
        # Without chunking a per-request chunk cap is a config error.
        long_prefill_token_threshold=draw(st.one_of(st.none(), st.integers(1, 16)))
        if chunked else None)
    aborts = draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, len(requests) - 1)),
                           max_size=3))
    return dict(block_size=block_size, num_kv_blocks=num_kv_blocks, config=config,
                requests=requests, aborts=aborts)


def run_workload(w: dict) -> FakeEngine:
    eng = FakeEngine(num_kv_blocks=w["num_kv_blocks"], block_size=w["block_size"],
                     **w["config"])
    sched = eng.scheduler
    reqs = w["requests"]
    total_tokens = sum(len(r["prompt"]) + r["max_tokens"] for r in reqs)
    max_steps = 50 * total_tokens + 100 + max(r["arrival"] for r in reqs)
    finished, aborted = {}, set()
    step = 0
    while step <= max(r["arrival"] for r in reqs) or sched.has_unfinished_requests():
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                # arrival_time = arrival order, so PRIORITY ties break deterministically
                eng.add(f"r{i}", r["prompt"], r["max_tokens"], r["priority"],
                        arrival_time=float(step * 100 + i))
        for at, i in w["aborts"]:
            got = None if at != step or f"r{i}" not in eng.requests else \
                sched.finish_request(f"r{i}", FinishReason.ABORT)
            if got is None:
                continue
            assert not got.block_table and got.request_id not in finished
            if got.finish_reason == FinishReason.ABORT:
                aborted.add(got.request_id)
            else:  # static: a row that finished, waiting for its batch, is handed out now
                finished[got.request_id] = got
        check_invariants(sched)
        if sched.has_unfinished_requests():
            num_requests = len(sched.running) + len(sched.waiting)
            for req in eng.step():
                assert req.request_id not in finished, "a request finished twice"
                finished[req.request_id] = req
            check_step(sched, eng.outputs[-1], num_requests)
            check_invariants(sched)
        step += 1
        assert step <= max_steps, f"no progress after {step} steps (livelock?)"

    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    if not w["config"]["enable_chunked_prefill"]:  # no chunk of any prompt, static included
        assert all(s.samples for out in eng.outputs for s in out.scheduled)
    for i, r in enumerate(reqs):
        req = eng.requests[f"r{i}"]
        # The scheduler caps a request at what the whole cache holds.
        n = min(r["max_tokens"], sched.max_model_len_in_cache - len(r["prompt"]))
        want = expected_output(r["prompt"], n)
        assert req.status == RequestStatus.FINISHED
        if f"r{i}" in aborted:
            assert req.finish_reason == FinishReason.ABORT
            assert req.output_token_ids == want[:req.num_output_tokens]
        else:
            assert finished[f"r{i}"] is req
            assert req.finish_reason == FinishReason.LENGTH  # the fake never emits EOS
            assert req.output_token_ids == want
    return eng


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_outputs(w):
    run_workload(w)


# -- deterministic: prefix caching really hits; preempted requests reuse their blocks ----


def test_shared_prefix_hits_the_cache():
    prefix = list(range(50, 66))  # 16 tokens = 4 full blocks of 4
    prompts = [prefix + [i, i + 1, i + 2] for i in range(4)]
    results = {}
    for caching in (True, False):
        eng = FakeEngine(num_kv_blocks=32, block_size=4, enable_prefix_caching=caching,
                         max_model_len=64)
        eng.add("first", prompts[0], max_tokens=5)
        eng.run()  # the first request computes (and, with caching, registers) the prefix
        for i, p in enumerate(prompts[1:]):
            eng.add(f"r{i}", p, max_tokens=5)
        eng.run()
        reqs = [eng.requests[f"r{i}"] for i in range(3)]
        for req, p in zip(reqs, prompts[1:]):
            assert req.output_token_ids == expected_output(p, 5)
        results[caching] = ([r.num_cached_tokens for r in reqs],
                            eng.scheduler.block_manager.prefix_cache_hits)
    assert results[True] == ([16, 16, 16], 48)
    assert results[False] == ([0, 0, 0], 0)  # the contrast: the test can tell the difference


def test_preempted_request_resumes_from_its_cached_blocks():
    """A and B (12-token prompts) fill an 8-block pool; when A needs a 5th block, B (the
    newest) is preempted. Its full blocks are hashed and go to the back of the free pool,
    A takes only one (B's tail), so when A finishes B re-enters with its 3 prompt blocks
    (12 tokens) found in the cache — the same block ids — and recomputes only the rest."""
    for caching in (True, False):
        eng = FakeEngine(num_kv_blocks=8, block_size=4, enable_prefix_caching=caching,
                         max_model_len=64)
        sched = eng.scheduler
        a = eng.add("A", list(range(100, 112)), max_tokens=6)
        b = eng.add("B", list(range(200, 212)), max_tokens=10)
        tables, resumed = [], None
        while sched.has_unfinished_requests():
            tables.append(list(b.block_table))
            out = sched.schedule()
            if b in out.preempted:
                table_before = tables[-1]
            if b in out.admitted and b.num_preemptions > 0:
                resumed = (b.num_computed_tokens, list(b.block_table))
            sched.update_from_output(out, eng.runner.execute_model(out))
            check_invariants(sched)
        assert b.num_preemptions == 1 and a.num_preemptions == 0
        assert a.output_token_ids == expected_output(list(range(100, 112)), 6)
        assert b.output_token_ids == expected_output(list(range(200, 212)), 10)
        if caching:
            assert resumed[0] == 12
            assert resumed[1][:3] == table_before[:3]  # the very same blocks, not copies
        else:
            assert resumed[0] == 0
