"""vLLM's server flags for where and how it listens, and for what shapes the answers
(nanoserve/entrypoints/cli_args.py, launcher.py), each served on the bundled model:
- --api-key with several keys (any of them), --disable-fastapi-docs (FastAPI's /docs gone),
  --enable-log-requests (a line a prompt); vLLM's spellings of the flags (4k, -tp, --config);
- --served-model-name with several names: each listed and taken, answers carrying the first;
- --default-chat-template-kwargs under each request's (chat, /tokenize), --exclude-tools-when-
  tool-choice-none (the template not shown the tools), --enable-force-include-usage (a stream
  says its usage unasked, each chunk too);
- --uds (a Unix socket), --ssl-keyfile / --ssl-certfile (HTTPS, the real `openai` client
  trusting the certificate), --root-path (behind a proxy's prefix): all three on one server;
- --tokenizer (a folder of its own: its chat template is the one used); --response-role, and
  the last message's role where no generation prompt is added (vLLM's)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from nanoserve.entrypoints.bundled import default_model_dir
from nanoserve.entrypoints.cli_args import parse_args
from nanoserve.entrypoints.launcher import address
from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import ServerProcess, post

# shows the template's options, and the tools it is given
TEMPLATE = ("{{ 'mood=' ~ (mood if mood is defined else '-') ~ ';' }}"
            "{{ 'tools=' ~ (tools | length if tools else 0) ~ ';' }}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
HI = [{"role": "user", "content": "Hi"}]
FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--api-key", "key-a", "key-b",
         "--disable-fastapi-docs", "--default-chat-template-kwargs", '{"mood": "calm"}',
         "--exclude-tools-when-tool-choice-none", "--enable-force-include-usage",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--response-role", "model",
         "--served-model-name", "m", "alias",  # (over the harness's "m")
         "--enable-log-requests", "--max-log-len", "3", "--max-logprobs", "2"]


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    template = tmp_path_factory.mktemp("flags") / "t.jinja"
    template.write_text(TEMPLATE)
    s = ServerProcess(default_model_dir(), [*FLAGS, "--chat-template", str(template)])
    yield s
    assert s.stop() == 0


def rendered(server, body: dict, key: str = "key-a") -> str:
    """The prompt text the chat endpoint gave the engine (its ids, decoded by /detokenize)."""
    auth = {"authorization": f"Bearer {key}"}
    out = post(server, "/v1/chat/completions", json.dumps(
        {"messages": HI, "max_tokens": 1, "return_token_ids": True, **body}), auth)
    assert out.status_code == 200, out.text
    text = post(server, "/detokenize", json.dumps({"tokens": out.json()["prompt_token_ids"]}),
                auth).json()["prompt"]
    return text[:text.index("<|im_start|>")]


def test_any_of_the_api_keys_opens_it(flagged):
    for key in ("key-a", "key-b"):
        assert flagged.client(api_key=key).models.list().data[0].id == "m"
    for auth in ("Bearer key-c", "Bearer key-a key-b", "Bearer key-", "", "Basic key-a"):
        r = post(flagged, "/v1/completions", '{"prompt": "a", "max_tokens": 1}',
                 {"authorization": auth})
        assert r.status_code == 401, auth
    # the scheme in any case, as vLLM (and RFC 7235) take it
    r = post(flagged, "/v1/completions", '{"prompt": "a", "max_tokens": 1}',
             {"authorization": "bearer key-b"})
    assert r.status_code == 200, r.text


def test_each_prompt_is_logged_with_enable_log_requests(flagged):
    """vLLM's --enable-log-requests, with --max-log-len 3: a line a prompt on stderr."""
    out = flagged.client(api_key="key-a").completions.create(model="m", prompt=[5, 6, 7, 8, 9],
                                                             max_tokens=1)
    [line] = [line for line in flagged.log().splitlines() if out.id in line]
    assert f"request {out.id}-0: prompt_token_ids [5, 6, 7], SamplingParams(" in line


def test_max_logprobs_caps_what_a_request_asks(flagged):
    """vLLM's --max-logprobs (here 2): more is a 400 naming the request's field."""
    body = {"model": "m", "prompt": "a", "max_tokens": 1}
    auth = {"authorization": "Bearer key-a"}
    ok = post(flagged, "/v1/completions", json.dumps({**body, "logprobs": 2}), auth)
    assert len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2
    r = post(flagged, "/v1/completions", json.dumps({**body, "logprobs": 3}), auth)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "logprobs")
    assert "at most 2 (--max-logprobs), got 3" in r.json()["error"]["message"]


