"""Big bodies checked by a helper process first (nanoserve/entrypoints/body_checker.py, issue
38): each refused one is the same 400 naming the field as a small one would be, a valid one is
served, the helper is a child without torch that ends with the server, and if it dies the
server checks bodies itself. Also: the `stop` cap counts before it adds up lengths."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from nanoserve.entrypoints.body_checker import BIG_BYTES, BodyChecker
from nanoserve.entrypoints.protocol import APIError
from nanoserve.entrypoints.validation import COMPLETION, MAX_STOP_STRINGS, check_stop
from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, TINY_FLAGS, ServerProcess, post

GOOD = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = "x" * (100 * MAX_MODEL_LEN)  # too long for the context, whatever its tokens (<= 81)
PAD = b" " * BIG_BYTES  # whitespace: the same JSON, a big body
BIG_BAD = [  # (path, body, param): each over BIG_BYTES
    ("/v1/completions", json.dumps({**GOOD, "stop": [f"s{i}" for i in range(20000)]}), "stop"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": TEXT}), "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": [TEXT[:40000]] * 2}), "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": [1.5] * 20000}), "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": "a\ud800" + TEXT}), "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "logit_bias": {str(i): 1 for i in range(9000)}}),
     "logit_bias"),
    ("/v1/completions", '{"prompt": ' + "[" * 40000 + "]" * 40000 + "}", None),
    ("/v1/completions", "[" + "1, " * 30000 + "1]", None),
    ("/v1/chat/completions", json.dumps(
        {**CHAT, "messages": [{"role": "user", "content": TEXT}]}), "messages"),
    ("/v1/chat/completions", json.dumps(
        {**CHAT, "messages": [{"role": "user", "content": None, "x": TEXT}]}), "messages"),
    ("/tokenize", json.dumps({"prompt": TEXT, "return_token_strs": 1}), "return_token_strs"),
    ("/tokenize", json.dumps({"messages": [{"role": "user", "content": TEXT}], "prompt": "a"}),
     "prompt"),
    ("/detokenize", json.dumps({"tokens": [1.5] * 20000}), "tokens"),
    ("/v1/responses", json.dumps({"input": TEXT, "instructions": "be brief"}), "input"),
    ("/v1/responses", json.dumps({"input": [{"role": "user", "content": "hi", "x": TEXT}],
                                  "previous_response_id": "resp_1"}), "previous_response_id"),
]


class Uncountable(str):
    def __len__(self) -> int:
        raise AssertionError("a stop string's length was read past the cap")


def test_the_stop_cap_counts_the_strings_before_their_characters():
    """110,000 stop strings are refused without adding up their lengths (O(cap), not O(n))."""
    with pytest.raises(APIError, match=f"at most {MAX_STOP_STRINGS} strings") as e:
        check_stop([Uncountable("s")] * (MAX_STOP_STRINGS + 1), None)
    assert e.value.param == "stop"


@pytest.mark.parametrize("path, body, param", BIG_BAD, ids=[b[2] or "json" for b in BIG_BAD])
def test_a_big_bad_body_is_a_400_naming_the_field(server, path, body, param):
    assert len(body) >= BIG_BYTES
    r = post(server, path, body.encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_big_valid_bodies_are_served(server):
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        r = post(server, path, json.dumps(body).encode() + PAD)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    r = post(server, "/v1/responses", json.dumps({"input": "hi", "max_output_tokens": 2,
                                                  "ignore_eos": True}).encode() + PAD)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2, r.text
    for path, body, key in (("/tokenize", {"prompt": "hi " * 30000}, "count"),  # (no length
                            ("/detokenize", {"tokens": [5] * 20000}, "prompt")):  # bound)
        r = post(server, path, json.dumps(body).encode())
        assert r.status_code == 200 and r.json()[key], r.text


def test_the_helper_alone_answers_without_torch_and_can_be_lost(caplog):
    """The helper process itself, no server: a refusal, an acceptance, no torch loaded; once it
    is killed, no answer (None: the server then parses every body itself) and a warning. (A
    helper that dies at start, as it did once when validation.py came to import torch through
    the engine thread, leaves the server parsing every body itself: this shows it.)"""
    async def exchange():
        checker = BodyChecker(longest_token=10, max_model_len=MAX_MODEL_LEN)
        await checker.start()
        try:
            refused = await checker.refusal(BIG_BAD[0][1].encode(), COMPLETION)
            accepted = await checker.refusal(json.dumps(GOOD).encode() + PAD, COMPLETION)
            alive = checker.proc is not None
            maps = Path(f"/proc/{checker.proc.pid}/maps").read_text() if alive else ""
            if alive:
                checker.proc.kill()
                await checker.proc.wait()
            lost = await checker.refusal(BIG_BAD[0][1].encode(), COMPLETION)
        finally:
            await checker.close()
        return refused, accepted, alive, maps, lost

    refused, accepted, alive, maps, lost = asyncio.run(exchange())
    assert alive and refused is not None and refused.param == "stop", refused
    assert accepted is None and lost is None
    assert "pydantic" in maps and "libtorch" not in maps
    assert "the body checker is gone" in caplog.text


def children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d.name))
    return found


def test_the_servers_helper_answers_has_no_torch_and_ends_with_the_server():
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), TINY_FLAGS)
    try:
        [helper] = children(s.proc.pid)
        r = post(s, BIG_BAD[0][0], BIG_BAD[0][1].encode())  # answered by the helper
        assert r.status_code == 400 and "the body checker is gone" not in s.log(), s.log()
        assert "libtorch" not in Path(f"/proc/{helper}/maps").read_text()
    finally:
        assert s.stop() == 0
    deadline = time.monotonic() + 10
    while Path(f"/proc/{helper}").exists():  # (ended, and reaped by the server)
        assert time.monotonic() < deadline, "the helper outlived the server"
        time.sleep(0.05)
