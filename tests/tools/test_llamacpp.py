"""The llama.cpp peer's plumbing, without llama.cpp: the one-line hint where it is not set up,
the job and result files, and the worker's server-style continuous batching on a fake engine
that checks every batch as llama.cpp's KV cache would (contiguous positions per sequence, a
reused sequence id starts empty, no more sequences or tokens than the context allows)."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import llamacpp_system, llamacpp_worker, report
from benchmarks.llamacpp_system import (
    LlamaCpp,
    StepPeer,
    gguf_path,
    llamacpp_job,
    llamacpp_result,
    step_job,
    unavailable,
)
from benchmarks.llamacpp_worker import Scheduler
from benchmarks.workloads import Job, Workload

ROOT = Path(__file__).resolve().parents[2]
HINT = "not set up: run `bash scripts/bench/setup_llamacpp.sh`"
LENGTHS = [3, 17, 1, 9, 2, 12, 7]


def jobs() -> list[Job]:
    return [Job([3 + (i * 7 + k) % 250 for k in range(5 + 3 * i)], n)
            for i, n in enumerate(LENGTHS)]


def next_token(cells: list[int]) -> int:
    """The fake model: the next token depends on the whole sequence, order included."""
    return sum((i + 1) * t for i, t in enumerate(cells)) % 97 + 3


def reference(prompt: list[int], n: int) -> list[int]:
    cells, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(cells))
        cells.append(out[-1])
    return out


class FakeEngine:
    """Engine's interface; asserts what llama.cpp would refuse or get wrong."""

    def __init__(self, gguf, n_seq, n_ctx_seq, n_batch, threads, kv_type=None,
                 flash_attn="auto") -> None:
        self.batches: list[list[tuple]] = []
        self.new_context(n_seq, n_ctx_seq, n_batch, threads, kv_type, flash_attn)

    def new_context(self, n_seq, n_ctx_seq, n_batch, threads, kv_type=None,
                    flash_attn="auto") -> None:
        assert flash_attn in llamacpp_worker.FLASH_ATTN
        self.n_seq, self.n_ctx_seq, self.n_batch = n_seq, n_ctx_seq, n_batch
        self.kv: dict[int, list[int]] = {}

    def decode(self, entries):
        assert 0 < len(entries) <= self.n_batch
        self.batches.append(entries)
        out = []
        for seq, token, pos, logits in entries:
            assert 0 <= seq < self.n_seq
            cells = self.kv.setdefault(seq, [])
            assert pos == len(cells) < self.n_ctx_seq, "positions must continue the sequence"
            cells.append(token)
            if logits:
                out.append(next_token(cells))
        return out

    def drop(self, seq, from_pos=-1):
        del self.kv[seq][max(from_pos, 0):]

    def clear(self):
        self.kv.clear()

    def info(self):
        return {"llama_cpp_python": "fake", "kv_type": "f16", "flash_attn": "auto",
                "n_ctx_seq": self.n_ctx_seq, "system_info": "fake"}


def serve(prompts, max_tokens, seqs, budget):
    engine, sched = FakeEngine("x", seqs, 1000, budget, 1), Scheduler(prompts, max_tokens, seqs,
                                                                       budget)
    tokens = {}
    while sched.unfinished():
        entries = sched.plan()
        assert len({e.slot.seq for e in entries}) == len({id(e.slot) for e in entries})
        done = sched.commit(entries, engine.decode([(e.slot.seq, e.token, e.pos, e.logits)
                                                    for e in entries]))
        for s in done:
            engine.drop(s.seq)
            tokens[s.job] = s.out
    return [tokens[i] for i in range(len(prompts))], engine


@pytest.mark.parametrize("seqs,budget", [(1, 4), (3, 8), (3, 512), (16, 16)])
def test_continuous_batching_gives_each_request_its_own_greedy_tokens(seqs, budget):
    prompts = [j.prompt_ids for j in jobs()]
    tokens, engine = serve(prompts, LENGTHS, seqs, budget)
    assert tokens == [reference(p, n) for p, n in zip(prompts, LENGTHS)]
    assert engine.kv == {s: [] for s in engine.kv}  # every finished sequence's KV removed
    assert all(len({seq for seq, *_ in b}) <= seqs for b in engine.batches)


def test_decodes_come_first_and_prompts_are_chunked_to_the_budget():
    sched = Scheduler([[5] * 10, [6] * 3], [4, 4], 2, 6)
    first = sched.plan()  # request 0's first 6 prompt tokens, no logits yet
    assert [(e.slot.job, e.pos, e.logits) for e in first] == [(0, p, False) for p in range(6)]
    sched.commit(first, [])
    second = sched.plan()  # the rest of request 0 (logits on its last token), then request 1
    assert [(e.slot.job, e.pos, e.logits) for e in second] == (
        [(0, p, p == 9) for p in range(6, 10)] + [(1, 0, False), (1, 1, False)])
    sched.commit(second, [42])
    third = sched.plan()  # request 0 decodes its sampled token first
    assert (third[0].slot.job, third[0].token, third[0].pos) == (0, 42, 10)
    assert [(e.slot.job, e.pos, e.logits) for e in third[1:]] == [(1, 2, True)]
    with pytest.raises(ValueError, match="2 logits rows"):
        sched.commit(third, [1])