def test_vllm_spellings_of_the_flags(tmp_path, monkeypatch):
    """What vLLM's parser takes: 4k / 4K / auto, -tp, underscores, --no- forms, a YAML --config
    under the command line, VLLM_API_KEY where --api-key is not given; and what LLM takes of
    them (dtype half, the pool in bytes, threshold 0: off). A hub id is refused, named."""
    import huggingface_hub

    from nanoserve import LLM
    from nanoserve.entrypoints.cli_args import engine_config
    from nanoserve.entrypoints.llm import vllm_spellings

    args = parse_args(["--max_model_len", "4k", "--max-num-batched-tokens", "2K", "-tp", "2",
                       "--no-enforce-eager", "--kv-cache-memory-bytes", "1G", "--dtype", "half",
                       "--long-prefill-token-threshold", "0", "--no-disable-log-stats"])
    assert (args.max_model_len, args.max_num_batched_tokens, args.tensor_parallel_size,
            args.enforce_eager, args.disable_log_stats) == (4000, 2048, 2, False, False)
    config = vllm_spellings(engine_config(args))
    assert (config["dtype"], config["kv_cache_memory_gib"], config["long_prefill_token_threshold"],
            "kv_cache_memory_bytes" in config) == ("float16", 1.0, None, False)
    assert vllm_spellings({"trust_remote_code": True}) == {}  # a no-op, offline as served
    assert [parse_args(["--max-model-len", v]).max_model_len for v in ("auto", "-1", "25.6k")] \
        == [None, None, 25600]
    for bad in (["--max-model-len", "4x"], ["--uvicorn-log-level", "loud"], ["--tp", "2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    (tmp_path / "c.yaml").write_text("max_model_len: 300\nenforce-eager: true\nport: 9000\n"
                                     "served-model-name: [a, b]\n")
    args = parse_args([f"--config={tmp_path / 'c.yaml'}", "--port", "9001"])
    assert (args.max_model_len, args.enforce_eager, args.served_model_name, args.port) == (
        300, True, ["a", "b"], 9001)
    with pytest.raises(SystemExit, match="no-such.yaml"):
        parse_args(["--config", "no-such.yaml"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    assert parse_args([]).api_key == ["secret"] and parse_args(["--api-key", "k"]).api_key == ["k"]
    with pytest.raises(ValueError, match="model must be None .* got 'Qwen/Qwen3-0.6B'"):
        LLM("Qwen/Qwen3-0.6B")  # not in the (empty) cache: nothing is downloaded
    # a hub id already in the local cache is its snapshot there
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_model_dir(), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    assert LLM("org/tiny", num_kv_blocks=8, block_size=16).model_dir == str(snapshot)


def test_every_served_name_is_listed_and_taken(flagged):
    """vLLM's: /v1/models lists each name; a request may give any of them (or none, or ""),
    and the answer carries the first; another name is a 404 naming `model`."""
    client = flagged.client(api_key="key-b")
    assert [m.id for m in client.models.list().data] == ["m", "alias"]
    assert client.completions.create(model="alias", prompt="a", max_tokens=1).model == "m"
    assert client.chat.completions.create(model="alias", messages=HI, max_tokens=1).model == "m"
    auth = {"authorization": "Bearer key-b"}
    for model in ("alias", "", None):
        body = {"prompt": "a", "max_tokens": 1} | ({} if model is None else {"model": model})
        for path in ("/v1/completions", "/tokenize"):
            assert post(flagged, path, json.dumps(body), auth).status_code == 200, (path, model)
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/tokenize", {"prompt": "a"}),
                       ("/detokenize", {"tokens": [5]}),
                       ("/v1/chat/completions", {"messages": HI})):
        r = post(flagged, path, json.dumps(body | {"model": "alias2"}), auth)
        assert (r.status_code, r.json()["error"]["param"]) == (404, "model"), path


def test_fastapi_docs_are_served_unless_disabled(flagged, server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.base + path).status_code == 200
        assert httpx.get(flagged.base + path).status_code == 404


def test_the_template_options_and_tools_the_flags_give(flagged):
    assert rendered(flagged, {}) == "mood=calm;tools=0;"
    assert rendered(flagged, {"chat_template_kwargs": {"mood": "glad"}}) == "mood=glad;tools=0;"
    assert rendered(flagged, {"tools": TOOLS}, "key-b") == "mood=calm;tools=1;"
    assert rendered(flagged, {"tools": TOOLS, "tool_choice": "none"}) == "mood=calm;tools=0;"
    counted = post(flagged, "/tokenize", json.dumps({"messages": HI}),
                   {"authorization": "Bearer key-a"}).json()
    text = post(flagged, "/detokenize", json.dumps({"tokens": counted["tokens"]}),
                {"authorization": "Bearer key-a"}).json()["prompt"]
    assert text.startswith("mood=calm;")


def test_every_stream_says_its_usage(flagged):
    client = flagged.client(api_key="key-a")
    chunks = list(client.completions.create(model="m", prompt="The sea", max_tokens=4,
                                            stream=True, temperature=0))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert [c.usage.completion_tokens for c in chunks if c.choices] == [1, 2, 3, 4]


def self_signed(folder) -> tuple[str, str]:
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    return str(key), str(cert)


def test_https_on_a_unix_socket_behind_a_root_path(tmp_path):
    """The three at once (one start): TLS over the socket, the real client trusting the
    certificate; nothing on the port, plain HTTP not answered."""
    key, cert = self_signed(tmp_path)
    socket_path = str(tmp_path / "nanoserve.sock")
    s = ServerProcess(default_model_dir(), ["--dtype", "float32", "--max-model-len", "512",
                                            "--ssl-keyfile", key, "--ssl-certfile", cert,
                                            "--root-path", "/llm"], uds=socket_path, cafile=cert)
    try:
        with s.http() as http:
            out = s.client(http_client=http).completions.create(
                model="m", prompt="The sea is", max_tokens=3, temperature=0)
            assert out.usage.completion_tokens == 3
            assert http.get(s.base + "/openapi.json").json()["servers"] == [{"url": "/llm"}]
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path)) as plain, \
                pytest.raises(httpx.TransportError):  # plain HTTP is not answered
            plain.get("http://127.0.0.1/health", timeout=5)
        with pytest.raises(httpx.TransportError):  # nothing on the port
            httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5)
        assert f"unix:{socket_path}" in s.log()
    finally:
        assert s.stop() == 0
    https = parse_args(["--ssl-keyfile", key, "--ssl-certfile", cert, "--root-path", "/llm"])
    assert address(https) == "https://127.0.0.1:8000/llm/v1"  # the start-up line on a port


