"""What `LLM.generate` and `LLM.chat` take as a prompt, as token ids: text, token ids, vLLM's
prompt dicts (`{"prompt": text}`, `{"prompt_token_ids": ids}`), or a conversation through the
model's chat template. Each bad prompt is a ValueError naming the field, before any engine state
changes (the engine only ever sees token ids: §3's request)."""

from __future__ import annotations

from typing import Any

from nanoserve.entrypoints.protocol import APIError
from nanoserve.entrypoints.request_prompts import chat_message
from nanoserve.entrypoints.tool_parser import check_tools, template_messages
from nanoserve.utils import as_token_id

Prompt = str | list[int] | dict


def prompt_tokens(prompt: Prompt, tokenizer: Any) -> tuple[list[int], str | None]:
    """(token ids, text or None). A dict is vLLM's TextPrompt or TokensPrompt; a TokensPrompt
    may carry the text it was made from under "prompt" (LLM.chat's do), for the output."""
    text = None
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"}:
            prompt = prompt["prompt"]
        elif "prompt_token_ids" in keys and keys <= {"prompt_token_ids", "prompt"}:
            prompt, text = prompt["prompt_token_ids"], prompt.get("prompt")
            if not isinstance(prompt, list):
                raise ValueError(f"prompt_token_ids must be a list of int token ids, got "
                                 f"{type(prompt).__name__}")
            if not isinstance(text, (str, type(None))):
                raise ValueError(f"prompt beside prompt_token_ids must be a str (the text they "
                                 f"were made from), got {type(text).__name__}")
        else:
            raise ValueError(f"prompt must be a str, a list of int token ids, or a dict with "
                             f"'prompt' or 'prompt_token_ids', got a dict with {sorted(keys)}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must have at least 1 token, got ''")
        if tokenizer is None:
            raise ValueError("prompt must be a list of token ids when skip_tokenizer_init "
                             "is True")
        return tokenizer.encode(prompt), prompt
    if not isinstance(prompt, list):
        raise ValueError(f"prompt must be a str or a list of int token ids, "
                         f"got {type(prompt).__name__}")
    token_ids = [as_token_id(t) for t in prompt]  # numpy integers are token ids, bools are not
    if None in token_ids:
        t = prompt[token_ids.index(None)]
        raise ValueError(f"prompt must be a str or a list of int token ids, got list "
                         f"containing {type(t).__name__} {t!r}")
    return token_ids, text


def developer_as_system(conversation: list[dict], template: Any) -> list[dict]:
    """vLLM's, for a template that never names the "developer" role (OpenAI's newer name for
    the system's): developer messages become system ones, and where a system message is then
    not first, or not alone, all of them become one, first, their texts joined by blank lines
    (some templates, Qwen's, take a system message first only)."""
    if not any(m["role"] == "developer" for m in conversation) or any(
            f"{quote}developer{quote}" in str(template) for quote in "'\""):
        return conversation
    conversation = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
                    if m["role"] == "developer" else m for m in conversation]
    if [i for i, m in enumerate(conversation) if m["role"] == "system"] == [0]:
        return conversation
    texts = [m["content"] for m in conversation if m["role"] == "system" and m["content"]]
    return [{"role": "system", "content": "\n\n".join(texts)},
            *(m for m in conversation if m["role"] != "system")]


def chat_prompts(messages: Any, tokenizer: Any, add_generation_prompt: bool,
                 continue_final_message: bool, chat_template_kwargs: dict | None,
                 chat_template: str | None = None, tools: list | None = None) -> list[dict]:
    """One TokensPrompt a conversation, as vLLM's LLM.chat renders it: `messages` is one
    conversation ([{"role", "content"}, ...], content a str or text parts) or a list of them;
    `chat_template` a Jinja template in place of the model's (None: the model's)."""
    if tokenizer is None:
        raise ValueError("messages need a tokenizer and its chat template (skip_tokenizer_init "
                         "is True)")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        messages = [messages]
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in messages):
        raise ValueError(f"messages must be a conversation (a non-empty list of message dicts) "
                         f"or a list of them, got {messages!r:.200}")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict or None, got "
                         f"{type(chat_template_kwargs).__name__}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"chat_template must be a str (a Jinja template) or None, got "
                         f"{type(chat_template).__name__}")
    # vLLM's merge_kwargs: the arguments win over the same keys in chat_template_kwargs (the
    # text is tokenized below, never by the template)
    chat_template_kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in (
        "add_generation_prompt", "continue_final_message", "tokenize")}
    if tools:  # OpenAI's, the chat template's `tools` argument
        try:
            chat_template_kwargs = {**chat_template_kwargs, "tools": check_tools(tools)}
        except APIError as e:
            raise ValueError(str(e)) from None
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message must be False when add_generation_prompt is "
                         "True (vLLM's rule: one or the other)")
    prompts = []
    for conversation in messages:
        try:
            conversation = developer_as_system(template_messages(
                [chat_message(m) for m in conversation]), chat_template or tokenizer.chat_template)
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                **chat_template_kwargs)
        except APIError as e:
            raise ValueError(str(e)) from None
        except Exception as e:  # a template error: the messages do not fit it
            raise ValueError(f"messages do not fit the chat template: {e}") from e
        # The template writes the special tokens itself (as tokenize=True encodes it).
        prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
                        "prompt": text})
    return prompts
