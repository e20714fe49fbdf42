"""Stress test: hundreds of requests through a tiny KV pool on the real model.

Requests arrive in waves between steps into a pool of a few dozen blocks, so the engine
keeps preempting (by recompute), chunking and hitting the prefix cache. Every greedy
output must equal the output of an unconstrained run (a pool large enough that nothing is
ever preempted), token for token; and every block must be free at the end.

    PYTHONPATH=. python scripts/dev/stress.py [--num-requests 300] [--num-kv-blocks 40]

Not part of the test suite: it takes minutes on a CPU. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from nanoserve import LLM, SamplingParams

PREFIXES = ["", "You are a helpful assistant. Answer briefly. ",
            "Answer in one short sentence, like a pirate would: "]
TOPICS = ["cats", "the moon", "bread", "rivers", "chess", "volcanoes", "tea", "bicycles",
          "owls", "snow", "jazz", "bridges"]
TEMPLATES = ["Tell me about {t}.", "Why do people like {t}?", "Write a line about {t} and {n}.",
             "What is {n} plus {n}?", "List facts about {t}:", "{t} {n}"]


def make_workload(n: int, seed: int) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        text = rng.choice(TEMPLATES).format(t=rng.choice(TOPICS), n=rng.randint(1, 999))
        # ignore_eos: every request really uses its max_tokens of KV, whatever it says.
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 32), ignore_eos=True)
        work.append((rng.choice(PREFIXES) + text, params))
    return work


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--num-kv-blocks", type=int, default=40)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--wave", type=int, default=12, help="requests added per step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = make_workload(args.num_requests, args.seed)

    # The unconstrained reference: all at once, a pool that fits every running request.
    start = time.perf_counter()
    ref = LLM(num_kv_blocks=256, block_size=args.block_size, max_num_seqs=32)
    expected = [o.token_ids for o in ref.generate([p for p, _ in work], [s for _, s in work],
                                                  use_tqdm=False)]
    ref_time = time.perf_counter() - start
    assert ref.scheduler.num_preemptions == 0, "the reference run must not preempt"
    del ref

    llm = LLM(num_kv_blocks=args.num_kv_blocks, block_size=args.block_size)
    bm = llm.scheduler.block_manager
    start = time.perf_counter()
    ids, outputs, pending = [], {}, list(work)
    max_running = 0
    while pending or llm.has_unfinished_requests():
        for prompt, params in pending[:args.wave]:  # arrivals between steps
            ids.append(llm.add_request(prompt, params))
        pending = pending[args.wave:]
        outputs.update((o.request_id, o) for o in llm.step())
        max_running = max(max_running, len(llm.scheduler.running))
    wall = time.perf_counter() - start

    mismatches = [i for i, (rid, want) in enumerate(zip(ids, expected))
                  if outputs[rid].token_ids != want]
    num_tokens = sum(len(o.token_ids) for o in outputs.values())
    reasons: dict[str, int] = {}
    for o in outputs.values():
        reasons[o.finish_reason] = reasons.get(o.finish_reason, 0) + 1
    print(f"requests          {len(ids)} (max_tokens 4-32, greedy, {args.wave} arrive per step)")
    print(f"KV pool           {bm.num_blocks} blocks x {bm.block_size} tokens")
    print(f"steps             {llm.num_steps}")
    print(f"max running       {max_running}")
    print(f"preemptions       {llm.scheduler.num_preemptions}")
    print(f"prefix hit rate   {bm.prefix_cache_hit_rate:.1%}")
    print(f"output tokens     {num_tokens}")
    print(f"finish reasons    {reasons}")
    print(f"wall time         {wall:.1f} s (reference run, unconstrained: {ref_time:.1f} s)")
    print(f"free blocks       {bm.num_free_blocks}/{bm.num_blocks} at the end")
    print(f"mismatches        {len(mismatches)} of {len(ids)} vs the unconstrained run")
    for i in mismatches[:5]:
        print(f"  #{i} {work[i][0]!r}: got {outputs[ids[i]].token_ids} want {expected[i]}")
    ok = not mismatches and bm.num_free_blocks == bm.num_blocks and len(outputs) == len(ids)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
