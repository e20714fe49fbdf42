"""A request's prompts, read from its fields (§3: what the engine is given): a completion's
prompt or batch of them, chat's messages and the chat template's options, Responses' input items
as chat messages, /tokenize's either; and what each costs in characters, checked before the
tokenizer runs. A bad one is an APIError naming its field."""

from __future__ import annotations

from typing import Any, get_args

from nanoserve.entrypoints.protocol import (
    MAX_PROMPTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Effort,
    ResponsesRequest,
    TokenizeRequest,
)


def chat_message(message: dict, field: str = "messages", parts: tuple = ("text",),
                 label: str = "messages") -> dict:
    """A message as vLLM hands it to the chat template: its role, its content (text parts,
    {"type": "text", "text"} or Responses' `parts`, joined by newlines, as for a template that
    takes a string), an assistant's tool_calls (left for a template that renders them; its
    content may then be null, OpenAI's form, "" here) and reasoning (also as reasoning_content,
    Qwen3's name), a tool's tool_call_id and a name; vLLM drops any other key. A bad one is a
    400 naming `field` (vLLM takes a null content as "": OpenAI's API and nanoserve do not)."""
    role, content = message.get("role"), message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in parts
                                         and isinstance(p.get("text"), str) for p in content):
        content = "\n".join(p["text"] for p in content)
    if not isinstance(role, str) or not isinstance(content, str):
        raise APIError(f"{label} must each have a string role and a text content, got "
                       f"{message!r:.200}", field)
    kept = {"role": role, "content": content}
    if role == "assistant" and message.get("tool_calls") is not None:
        kept["tool_calls"] = message["tool_calls"]
    if role == "assistant" and message.get("reasoning") is not None:
        kept["reasoning"] = kept["reasoning_content"] = message["reasoning"]
    if role == "tool" and "tool_call_id" in message:
        kept["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        kept["name"] = message["name"]
    return kept


def completion_prompts(req: CompletionRequest) -> list:
    """A completion request's prompts: one text or token-id list, or a batch of them."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_PROMPTS:
            raise APIError(f"prompt must be at most {MAX_PROMPTS} prompts, got {len(prompt)}",
                           "prompt")
        if len(prompt) * req.n > MAX_PROMPTS:
            raise APIError(f"n must be at most {MAX_PROMPTS // len(prompt)} for a batch of "
                           f"{len(prompt)} prompts ({MAX_PROMPTS} completions a request), got "
                           f"{req.n}", "n")
        return prompt
    return [prompt]


def completion_chars(prompt: Any) -> int:
    return len(prompt) if isinstance(prompt, str) else 0


def chat_prompt(req: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    """The one prompt of a chat request: the messages (checked here, on the event loop) and the
    chat template's options, prompts.chat_prompts' arguments. vLLM's reasoning_effort goes to
    the template, over the request's own kwargs, and turns its thinking on (off: "none") where
    they do not say enable_thinking."""
    return [{"messages": [chat_message(m) for m in req.messages],
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
            "chat_template_kwargs": template_kwargs(req), "tools": req.tools}]


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest | ResponsesRequest
                    ) -> dict[str, Any] | None:
    kwargs = req.chat_template_kwargs
    if (effort := reasoning_effort(req)) is not None:
        kwargs = {"enable_thinking": effort != "none", **(kwargs or {}), "reasoning_effort": effort}
    return kwargs


def reasoning_effort(req: Any) -> str | None:
    """Chat's reasoning_effort, or Responses' reasoning.effort (no summary: none is written)."""
    if not isinstance(req, ResponsesRequest):
        return getattr(req, "reasoning_effort", None)
    options = req.reasoning or {}
    effort = options.get("effort")
    if set(options) - {"effort", "summary", "generate_summary"} or options.get("summary") \
            or options.get("generate_summary") or effort not in (None, *get_args(Effort)):
        raise APIError(f"reasoning must be {{\"effort\": one of {get_args(Effort)}}} (nanoserve "
                       f"writes no summaries), got {req.reasoning!r:.200}", "reasoning")
    return effort


def input_message(item: Any) -> dict:
    """A Responses `input` item as a chat message (chat_message's), its text parts "input_text"
    or an earlier answer's "output_text"; only its role and content go to the template. An
    earlier answer's "function_call" is an assistant's tool call, a "function_call_output" the
    tool's message, as chat's."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind == "function_call" and all(isinstance(item.get(k), str) for k in
                                       ("call_id", "name", "arguments")):
        return {"role": "assistant", "content": "", "tool_calls": [{
            "id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}]}
    if kind == "function_call_output" and all(isinstance(item.get(k), str) for k in
                                              ("call_id", "output")):
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    if kind != "message":
        raise APIError(f"input items must be messages, function calls (call_id, name, arguments) "
                       f"or their outputs (call_id, output), got {item!r:.200}", "input")
    message = chat_message({"role": item.get("role"), "content": item.get("content")}, "input",
                           ("input_text", "output_text"), "input messages")
    return {"role": message["role"], "content": message["content"]}


def responses_prompt(req: ResponsesRequest) -> list[dict]:
    """A Responses request's one prompt, as chat_prompt's: the instructions, then the input."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError("input must be a text or a non-empty list of messages, got []", "input")
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    return [{"messages": system + [input_message(m) for m in items],
             "add_generation_prompt": True, "continue_final_message": False,
             "chat_template_kwargs": template_kwargs(req), "tools": req.tools}]


def tokenize_prompts(req: TokenizeRequest) -> list:
    """A /tokenize request's one prompt: its text, or its conversation as chat_prompt's."""
    if (req.prompt is None) == (req.messages is None):
        raise APIError("prompt or messages must be given, not both nor neither", "prompt")
    return [req.prompt] if req.messages is None else chat_prompt(req)


def chat_chars(prompt: dict) -> int:
    return sum(len(m["content"]) for m in prompt["messages"])