def test_a_finished_request_frees_its_sequence_id_for_the_next():
    sched = Scheduler([[1, 2], [3], [4]], [1, 2, 1], 2, 64)
    entries = sched.plan()
    assert sorted({e.slot.seq for e in entries}) == [0, 1] and len(sched.waiting) == 1
    done = sched.commit(entries, [7, 8])
    assert [(s.job, s.seq, s.out) for s in done] == [(0, 0, [7])]
    nxt = sched.plan()  # request 1 decodes in seq 1; request 2 takes the freed seq 0
    assert [(e.slot.job, e.slot.seq) for e in nxt] == [(1, 1), (2, 0)]


def workload() -> Workload:
    return Workload("test", jobs(), 3, "")


def test_workload_job_runs_through_the_worker_and_back(tmp_path, monkeypatch):
    """job file -> worker main (on the fake engine) -> result file -> SystemResult."""
    monkeypatch.setattr(llamacpp_worker, "Engine", FakeEngine)
    wl = workload()
    job = llamacpp_job(wl, Path("/m/x-f32.gguf"), 16, 2)
    assert job["mode"] == "workload" and job["max_tokens"] == LENGTHS
    assert job["prompts"] == [j.prompt_ids for j in wl.jobs] and job["max_num_seqs"] == 3
    assert job["max_model_len"] == max(len(j.prompt_ids) + j.max_tokens for j in wl.jobs)
    (tmp_path / "job.json").write_text(json.dumps(job))
    llamacpp_worker.main(str(tmp_path / "job.json"), str(tmp_path / "result.json"))
    data = json.loads((tmp_path / "result.json").read_text())
    r = llamacpp_result(data, wl)
    assert r.system == "llamacpp" and r.token_ids == [reference(j.prompt_ids, j.max_tokens)
                                                      for j in wl.jobs]
    assert r.useful_tokens == sum(LENGTHS) and r.wall_s > 0 and 0 < r.utilisation <= 1
    assert len(r.timeline) == r.num_steps and all(len(row) == 3 for row in r.timeline)
    assert all(0 <= t <= e for t, e in zip(r.ttft, r.e2e))
    assert r.startup_s >= 0 and r.first_token_s >= r.startup_s
    assert "| llamacpp |" in report.throughput_table([r])
    with pytest.raises(RuntimeError, match="wrong number of tokens"):
        llamacpp_result({**data, "token_ids": [[7]] + data["token_ids"][1:]}, wl)


def test_step_mode_answers_each_command_and_keeps_every_row_at_the_same_context(monkeypatch):
    engines = []
    monkeypatch.setattr(llamacpp_worker, "Engine",
                        lambda *a: engines.append(FakeEngine(*a)) or engines[-1])
    monkeypatch.setenv("NANOSERVE_LLAMACPP_FLASH_ATTN", "off")
    job = step_job(Path("/m/x-bf16.gguf"), 20, 2)
    assert job["flash_attn"] == "off" and job["kv_type"] is None  # llama.cpp's default KV
    replies = io.StringIO()
    llamacpp_worker.run_steps(json.loads(json.dumps(job)),
                              io.StringIO("rows 1\nstep\nstep\nrows 4\nstep\n"), replies)
    info, *answers = replies.getvalue().splitlines()
    assert json.loads(info)["threads"] == 2 and json.loads(info)["llama_cpp_python"] == "fake"
    assert [a for a in answers if a == "ready"] == ["ready", "ready"] and len(answers) == 5
    assert all(float(a) >= 0 for a in answers if a != "ready")
    steps = [b for b in engines[0].batches if len(b) in (1, 4) and b[0][2] == 20]
    assert len(steps) == 3  # every step at exactly 20 tokens of context: each decoded one dropped
    assert all(pos == 20 and logits for b in steps for _, _, pos, logits in b)
    with pytest.raises(SystemExit, match="unknown command 'step'"):  # a step before any rows
        llamacpp_worker.run_steps(job, io.StringIO("step\n"), io.StringIO())


FAKE_WORKER = """
import os, sys
sys.path.insert(0, {root!r})
from benchmarks import llamacpp_worker

class Engine:  # what the step mode calls; its prints on fd 1 must not reach the answers
    n_batch = 512
    def __init__(self, *args):
        pass
    def new_context(self, *args):
        pass
    def decode(self, entries):
        os.write(1, b"llama.cpp's own print\\n")
        if entries[0][1] == {crash}:
            os._exit(3)
        return [7] * sum(1 for e in entries if e[3])
    def drop(self, seq, from_pos=-1):
        pass
    def info(self):
        return {{"llama_cpp_python": "fake", "threads": 1}}

llamacpp_worker.Engine = Engine
llamacpp_worker.main(sys.argv[1], sys.argv[2])
"""


