"""bench.py end to end on a tiny random-weight Llama: the numbers it reports must add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench.py is a script
import bench  # noqa: E402
from benchmarks import report, workloads  # noqa: E402
from benchmarks.llamacpp_system import LlamaCpp  # noqa: E402
from benchmarks.systems import SystemResult, assign_seats  # noqa: E402
from benchmarks.vllm_system import VLLM, identical_requests, vllm_job, vllm_result  # noqa: E402
from benchmarks.workloads import Job, Workload, poisson_arrivals  # noqa: E402
from tests.common.tiny_model import tiny_model_dir  # noqa: E402

VOCAB = 256
LENGTHS = [3, 17, 5, 9, 2, 12, 7]  # skewed, so static batching must waste rows


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model gains nothing from threads, and on a busy 2-core machine OpenMP threads
    waiting for each other at every op made this file 15x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A random-weight Llama and a word-level tokenizer ("t0".."t255"), saved like a HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", bos_token="t1",
                                        eos_token="t2")
    tokenizer.chat_template = "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
    tokenizer.save_pretrained(path)
    return str(path)


def jobs() -> list[Job]:
    return [Job([3 + (i * 7 + k) % 250 for k in range(5 + 3 * i)], n)
            for i, n in enumerate(LENGTHS)]


def workload(job_list: list[Job] | None = None, seats: int = 3) -> Workload:
    return Workload("test", job_list or jobs(), seats, "")


def check(r: SystemResult, seats: int) -> None:
    assert r.useful_tokens == sum(LENGTHS)
    assert r.num_steps > 0 and r.wall_s > 0
    assert 0 < r.utilisation <= 1
    assert r.useful_request_steps >= sum(LENGTHS)  # >= : a chunked prefill takes steps too
    assert len(r.e2e) == len(LENGTHS) and all(e > 0 for e in r.e2e)
    assert r.max_num_seqs == seats


@pytest.fixture(scope="module")
def nanoserve_results(tiny_dir):
    # max_num_batched_tokens 16: prefills get chunked, as on the real workload
    return {system.name: system(tiny_dir, max_num_batched_tokens=16).run(workload())
            for system in (bench.Continuous, bench.Static)}


def test_nanoserve_continuous_and_static_add_up(nanoserve_results):
    cont, static = nanoserve_results["continuous"], nanoserve_results["static"]
    for r in (cont, static):
        check(r, 3)
        assert r.preemptions == 0 and 0 < r.peak_kv_usage <= 1
        assert len(r.timeline) == r.num_steps and all(len(row) == 3 for row in r.timeline)
        # the picture shows exactly the counted work: useful cells > 0, wasted cells < 0
        assert sum(c > 0 for row in r.timeline for c in row) == r.useful_request_steps
        assert sum(c < 0 for row in r.timeline for c in row) == r.wasted_request_steps
    assert cont.wasted_request_steps == 0 and static.wasted_request_steps > 0
    assert static.utilisation <= cont.utilisation
    assert static.num_steps > cont.num_steps


def test_static_runs_whole_batches(nanoserve_results):
    """§2: a static batch's seats are all busy (usefully or not) until its longest is done."""
    static = nanoserve_results["static"]
    first_batch = static.timeline[:max(LENGTHS[:3]) + 1]
    assert all(sum(c != 0 for c in row) == 3 for row in first_batch[1:max(LENGTHS[:3])])


def test_hf_static_adds_up(tiny_dir):
    r = bench.HFStatic(tiny_dir).run(workload())
    check(r, 3)
    batches = [LENGTHS[i:i + 3] for i in range(0, len(LENGTHS), 3)]
    assert r.num_steps == sum(max(b) for b in batches)
    assert r.wasted_request_steps == sum(max(b) * len(b) - sum(b) for b in batches)


def test_assign_seats_reuses_the_lowest_free_seat():
    steps = [[(0, True), (1, True)], [(1, True)], [(2, True), (1, False)]]
    assert assign_seats(steps, 2) == [[1, 2], [0, 2], [3, -2]]


