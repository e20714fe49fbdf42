"""The OpenAI-compatible server (nanoserve/entrypoints/), end to end: a real
`python -m nanoserve.serve` process on 127.0.0.1 (ephemeral port), the real `openai` client and
raw httpx. Every wait is bounded in count and time; speed is never asserted.

- Greedy completions and chat equal `LLM.generate`'s (same model, in this process); streamed
  text joined equals the non-streamed text; usage counts; /v1/models, /health, /metrics parse.
- Bad inputs: each a 400 (404 for an unknown model) naming the field, and the server keeps serving.
- A client that disconnects mid-stream or mid-answer aborts its request: 0 running, all KV free.
- 64 concurrent clients, mixed lengths, some disconnecting at random points, some bad: every good
  one gets the right greedy tokens, no 5xx, no leaked block, RSS flat over repeated rounds.
- The bundled model streams emoji / Vietnamese without U+FFFD; a stop string never leaks.
- --api-key (401), SIGTERM: in-flight requests finish, then exit 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from nanoserve import LLM, SamplingParams
from nanoserve.utils.bundled import default_model_dir
from tests.common.tiny_model import VOCAB_SIZE, tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "reader"))
from trace_page import build_page, read_runs  # noqa: E402

MAX_MODEL_LEN = 2048  # long requests, so a disconnect surely comes before their end
TINY_FLAGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16",
              "--max-num-seqs", "32", "--max-num-batched-tokens", "512"]
TINY_CONFIG = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": 16,
               "max_num_seqs": 32, "max_num_batched_tokens": 512}
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, flags: list[str], name: str = "m") -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanoserve.serve", model, "--port", str(self.port),
             "--served-model-name", name, *flags], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not come up in 180 s")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) / 1024

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Until nothing runs or waits and every KV block is free (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["nanoserve:num_requests_running"], m["nanoserve:num_requests_waiting"],
                    m["nanoserve:kv_cache_usage_perc"]) == (0, 0, 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout} s: {m}")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), TINY_FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref_llm() -> LLM:
    return LLM(tiny_model_dir(MAX_MODEL_LEN), **TINY_CONFIG)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# -- correct answers ---------------------------------------------------------------------


def test_completions_equal_generate_streamed_or_not(server, ref_llm):
    client = server.client()
    for prompt in ["The quick brown fox", [5, 17, 3, 250, 8, 41]]:
        [ref] = ref_llm.generate([prompt], greedy(20), use_tqdm=False)
        out = client.completions.create(model="m", prompt=prompt, max_tokens=20, temperature=0,
                                        extra_body={"ignore_eos": True})
        choice = out.choices[0]
        assert choice.text == ref.text and choice.finish_reason == "length"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) \
            == (len(ref.prompt_token_ids), 20, len(ref.prompt_token_ids) + 20)
        chunks = list(client.completions.create(
            model="m", prompt=prompt, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
        assert "".join(c.choices[0].text for c in chunks[:-1]) == ref.text
        assert chunks[-2].choices[0].finish_reason == "length"
        assert all(c.usage is None for c in chunks[:-1])  # usage only on the last chunk


def test_chat_equals_generate_on_the_chat_template(server, ref_llm):
    messages = [{"role": "user", "content": "Tell me about Hanoi"}]
    ids = ref_llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    [ref] = ref_llm.generate([ids], greedy(16), use_tqdm=False)
    client = server.client()
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=16,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 16
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=16,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


def test_models_health_metrics(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == ["m"]
    assert models[0].model_dump()["root"] == tiny_model_dir(MAX_MODEL_LEN)
    assert httpx.get(server.base + "/health").status_code == 200
    m = server.wait_idle()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_count",
                 "request_time_per_output_token_seconds_count"):
        assert "nanoserve:" + name in m
    assert m["nanoserve:time_to_first_token_seconds_count"] >= 1  # earlier tests' requests


# -- bad input ------------------------------------------------------------------------------

GOOD = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
BAD = [  # (change to GOOD, status, param)
    ({"temperature": -0.5}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),  # + 3 prompt tokens > max_model_len
    ({"model": "gpt-17"}, 404, "model"),
    ({"n": 0}, 400, "n"),
    ({"top_p": 0}, 400, "top_p"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"prompt": [5, -1]}, 400, "prompt"),
    ({"prompt": [5, VOCAB_SIZE]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": None}, 400, "prompt"),
    ({"stop": [""]}, 400, "stop"),
    ({"seed": -1}, 400, "seed"),
]


def post(server, path: str, content: bytes | str, headers: dict | None = None):
    return httpx.post(server.base + path, content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize("change, status, param", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_request_names_the_field_and_server_keeps_serving(server, change, status, param):
    r = post(server, "/v1/completions", json.dumps({**GOOD, **change}))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    ok = post(server, "/v1/completions", json.dumps(GOOD))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b"", b'"prompt"'])
def test_malformed_body_is_a_400(server, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_oversized_body_is_a_413_with_or_without_content_length(server):
    big = json.dumps({**GOOD, "prompt": "x" * ((1 << 20) + 32 * MAX_MODEL_LEN)}).encode()
    for content in (big, iter([big[i:i + 65536] for i in range(0, len(big), 65536)])):
        r = httpx.post(server.base + "/v1/completions", content=content, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert post(server, "/v1/completions", json.dumps(GOOD)).status_code == 200


def test_bad_chat_requests(server):
    for body, param in [({"model": "m"}, "messages"),
                        ({"model": "m", "messages": "hi"}, "messages"),
                        ({"model": "m", "messages": [{"role": "user"}]}, "messages"),
                        ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 0}, "max_tokens")]:
        r = post(server, "/v1/chat/completions", json.dumps(body))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_vllm_bench_client_fields_are_accepted(server):
    body = {**GOOD, "repetition_penalty": 1.0, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "unknown_field": 3}
    r = post(server, "/v1/completions", json.dumps(body))
    events = [x for x in r.text.split("\n\n") if x]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] == 2


# -- disconnects ------------------------------------------------------------------------------


def aborted(server) -> float:
    return server.metrics().get('nanoserve:request_success_total{finished_reason="abort"}', 0)


def test_disconnect_mid_stream_aborts(server):
    before = aborted(server)
    body = {**GOOD, "max_tokens": MAX_MODEL_LEN - 10, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.base + "/v1/completions",
                                                 json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few events, then leave
        assert any(x.startswith("data: ") for x in got)
    server.wait_idle()
    assert aborted(server) == before + 1


def test_disconnect_mid_answer_aborts(server):
    before = aborted(server)
    body = {**GOOD, "max_tokens": MAX_MODEL_LEN - 10, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up before the answer
        httpx.post(server.base + "/v1/completions", json=body, timeout=0.5)
    server.wait_idle()
    assert aborted(server) == before + 1


# -- many clients at once -----------------------------------------------------------------


async def one_client(server, i: int, rng: random.Random, kind: str, job) -> tuple[str, object]:
    body = {"model": "m", "prompt": job[0], "max_tokens": job[1], "temperature": 0,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.sleep(rng.random() * 0.5)  # arrivals spread over time
        if kind == "bad":
            r = await c.post(server.base + "/v1/completions", json={**body, "temperature": -1})
            return kind, r.status_code
        if kind == "disconnect":
            leave_after = rng.randint(1, 8)
            async with c.stream("POST", server.base + "/v1/completions",
                                json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    leave_after -= line.startswith("data: ")
                    if leave_after == 0:
                        break
            return kind, r.status_code
        if i % 2:
            r = await c.post(server.base + "/v1/completions", json=body)
            return kind, (r.status_code, r.json()["choices"][0]["text"] if r.is_success else r.text)
        text = ""
        async with c.stream("POST", server.base + "/v1/completions",
                            json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return kind, (r.status_code, text)


def test_64_concurrent_clients(server, ref_llm):
    rng = random.Random(0)
    jobs = []
    for i in range(64):
        n = rng.randint(3, 120)
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(n)] if i % 3 else \
            " ".join(rng.choice(["hello", "world", "phở", "cà phê", "🍜", "serve"])
                     for _ in range(n // 3 + 1))
        jobs.append((prompt, rng.randint(1, 48)))
    kinds = ["good"] * 52 + ["disconnect"] * 6 + ["bad"] * 6
    rng.shuffle(kinds)
    want = {i: o.text for i, o in zip(range(64), ref_llm.generate(
        [j[0] for j in jobs], [greedy(j[1]) for j in jobs], use_tqdm=False))}

    async def round_() -> list:
        return await asyncio.wait_for(asyncio.gather(*(
            one_client(server, i, rng, kinds[i], jobs[i]) for i in range(64))), 300)

    rss = []
    for _ in range(3):
        results = asyncio.run(round_())
        for i, (kind, res) in enumerate(results):
            if kind == "good":
                assert res == (200, want[i]), (i, res, want[i])
            elif kind == "bad":
                assert res == 400
            else:
                assert res == 200
        server.wait_idle()
        rss.append(server.rss_mib())
    assert rss[2] - rss[0] < 64, rss  # flat: the second and third rounds allocate nothing new


# -- the bundled model: real text ---------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_server():
    s = ServerProcess(default_model_dir(), ["--dtype", "float32", "--max-model-len", "512"])
    yield s
    s.stop()


@pytest.mark.slow
@pytest.mark.parametrize("content", ["Viết một câu chào bằng tiếng Việt có dấu.",
                                     "Reply with three emoji about food 🍜🍕"])
def test_stream_emoji_and_vietnamese_without_fffd(bundled_server, content):
    client, messages = bundled_server.client(), [{"role": "user", "content": content}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=40,
                                           temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=40,
                                                 temperature=0, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == whole
    # Only a character cut by max_tokens may end the answer as U+FFFD (as generate()'s text).
    assert all("\ufffd" not in p for p in pieces[:-1]) and "\ufffd" not in pieces[-1][:-1]
    assert not pieces[-1].endswith("\ufffd") or chunks[-1].choices[0].finish_reason == "length"
    assert any(ord(ch) > 127 for ch in whole)  # the answer has non-ASCII characters


@pytest.mark.slow
def test_stop_string_never_leaks_into_the_stream(bundled_server):
    client, prompt = bundled_server.client(), "The three primary colors are"
    whole = client.completions.create(model="m", prompt=prompt, max_tokens=40,
                                      temperature=0).choices[0].text
    tok = AutoTokenizer.from_pretrained(default_model_dir())  # where the tokens split
    ids = tok.encode(whole)
    ends = [len(tok.decode(ids[:k + 1])) for k in range(len(ids))]
    b = next(e for e in ends[2:] if 2 <= e <= len(whole) - 2 and whole[e - 2:e + 2].strip()
             and whole.find(whole[e - 2:e + 2]) == e - 2)
    stop = whole[b - 2:b + 2]  # two characters of one token, two of the next
    sent = ""
    for c in client.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0,
                                       stop=[stop], stream=True):
        sent += c.choices[0].text
        assert whole[:b - 2].startswith(sent)
        last = c.choices[0]
    assert sent == whole[:b - 2] and last.finish_reason == "stop"
    assert last.model_dump()["stop_reason"] == stop
    bundled_server.wait_idle()


# -- API key and shutdown -------------------------------------------------------------------


def test_api_key_sigterm_and_trace_file(tmp_path):
    """401 without the key; SIGTERM lets the in-flight request finish, then exit 0; the served
    steps are in --trace-file, which scripts/reader/trace_page.py reads."""
    trace = tmp_path / "served.jsonl"
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN),
                      [*TINY_FLAGS, "--api-key", "sesame", "--trace-file", str(trace)])
    try:
        for key in ("wrong", None):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            r = post(s, "/v1/completions", json.dumps(GOOD), headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
            assert httpx.get(s.base + "/v1/models", headers=headers).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model="m", prompt="hi")
        client = s.client(api_key="sesame")
        assert client.models.list().data[0].id == "m"
        stream = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=300,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        s.proc.send_signal(signal.SIGTERM)  # in flight: it must still finish
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(bool(c.choices[0].text) for c in chunks) >= 1
        assert s.proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(s.base + "/health", timeout=2)
    finally:
        s.stop()
    [run] = read_runs(trace)
    assert run["header"]["source"] == "serve" and len(run["steps"]) >= 300
    assert [f["reason"] for st in run["steps"] for f in st["finished"]] == ["length"]
    assert all(a["t_s"] <= b["t_s"] for a, b in zip(run["steps"], run["steps"][1:]))
    assert "__TRACE_DATA__" not in build_page([run], "served")


def test_console_script_help():
    exe = Path(sys.executable).with_name("nanoserve")
    out = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True,
                         timeout=120, env={**os.environ})
    assert out.returncode == 0 and "--max-num-seqs" in out.stdout and "--api-key" in out.stdout
