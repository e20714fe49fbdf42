"""The chapter's figures (2.2 §2, §3, §6.3) as the step-level simulator reproduces them on the
real schedulers and BlockManager: the numbers, seats and steps each figure must show."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nanoserve.simulator import SimRequest, next_token, simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "reader"))  # a script
from simulate import FIGURES, run_figure  # noqa: E402


def counts(sim) -> tuple[int, int]:
    """(useful, idle) seat-steps of a run, from its grid."""
    grid = sim.grid()
    return sum(c.isalpha() for row in grid for c in row), sum(row.count("/") for row in grid)


def test_chapter2_example_useful_850_of_4000_seat_steps():
    """§2: 8 requests, the longest 500 steps, the other 7 averaging 50: static batching
    does real work in 850 of 4,000 seat-steps (21.25%), ~79% of them spin idle."""
    static, continuous = run_figure("chapter2-example")
    assert len(static.records) == 500 and static.num_seats == 8
    assert counts(static) == (850, 3150)
    assert "useful 850 (21.25%), idle rows 3150 (78.75%)" in static.summary()
    # Continuous batching computes the same 850 rows and not one for a finished request.
    assert counts(continuous) == (850, 0)
    assert {r["request"]: len(continuous.steps_of(r["request"])) for r in
            continuous.records[0]["rows"]} == {j.name: j.output_len
                                               for j in FIGURES["chapter2-example"][0]}


def test_chapter2_finished_rows_stay_in_the_static_batch():
    """§2's picture: A (20 steps) and C (100) keep computing idle rows until B's 500th step,
    and only then are handed back; continuous batching lets them leave at once."""
    static, continuous = run_figure("chapter2")
    leaves = {f["request"]: rec["step"] for sim in (static,) for rec in sim.records
              for f in rec["finished"]}
    assert leaves == {"A": 500, "B": 500, "C": 500}
    assert static.grid()[0] == "A" * 20 + "/" * 480
    assert continuous.grid()[0] == "A" * 20 + "." * 480
    assert continuous.steps_of("C") == list(range(1, 101))


def test_chapter3_static_waits_for_b_continuous_refills_at_once():
    """§3: 4 seats, A-D arrive together, E, F, G later. Static lets E, F, G in only after B
    ends at step 10; continuous gives each the seat of A, D, C the step after it leaves."""
    static, continuous = run_figure("chapter3")
    assert static.steps_of("B")[-1] == 10
    assert [static.admitted(n) for n in "EFG"] == [[11], [11], [11]]
    assert static.grid() == ["AAA///////EEEEE/",
                             "BBBBBBBBBBFFFF//",
                             "CCCCC/////GGGGGG",
                             "DDDDDDD///......"]
    assert continuous.grid() == ["AAAEEEEE.....",
                                 "BBBBBBBBBB...",
                                 "CCCCCFFFF....",
                                 "DDDDDDDGGGGGG"]
    for leaver, joiner in zip("ACD", "EFG"):
        assert continuous.admitted(joiner) == [continuous.steps_of(leaver)[-1] + 1]
    assert (len(static.records), len(continuous.records)) == (16, 13)


def test_preemption_victim_is_the_last_admitted_and_recomputes():
    """§6.3 with 6 KV blocks of 4 tokens: at step 6 A needs a 3rd block and none is free;
    FCFS evicts the last request of `running` (C), which goes to the front of waiting
    (ahead of D, waiting since step 2) and later recomputes its prompt and its 5 tokens."""
    static, continuous = run_figure("preemption")
    for sim in (static, continuous):
        first = next(rec for rec in sim.records if rec["preempted"])
        assert first["step"] == 6
        assert [(p["request"], p["seat"]) for p in first["preempted"]] == [("C", 2)]
        assert sim.notes[0].startswith("step 6: C preempted: no free KV block for A's next "
                                       "token; FCFS victim = last admitted = C")
    resumed = next(r for rec in continuous.records[6:] for r in rec["rows"]
                   if r["request"] == "C")
    assert (resumed["role"], resumed["start"], resumed["end"]) == ("prefill", 0, 9)
    assert continuous.admitted("C") == [1, 7] and continuous.admitted("D") == [10]
    assert static.admitted("C") == [1, 10]  # static: not before the batch is over
    assert "step 7: C resumes and recomputes 9 tokens" in continuous.notes[1]


def test_victim_is_last_admitted_not_last_named():
    """The victim is whoever joined `running` last: here A, which arrived a step after B
    and C (a rule that picked by name, length or seat would choose differently)."""
    jobs = [SimRequest("B", 4, 8), SimRequest("C", 4, 8), SimRequest("A", 4, 8, arrival_step=1)]
    sim = simulate(jobs, "fcfs", num_seats=3, num_blocks=6)
    victims = [p["request"] for rec in sim.records for p in rec["preempted"]]
    assert victims and victims[0] == "A"
    assert "no free KV block for B's next token; FCFS victim = last admitted = A" in sim.notes[0]


def test_exact_output_lengths_and_the_trace_file(tmp_path):
    """Every request gets exactly output_len tokens whatever the policy, and the trace file
    holds one header and one line per step, with the simulator as source."""
    path = tmp_path / "sim.jsonl"
    static, continuous = run_figure("preemption", trace=str(path))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    headers = [x for x in lines if x["type"] == "run"]
    assert [(h["name"], h["source"], h["max_num_seqs"], h["num_blocks"]) for h in headers] == \
        [("static", "simulator", 3, 6), ("continuous", "simulator", 3, 6)]
    assert len(lines) == 2 + len(static.records) + len(continuous.records)
    for sim in (static, continuous):
        made = {}  # a row ending at `end` samples token `end`: prompt 4 + outputs - 1
        for rec in sim.records:
            for r in rec["rows"]:
                if r["role"] != "idle":
                    made[r["request"]] = max(made.get(r["request"], 0), r["end"] - 4 + 1)
        assert made == {j.name: j.output_len for j in FIGURES["preemption"][0]}


def test_simulator_is_deterministic_and_checks_its_config():
    a, b = run_figure("chapter3"), run_figure("chapter3")
    assert [s.records for s in a] == [s.records for s in b]
    assert next_token([1, 2, 3]) != next_token([3, 2, 1])  # order matters to the stand-in
    with pytest.raises(ValueError, match="max_num_seqs"):
        simulate([SimRequest("A", 4, 2)], num_seats=0)