def test_a_tokenizer_folder_of_its_own(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_dir()) / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "mine:{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    s = ServerProcess(default_model_dir(), ["--dtype", "float32", "--max-model-len", "512",
                                            "--tokenizer", str(tmp_path)])
    try:
        ids = post(s, "/tokenize", json.dumps({"messages": HI})).json()["tokens"]
        text = post(s, "/detokenize", json.dumps({"tokens": ids})).json()["prompt"]
        assert text == "mine:Hi"
        out = s.client().chat.completions.create(model="m", messages=HI, max_tokens=2)
        assert out.usage.prompt_tokens == len(ids)
    finally:
        assert s.stop() == 0


def test_the_answers_role(flagged, server):
    """vLLM's: --response-role after a generation prompt, else the last message's role."""
    client = flagged.client(api_key="key-a")
    whole = client.chat.completions.create(model="m", messages=HI, max_tokens=2)
    assert whole.choices[0].message.role == "model"
    first = next(iter(client.chat.completions.create(model="m", messages=HI, max_tokens=2,
                                                     stream=True)))
    assert first.choices[0].delta.role == "model"
    body = {"messages": [*HI, {"role": "assistant", "content": "Hello"}], "max_tokens": 2,
            "add_generation_prompt": False, "continue_final_message": True}
    out = post(server, "/v1/chat/completions", json.dumps(body)).json()
    assert out["choices"][0]["message"]["role"] == "assistant"
    user = post(server, "/v1/chat/completions", json.dumps(
        {"messages": HI, "max_tokens": 2, "add_generation_prompt": False})).json()
    assert user["choices"][0]["message"]["role"] == "user"
