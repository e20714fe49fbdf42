"""What LLM.generate and LLM.chat take as a prompt (entrypoints/prompts.py): text, token ids,
vLLM's prompt dicts, conversations through the chat template; each form the same request as the
token ids it stands for. Bad prompts: test_validation.py."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from nanoserve import LLM, SamplingParams
from tests.common.tiny_model import tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_model_dir(), num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_dir())


def template_ids(tokenizer, conversation, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False,
                                         **{"add_generation_prompt": True, **kwargs})


def test_chat_is_generate_on_the_templates_token_ids(llm, tokenizer):
    ids = [template_ids(tokenizer, c) for c in CONVERSATIONS]
    expected = llm.generate(ids, GREEDY, use_tqdm=False)
    outputs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == ids  # in order, special tokens once
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert outputs[0].prompt == tokenizer.apply_chat_template(
        CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)
    # one conversation alone is one output; OpenAI's text parts are their texts on lines of
    # their own (vLLM's "\n".join for a template that takes a string)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                          {"type": "text", "text": "the capital of France?"}]}]
    lines = [{"role": "user", "content": "What is\nthe capital of France?"}]
    [one] = llm.chat(parts, GREEDY, use_tqdm=False)
    [two] = llm.chat(lines, GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == template_ids(tokenizer, lines) == two.prompt_token_ids
    assert one.token_ids == two.token_ids


def test_developer_messages_are_system_ones_where_the_template_has_no_such_role(llm, tokenizer):
    """vLLM's: the bundled template knows no "developer" role, so such a message is a system
    one; and where the system messages are then more than one, or not first, one, first."""
    assert "developer" not in tokenizer.chat_template
    cases = [([{"role": "developer", "content": "Be brief."}, *CONVERSATIONS[0]],
              [{"role": "system", "content": "Be brief."}, *CONVERSATIONS[0]]),
             ([{"role": "system", "content": "A."}, *CONVERSATIONS[0],
               {"role": "developer", "content": "B."}, {"role": "user", "content": "Hi!"}],
              [{"role": "system", "content": "A.\n\nB."}, *CONVERSATIONS[0],
               {"role": "user", "content": "Hi!"}])]
    for given, meant in cases:
        [out] = llm.chat(given, GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == template_ids(tokenizer, meant)
    # a template that names the role gets it as sent
    own = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{# 'developer' #}"
    [out] = llm.chat(cases[1][0], GREEDY, chat_template=own, use_tqdm=False)
    assert out.prompt == "system:A.;user:What is the capital of France?;developer:B.;user:Hi!;"


def test_messages_reach_the_template_as_vllm_hands_them(llm):
    """vLLM's: an assistant's reasoning is also its reasoning_content (Qwen3's templates read
    that); a tool's tool_call_id and a name are kept, any other key dropped. (transformers adds
    `thinking` from the reasoning: not counted.)"""
    own = ("{% for m in messages %}{{ m.content }}:{{ m | dictsort | map('first') | "
           "reject('equalto', 'thinking') | join(',') }};{% endfor %}")
    messages = [{"role": "user", "content": "", "extra": 1},
                {"role": "assistant", "content": "x", "reasoning": "r", "refusal": None},
                {"role": "tool", "content": "3", "tool_call_id": "c", "name": "f"}]
    [out] = llm.chat(messages, GREEDY, chat_template=own, add_generation_prompt=False,
                     use_tqdm=False)
    assert out.prompt == (":content,role;x:content,reasoning,reasoning_content,"
                          "role;3:content,name,role,tool_call_id;")


def test_chat_continues_the_final_message(llm, tokenizer):
    conversation = [*CONVERSATIONS[0], {"role": "assistant", "content": "The capital is"}]
    [out] = llm.chat(conversation, GREEDY, add_generation_prompt=False,
                     continue_final_message=True, use_tqdm=False)
    assert out.prompt.endswith("The capital is")
    assert out.prompt_token_ids == template_ids(tokenizer, conversation,
                                                add_generation_prompt=False,
                                                continue_final_message=True)
    [plain] = llm.chat(CONVERSATIONS[0], GREEDY, add_generation_prompt=False, use_tqdm=False)
    assert not plain.prompt.endswith("assistant\n")


def test_prompt_dicts_are_the_prompts_they_hold(llm):
    text, ids = "The quick brown fox", [3, 1, 4, 1, 5, 9]
    expected = [o.token_ids for o in llm.generate([text, ids], GREEDY, use_tqdm=False)]
    dicts = [{"prompt": text}, {"prompt_token_ids": ids}]
    assert [o.token_ids for o in llm.generate(dicts, GREEDY, use_tqdm=False)] == expected
    [alone] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert alone.token_ids == expected[1] and alone.prompt is None
    request_id = llm.add_request({"prompt": text}, GREEDY)
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert [(o.request_id, o.prompt, o.token_ids) for o in outputs] == \
        [(request_id, text, expected[0])]


def test_get_tokenizer_renders_what_chat_sends(llm):
    """vLLM's idiom: llm.get_tokenizer().apply_chat_template(...), then generate the text."""
    text = llm.get_tokenizer().apply_chat_template(CONVERSATIONS[1], tokenize=False,
                                                   add_generation_prompt=True)
    [chat] = llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False)
    assert text == chat.prompt
    assert llm.get_tokenizer().encode(text, add_special_tokens=False) == chat.prompt_token_ids


def test_chat_template_renders_in_place_of_the_models(llm, tokenizer):
    """vLLM's LLM.chat(chat_template=...): a base model's conversations, or another format."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    [out] = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template=template)
    assert out.prompt == "[user] What is the capital of France?\n"
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)


def test_chats_own_arguments_win_over_chat_template_kwargs(llm, tokenizer):
    """vLLM's merge: add_generation_prompt, continue_final_message and tokenize in
    chat_template_kwargs give way to the arguments (they used to be passed twice: an error)."""
    kwargs = {"add_generation_prompt": False, "continue_final_message": True, "tokenize": True}
    [out] = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)
    assert out.prompt_token_ids == template_ids(tokenizer, CONVERSATIONS[0])