@pytest.mark.parametrize("crash", [False, True])
def test_step_peer_steps_the_worker_process_on_demand(tmp_path, crash):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    worker = tmp_path / "worker.py"
    # crash: the worker dies in its first decode (a token it is given: step_tokens(0, 8)[8])
    worker.write_text(FAKE_WORKER.format(root=str(ROOT), crash=llamacpp_worker.step_tokens(
        0, 8)[8] if crash else -1))
    with StepPeer(tmp_path / "x.gguf", 8, 1, venv=venv, worker=worker) as peer:
        assert peer.info["llama_cpp_python"] == "fake"
        peer.rows(1)
        if crash:
            with pytest.raises(RuntimeError, match="exit 3"):
                peer.step()
            return
        assert all(peer.step() >= 0 for _ in range(3))
        peer.rows(2)
        assert peer.step() >= 0
    assert peer.proc.returncode == 0  # end of input ended it


def test_unknown_mode_is_refused(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"mode": "nope"}))
    with pytest.raises(SystemExit, match="unknown mode"):
        llamacpp_worker.main(str(tmp_path / "job.json"), str(tmp_path / "r.json"))


def test_the_hint_says_how_to_set_it_up(tmp_path):
    none = tmp_path / "no-venv"
    assert unavailable("/m/SmolLM2", "float32", venv=none).startswith(HINT)
    assert LlamaCpp("/m/SmolLM2", "bfloat16", venv=none).unavailable().startswith(HINT)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    why = unavailable("/m/SmolLM2", "bfloat16", venv=venv, root=tmp_path)
    assert why.startswith(HINT) and "SmolLM2-bf16.gguf" in why and "\n" not in why
    gguf_path("/m/SmolLM2", "bfloat16", tmp_path).write_text("")
    assert unavailable("/m/SmolLM2", "bfloat16", venv=venv, root=tmp_path) is None
    assert "float32 and bfloat16 only" in unavailable("/m/SmolLM2", "float16", venv=venv)


def test_ratio_line_for_llamacpp():
    from benchmarks.systems import SystemResult

    ours = SystemResult("continuous", 1.0, None, 2, 4, 10, None, None, [], [], [])
    theirs = SystemResult("llamacpp", 4.0, None, 2, 4, 10, None, None, [], [], [])
    assert report.ratio_lines([ours, theirs]) == [
        "nanoserve (continuous) / llama.cpp: 4.00x output tok/s"]


def load_step_times():
    spec = importlib.util.spec_from_file_location("step_times",
                                                  ROOT / "scripts/bench/step_times.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_times_skips_llamacpp_in_one_line(tmp_path, monkeypatch, capsys):
    step_times = load_step_times()
    monkeypatch.setattr(llamacpp_system, "unavailable",
                        lambda m, d: unavailable(m, d, venv=tmp_path / "no-venv"))
    args = SimpleNamespace(no_llamacpp=False, context=240, steps=2, model="/m/SmolLM2")
    assert step_times.llama_peer("float32", args) is None
    lines = capsys.readouterr().out.splitlines()
    why = unavailable("/m/SmolLM2", "float32", venv=tmp_path / "no-venv")
    assert lines == [f"llama.cpp float32: skipped: {why}"]
    assert HINT in lines[0]
    assert step_times.llama_peer("float32", SimpleNamespace(no_llamacpp=True)) is None


def test_step_times_help_works():
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "scripts/bench/step_times.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--no-llamacpp" in out and "llama.cpp" in out


def test_kernel_ab_help_works():
    import subprocess

    script = str(ROOT / "scripts/bench/kernel_ab.py")
    out = subprocess.run([sys.executable, script, "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "rotates" in out and "csrc" in out and "--repeat" in out
    bad = subprocess.run([sys.executable, script, "bfloat16", "/nonexistent", "--repeat", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--repeat must be at least 1" in bad.stderr


def test_step_breakdown_times_each_part_on_a_tiny_model():
    """nanoserve_accel/bench/step_breakdown.py end to end: its build with the marks, one row of
    the table per row count, every part timed (no figure is asserted)."""
    import subprocess

    from tests.common.tiny_model import tiny_model_dir

    kernels = pytest.importorskip("nanoserve_accel.kernels")  # the plugin may be left out
    if kernels.compile_kernels() is None:
        pytest.skip("no C compiler here")
    out = subprocess.run([sys.executable, str(ROOT / "nanoserve_accel/bench/step_breakdown.py"),
                          "--model", tiny_model_dir(), "--dtype", "float32", "--rows", "1,2",
                          "--steps", "3", "--context", "20", "--split", "0"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [r[0] for r in rows] == ["| 1", "| 2"]
    assert all(len(r) == 12 and float(r[-1].rstrip(" |")) > 0 for r in rows)  # "the rest"
