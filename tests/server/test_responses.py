"""POST /v1/responses against the real `openai` client's `responses` API: the output text is what
`LLM.generate` gives for the same conversation through the chat template (instructions a system
message; earlier output messages sent back as input), streamed or not; the status says why it
ended, the usage counts; logprobs are the chat endpoint's; what nanoserve cannot honour is a 400
naming the field; a client that leaves mid-stream aborts its request, also among many at once."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest

from nanoserve import SamplingParams
from tests.server.harness import MAX_MODEL_LEN, post


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def chat_ids(llm, messages: list[dict]) -> list[int]:
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)


def test_a_text_input_is_one_user_message_streamed_or_not(server, ref_llm):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about Hanoi"}]
    ids = chat_ids(ref_llm, messages)
    [ref] = ref_llm.generate([ids], greedy(12), use_tqdm=False)
    client = server.client()
    kw = {"model": "m", "input": "Tell me about Hanoi", "instructions": "Be brief.",
          "max_output_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    out = client.responses.create(**kw)
    assert out.output_text == ref.text and out.object == "response"
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    [message] = out.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "incomplete")
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) \
        == (len(ids), 12, len(ids) + 12)
    assert out.instructions == "Be brief." and out.max_output_tokens == 12
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events[4:-4]) == ref.text == events[-4].text
    assert events[-1].response.output_text == ref.text
    assert events[-1].response.status == "incomplete"  # (vLLM's last event whatever the status)
    usage = events[-1].response.usage
    assert usage.output_tokens == 12 and usage.input_tokens == len(ids)
    # the same prompt again: its full 16-token blocks come from the prefix cache
    assert usage.input_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1


def test_a_conversation_sent_back_continues_it(server, ref_llm):
    """A client keeps the conversation: the first answer's output items go back in `input`,
    then a user turn; the prompt is the chat template's on all three."""
    client = server.client()
    first = client.responses.create(model="m", input=[{"role": "user", "content": "Hi there"}],
                                    max_output_tokens=5, temperature=0)
    ids = chat_ids(ref_llm, [{"role": "user", "content": "Hi there"}])
    assert first.output_text == ref_llm.generate([ids], SamplingParams(
        temperature=0, max_tokens=5), use_tqdm=False)[0].text
    turns = [{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]},
             *[item.model_dump() for item in first.output],
             {"type": "message", "role": "user", "content": "And then?"}]
    again = client.responses.create(model="m", input=turns, max_output_tokens=6,
                                    temperature=0, extra_body={"ignore_eos": True})
    ids = chat_ids(ref_llm, [{"role": "user", "content": "Hi there"},
                             {"role": "assistant", "content": first.output_text},
                             {"role": "user", "content": "And then?"}])
    [ref] = ref_llm.generate([ids], greedy(6), use_tqdm=False)
    assert again.output_text == ref.text and again.usage.input_tokens == len(ids)


def test_a_stop_ends_it_completed(server, ref_llm):
    ids = chat_ids(ref_llm, [{"role": "user", "content": "Count"}])
    [ref] = ref_llm.generate([ids], greedy(8), use_tqdm=False)
    stop = ref.text[3:6]  # in the text: it ends there
    out = server.client().responses.create(model="m", input="Count", max_output_tokens=8,
                                           temperature=0, extra_body={"stop": [stop]})
    assert out.status == "completed" and out.incomplete_details is None
    assert out.output[0].status == "completed" and out.output_text == ref.text[:ref.text.find(stop)]


def same_as_chat(got: list[dict], expected: list[dict]) -> None:
    """The same tokens, ranks and bytes; the values to float32's last bits (the second request's
    prompt comes from the prefix cache, computed in other batches than the first's)."""
    def tokens(entries):
        return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]])
                for e in entries]

    def values(entries):
        return [v for e in entries for v in [e["logprob"], *(t["logprob"]
                                                             for t in e["top_logprobs"])]]

    assert tokens(got) == tokens(expected) and len(got) == 6
    assert values(got) == pytest.approx(values(expected), abs=1e-4)


def test_logprobs_are_the_chats(server):
    client = server.client()
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    expected = [c.model_dump() for c in chat.choices[0].logprobs.content]
    kw = {"model": "m", "input": messages, "max_output_tokens": 6, "temperature": 0,
          "include": ["message.output_text.logprobs"], "top_logprobs": 2,
          "extra_body": {"ignore_eos": True}}
    out = client.responses.create(**kw)
    same_as_chat([lp.model_dump() for lp in out.output[0].content[0].logprobs], expected)
    events = list(client.responses.create(**kw, stream=True))
    same_as_chat([lp.model_dump() for e in events if e.type == "response.output_text.delta"
                  for lp in e.logprobs], expected)
    plain = client.responses.create(model="m", input=messages, max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),  # auto
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
    ({"input": [{"role": "user"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": 7, "content": "x"}]}, "input"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": MAX_MODEL_LEN + 1}, "max_output_tokens"),
    ({"n": 2}, "n"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"instructions": 3}, "instructions"),
    ({"temperature": -1}, "temperature"),
    ({"model": "other"}, "model"),
])
def test_bad_input_names_the_field(server, body, param):
    r = post(server, "/v1/responses", json.dumps({"model": "m", "input": "hi", **body}))
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    ok = post(server, "/v1/responses", json.dumps({"input": "hi", "max_output_tokens": 2}))
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_leaving_mid_stream_aborts(server):
    def aborted(m):
        return m.get('nanoserve:request_success_total{finished_reason="abort"}', 0)

    before = aborted(server.metrics())
    body = {"input": "hi", "max_output_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.base + "/v1/responses",
                                                 json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(16)]  # past the first deltas, then leave
        assert "event: response.output_text.delta" in got
    server.wait_until(lambda m: aborted(m) == before + 1)
    server.wait_idle()


def test_many_clients_at_once_some_leaving(server, ref_llm):
    """24 clients of the async openai client at once, streamed or not, 6 leaving after a few
    deltas: each that stays gets LLM.generate's text; then nothing runs and every block is free."""
    rng = random.Random(1)
    jobs = [(f"Tell me about {rng.choice(['tea', 'rivers', 'phở', 'owls'])} {i}",
             rng.randint(2, 40)) for i in range(24)]
    leaving = set(rng.sample(range(24), 6))
    refs = ref_llm.generate([chat_ids(ref_llm, [{"role": "user", "content": text}])
                             for text, _ in jobs], [greedy(n) for _, n in jobs], use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        text, n = jobs[i]
        await asyncio.sleep(rng.random() * 0.3)
        kw = {"model": "m", "input": text, "max_output_tokens": n, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
        if i % 2 and i not in leaving:
            return (await client.responses.create(**kw)).output_text
        deltas = []
        async with await client.responses.create(**kw, stream=True) as stream:
            async for e in stream:
                if e.type == "response.output_text.delta":
                    deltas.append(e.delta)
                    if i in leaving and len(deltas) == 2:
                        return None
        return "".join(deltas)

    async def all_of_them() -> list:
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", timeout=60,
                                    max_retries=0)
        return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(24))), 240)

    got = asyncio.run(all_of_them())
    assert [g for i, g in enumerate(got) if i not in leaving] == \
        [r.text for i, r in enumerate(refs) if i not in leaving]
    server.wait_idle()