def test_main_writes_json_and_text(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(workloads, "longtail_lengths", lambda rng, n, hi: LENGTHS[:n])
    out = tmp_path / "r.json"
    results = bench.main(["--model", tiny_dir, "--workload", "longtail", "--quick",
                          "--num-requests", "6", "--max-num-seqs", "3", "--systems",
                          "continuous,static", "--out", str(out), "--png",
                          str(tmp_path / "t.png"), "--trace-dir", str(tmp_path / "traces")])
    data = json.loads(out.read_text())
    assert [r["system"] for r in data["results"]] == ["continuous", "static"]
    assert data["ratios"][0].startswith("continuous / static")
    text = capsys.readouterr().out
    assert "| continuous |" in text and "seat  0 |" in text
    # --trace-dir: one run per nanoserve system, without the warm-up, counting the same work
    lines = [json.loads(x) for x in (tmp_path / "traces" / "longtail.jsonl").read_text()
             .splitlines()]
    headers = [x for x in lines if x["type"] == "run"]
    assert [(h["name"], h["source"], h["max_num_seqs"]) for h in headers] == \
        [("continuous", "bench", 3), ("static", "bench", 3)]
    starts = [i for i, x in enumerate(lines) if x["type"] == "run"] + [len(lines)]
    for r, a, b in zip(results, starts, starts[1:]):
        steps = lines[a + 1:b]
        roles = [row["role"] for s in steps for row in s["rows"]]
        assert len(steps) == r.num_steps
        assert len(roles) - roles.count("idle") == r.useful_request_steps
        assert roles.count("idle") == r.wasted_request_steps


def test_hf_cb_adds_up(tiny_dir):
    r = bench.HFContinuous(tiny_dir, max_num_batched_tokens=16).run(workload())
    check(r, 3)
    assert r.wasted_request_steps == 0


def test_arrivals_enter_from_the_step_loop(tiny_dir):
    """--arrival-rate: a job is added only once its arrival time has passed, and its
    latency is measured from that arrival time, not from when the loop noticed it."""
    timed = [Job(j.prompt_ids, j.max_tokens, arrival=0.05 * i) for i, j in enumerate(jobs())]
    r = bench.Continuous(tiny_dir).run(workload(timed))
    check(r, 3)
    assert r.wall_s >= timed[-1].arrival
    assert all(t > 0 and e >= t for t, e in zip(r.ttft, r.e2e))


def test_poisson_arrivals_are_seeded_and_increasing():
    import numpy as np

    a = poisson_arrivals(np.random.default_rng(1), 50, 4.0)
    assert a == poisson_arrivals(np.random.default_rng(1), 50, 4.0)
    assert all(x < y for x, y in zip(a, a[1:])) and 5 < a[-1] < 25
    assert poisson_arrivals(np.random.default_rng(1), 3, None) == [0.0, 0.0, 0.0]


def test_vllm_is_skipped_with_a_hint_when_its_venv_is_absent(tiny_dir, tmp_path, capsys,
                                                             monkeypatch):
    absent = VLLM(tiny_dir, venv=tmp_path / "no-venv")
    assert "bash scripts/bench/setup_vllm_venv.sh" in absent.unavailable()
    monkeypatch.setitem(bench.SYSTEMS, "vllm",
                        lambda *args: VLLM(*args, venv=tmp_path / "no-venv"))
    results = bench.main(["--model", tiny_dir, "--workload", "chapter", "--quick",
                          "--systems", "vllm", "--out", str(tmp_path / "r.json")])
    assert results == []
    lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith("skipping vllm")]
    assert len(lines) == 1 and "scripts/bench/setup_vllm_venv.sh" in lines[0]


def test_llamacpp_is_skipped_with_a_hint_when_not_set_up(tiny_dir, tmp_path, capsys,
                                                         monkeypatch):
    monkeypatch.setitem(bench.SYSTEMS, "llamacpp",
                        lambda *args: LlamaCpp(*args, venv=tmp_path / "no-venv"))
    results = bench.main(["--model", tiny_dir, "--workload", "chapter", "--quick",
                          "--systems", "llamacpp", "--out", str(tmp_path / "r.json")])
    assert results == []
    out = capsys.readouterr().out.splitlines()
    lines = [s for s in out if s.startswith("skipping llamacpp")]
    assert lines == ["skipping llamacpp: not set up: run `bash scripts/bench/setup_llamacpp.sh` "
                     "(~6 min; no no-venv/)"]
    assert out[0].startswith("cpu: ") and "cores" in out[0]  # the header says which machine


def test_vllm_job_file_and_result_parsing():
    wl = workload()
    job = vllm_job(wl, "/models/x", "float32", 16)
    assert job["prompts"] == [j.prompt_ids for j in wl.jobs]
    assert job["max_tokens"] == LENGTHS and job["max_num_seqs"] == 3
    assert job["max_model_len"] == max(len(j.prompt_ids) + j.max_tokens for j in wl.jobs)
    assert json.loads(json.dumps(job)) == job  # it travels as a file
    tokens = [[7] * n for n in LENGTHS]
    data = {"startup_s": 60.0, "first_token_s": 61.0, "wall_s": 2.0, "vllm": "0.32.0",
            "torch": "2.13.0", "block_size": 128, "token_ids": tokens}
    r = vllm_result(data, wl)
    assert r.system == "vllm" and r.output_tps == sum(LENGTHS) / 2.0
    assert r.startup_s == 60.0 and r.token_ids == tokens and r.utilisation is None
    assert "| vllm |" in report.latency_table([r])  # no latencies: shown as "-"
    with pytest.raises(RuntimeError, match="wrong number of tokens"):
        vllm_result({**data, "token_ids": [[7]] + tokens[1:]}, wl)


def test_identical_token_counts_and_vllm_ratio():
    def result(system: str, tokens: list[list[int]], wall: float) -> SystemResult:
        return SystemResult(system, wall, None, 2, 4, 10, None, None, [], [], [],
                            token_ids=tokens)

    ours = result("continuous", [[1, 2], [3, 4]], 1.0)
    theirs = result("vllm", [[1, 2], [3, 5]], 2.0)
    assert identical_requests(ours.token_ids, theirs.token_ids) == 1
    assert report.identical_counts([ours, theirs]) == {"vllm": 1}
    assert report.ratio_lines([ours, theirs]) == [
        "nanoserve (continuous) / vLLM: 2.00x output tok/s"]
    assert "| vllm |" in report.throughput_table([theirs])


def test_dtype_auto_goes_to_nanoserve_and_resolves_for_the_others():
    assert bench.parse_args(["--dtype", "auto"]).dtype == "auto"
    assert bench.concrete_dtype("bfloat16") == "bfloat16"
    assert bench.concrete_dtype("auto") in ("float32", "bfloat16")


def test_beam_search_script_runs_nanoserve_on_the_tiny_model():
    """scripts/bench/beam_search.py, one system: two timed searches, each prompt's best."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "beam_search.py"
    out = subprocess.run([sys.executable, str(script), "--system", "nanoserve", "--model",
                          tiny_model_dir(), "--beam-width", "2", "--max-tokens", "3"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["walls"]) == 2 and all(w > 0 for w in result["walls"])
    assert len(result["best"]) == 8 and all(len(b) > 3 for b in result["best"])
