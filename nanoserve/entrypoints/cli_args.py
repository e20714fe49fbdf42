"""`nanoserve serve`'s flags (vLLM's entrypoints/openai/cli_args.py): the server's own (those
that shape the answers: ServingOptions), the HTTP
layer's limits (http_limits.py; vLLM's h11 names are aliases), and the engine's settings under
vLLM's names (engine_config: the LLM's settings from them); and the engine's thread count, from
--reserved-cpus."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import resource
import sys
from pathlib import Path
from typing import Any

import yaml

from nanoserve.config import EngineConfig
from nanoserve.entrypoints.http_limits import HttpLimits
from nanoserve.entrypoints.reasoning_parser import PARSERS as REASONING_PARSERS
from nanoserve.entrypoints.tool_parser import PARSERS

DESCRIPTION = "An OpenAI-compatible HTTP server on the chapter's loop (nanoserve/entrypoints/)."
SWITCH = {"action": argparse.BooleanOptionalAction, "default": False}  # vLLM's: --no-X too


@dataclasses.dataclass
class ServingOptions:
    """The server's flags that shape its answers (vLLM's names)."""

    prompt_tokens_details: bool = False  # usage's cached_tokens
    tool_call_parser: str | None = None  # chat's, with --enable-auto-tool-choice
    as_token_ids: bool = False  # --return-tokens-as-token-ids: the requests' default
    reasoning_parser: str | None = None  # chat's and Responses' (reasoning_parser.py)
    default_chat_template_kwargs: dict | None = None  # under each request's
    exclude_tools_when_tool_choice_none: bool = False
    force_include_usage: bool = False  # every stream's usage, each chunk's too
    response_role: str = "assistant"  # chat's answer's role, after a generation prompt
    max_tokens_cap: int | None = None  # vLLM's override_max_tokens (serving_options)
    log_requests: bool = False  # each prompt's token ids and params on stderr
    max_log_len: int | None = None  # of them, at most this many ids


def human_readable_int(value: str) -> int:
    """vLLM's: 4k is 4000, 25.6k 25600, 4K 4096 (k, m, g, t: powers of 1000; K, M, G, T: 1024)."""
    if not (match := re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value.strip())):
        return int(value)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)  # (vLLM's: no 1.5K either)


def model_len(value: str) -> int | None:
    """--max-model-len: vLLM's -1 or auto is the model's own (None: nanoserve's default)."""
    return None if value.strip().lower() in ("-1", "auto") else human_readable_int(value)


def vllm_flag_names(argv: list[str]) -> list[str]:
    """vLLM's parser takes --max_model_len for --max-model-len: the same here; and --config
    FILE, a YAML file of flags (a key each: `max-model-len: 4096`), under the command line's."""
    argv = [re.sub(r"^--[^=]*", lambda m: m.group().replace("_", "-"), a) for a in argv]
    argv = [part for a in argv for part in (a.split("=", 1) if a.startswith("--config=") else [a])]
    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return argv  # (argparse says what --config lacks)
    at = argv.index("--config")
    try:
        with open(argv[at + 1]) as f:
            settings = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        sys.exit(f"nanoserve serve: --config {argv[at + 1]}: {e}")
    if not isinstance(settings, dict):
        sys.exit(f"nanoserve serve: --config {argv[at + 1]} must hold a YAML mapping of flags")
    flags = []
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            values = value if isinstance(value, list) else [value]
            flags += [flag, *(v if isinstance(v, str) else json.dumps(v) for v in values)]
    return flags + argv[:at] + argv[at + 2:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanoserve serve", description=DESCRIPTION)
    p.add_argument("model", nargs="?", default=None, help="HF model directory (default: bundled)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the same, as `python -m vllm.entrypoints.openai.api_server` takes it")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names requests may give as `model` (default: the model's path); "
                        "answers carry the first")
    p.add_argument("--tokenizer", default=None,
                   help="a directory to load the tokenizer from, in place of the model's")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="required as 'Authorization: Bearer KEY' (any of them)")
    p.add_argument("--uds", default=None, help="listen on this Unix socket, not --host/--port")
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves it under")
    for flag in ("ssl-keyfile", "ssl-certfile", "ssl-ca-certs"):  # HTTPS (uvicorn's)
        p.add_argument(f"--{flag}", default=None)
    p.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="client certificates: 0 none, 1 optional, 2 required (Python's ssl)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-log-stats", **SWITCH,
                   help="no stat line on stderr every 10 s (NANOSERVE_LOG_STATS_INTERVAL)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, in place of the model's")
    p.add_argument("--default-chat-template-kwargs", type=json.loads, default=None,
                   help='JSON options under each request\'s, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--exclude-tools-when-tool-choice-none", **SWITCH,
                   help='tool_choice "none": the template is not shown the tools')
    p.add_argument("--enable-force-include-usage", **SWITCH,
                   help="every stream says its usage, each chunk its own so far")
    p.add_argument("--disable-fastapi-docs", **SWITCH,
                   help="no /docs, /redoc, /openapi.json")
    p.add_argument("--disable-uvicorn-access-log", **SWITCH)
    p.add_argument("--response-role", default="assistant",
                   help="chat's answer's role where the request adds a generation prompt")
    p.add_argument("--generation-config", default="auto",
                   help="whose sampling defaults apply: 'auto' (the model's "
                        "generation_config.json), 'vllm' (none) or a folder (vLLM's)")
    p.add_argument("--override-generation-config", type=json.loads, default=None,
                   help='JSON settings over it, e.g. \'{"temperature": 0.5}\' (vLLM\'s)')
    p.add_argument("--enable-request-id-headers", **SWITCH,
                   help="every answer says X-Request-Id (the request's, or a new one)")
    p.add_argument("--return-tokens-as-token-ids", **SWITCH,
                   help='logprobs\' tokens as "token_id:N" where a request leaves it unset')
    p.add_argument("--enable-prompt-tokens-details", **SWITCH,
                   help="usage.prompt_tokens_details.cached_tokens: the prefix cache's hit")
    p.add_argument("--enable-auto-tool-choice", **SWITCH,
                   help="read the model's tool calls into tool_calls (tool_choice auto)")
    p.add_argument("--tool-call-parser", choices=list(PARSERS), default=None,
                   help="the format the model writes calls in (with --enable-auto-tool-choice)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="read a thinking model's <think> part into chat's `reasoning` (and a "
                        "Responses reasoning item)")
    p.add_argument("--allowed-origins", type=json.loads, default=None,
                   help='CORS, a JSON list (vLLM\'s; e.g. \'["*"]\'); default: no CORS headers')
    p.add_argument("--allow-credentials", **SWITCH)
    for flag in ("allowed-methods", "allowed-headers"):  # with --allowed-origins
        p.add_argument(f"--{flag}", type=json.loads, default=["*"])
    p.add_argument("--enable-log-requests", **SWITCH,
                   help="each prompt's token ids and sampling params on stderr (vLLM's)")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: at most this many of a prompt's ids")
    for flag in ("disable-log-requests", "trust-remote-code"):
        # vLLM's, accepted as written in its command lines: nanoserve logs no requests unless
        # asked, and runs no model code but its own (an architecture it lacks is an error)
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS)
    limits = HttpLimits()  # the HTTP layer's bounds (http_limits.py); h11 names: vLLM's
    p.add_argument("--max-header-bytes", "--h11-max-incomplete-event-size", type=int,
                   default=limits.max_header_bytes, help="request line and headers (431)")
    p.add_argument("--max-header-count", "--h11-max-header-count", type=int,
                   default=limits.max_header_count, help="headers per request (431)")
    p.add_argument("--max-url-bytes", type=int, default=limits.max_url_bytes, help="(414)")
    p.add_argument("--header-timeout", type=float, default=limits.header_timeout,
                   help="seconds a client has to send its headers (408)")
    p.add_argument("--body-timeout", type=float, default=limits.body_timeout,
                   help="seconds a client has to send its body after the headers (408)")
    p.add_argument("--max-connections", type=int, default=limits.max_connections,
                   help="connections open at once; more get a 503 (at most half the open-file "
                        "limit)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle kept-alive connection stays open (uvicorn's)")
    p.add_argument("--reserved-cpus", type=int, default=0,
                   help="CPU cores left to the HTTP front end and clients, not the engine's "
                        "threads (default 0: the engine computes on every core; ignored if "
                        "OMP_NUM_THREADS is set)")
    for flag, kind in (("dtype", str), ("device", str), ("max-num-seqs", int),
                       ("max-num-batched-tokens", human_readable_int),
                       ("max-model-len", model_len), ("kv-cache-memory-bytes", human_readable_int),
                       ("block-size", int), ("num-kv-blocks", int),
                       ("kv-cache-memory-gib", float), ("gpu-memory-utilization", float),
                       ("long-prefill-token-threshold", int),
                       ("scheduling-policy", str), ("batching", str), ("attention-backend", str),
                       ("seed", int), ("max-logprobs", int), ("trace-file", str)):
        p.add_argument(f"--{flag}", type=kind, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    for flag in ("enable-prefix-caching", "enable-chunked-prefill", "enforce-eager"):
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--no-fast-paths", action="store_true", default=None)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML file of these flags (vLLM's), under the command line's")
    args = p.parse_args(vllm_flag_names(sys.argv[1:] if argv is None else argv))
    if args.api_key is None and os.environ.get("VLLM_API_KEY"):  # vLLM's, if no --api-key
        args.api_key = [os.environ["VLLM_API_KEY"]]
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            p.error(f"two models: {args.model} and --model {args.model_flag}")
        args.model = args.model_flag
    if args.enable_auto_tool_choice and args.tool_call_parser is None:  # vLLM's rule
        p.error("--enable-auto-tool-choice needs --tool-call-parser")
    if not isinstance(args.default_chat_template_kwargs, (dict, type(None))):
        p.error("--default-chat-template-kwargs must be a JSON object")
    if args.ssl_cert_reqs not in (0, 1, 2):
        p.error("--ssl-cert-reqs must be 0, 1 or 2")
    return args


def chat_template(value: str, tokenizer: Any) -> str:
    """--chat-template: a file's text, or the template itself (as vLLM: a value without Jinja's
    braces is a file's path), tried once on a message so that a broken one stops the start."""
    path = Path(value)
    if not path.is_file() and "{" not in value:
        raise ValueError(f"--chat-template {value}: no such file")
    template = path.read_text() if path.is_file() else value
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      chat_template=template)
    except Exception as e:
        raise ValueError(f"--chat-template does not render a message: {e}") from None
    return template


def engine_threads(reserved: int) -> int | None:
    """The engine's compute threads while serving: the cores less the reserved ones. vLLM's CPU
    serving keeps a core for its API process; here the front end is a thread that runs while
    the engine thread is inside a C call (the GIL is free there), and leaving a core idle for
    it measured slower (docs/serving.md), so by default nothing is reserved."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0))
    if not 0 <= reserved < cores:
        sys.exit(f"nanoserve serve: --reserved-cpus must be in [0, {cores}), got {reserved}")
    return cores - reserved


def log_stats_interval() -> float:
    """The stat line's period (metrics.py): NANOSERVE_LOG_STATS_INTERVAL seconds (vLLM's
    VLLM_LOG_STATS_INTERVAL), 10 if unset."""
    value = os.environ.get("NANOSERVE_LOG_STATS_INTERVAL", "10")
    with contextlib.suppress(ValueError):
        if 0 < (seconds := float(value)) < float("inf"):
            return seconds
    sys.exit(f"nanoserve serve: NANOSERVE_LOG_STATS_INTERVAL must be a number of seconds > 0, "
             f"got {value!r}")


def http_limits(args: argparse.Namespace) -> HttpLimits:
    """The flags' limits; connections at most half the open-file limit (the engine, the
    tokenizer and the log keep files open too)."""
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return HttpLimits(args.max_url_bytes, args.max_header_bytes, args.max_header_count,
                      args.header_timeout, args.body_timeout,
                      min(args.max_connections, max(files // 2, 16)))


def engine_config(args: argparse.Namespace) -> dict:
    """The LLM's settings from the flags: each engine flag is EngineConfig's field of the same
    name, one way through the config (the trace file is main's trace_to, whose steps are marked
    served)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"trace_file"} | {
        "kv_cache_memory_bytes"}  # vLLM's spellings: LLM takes them (llm.vllm_spellings)
    config = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    config["usage_context"] = "server"  # vLLM's server defaults (config.batch_defaults)
    if args.no_fast_paths:
        config["enable_fast_paths"] = False
    return config


def serving_options(args: argparse.Namespace, sampling_defaults: dict) -> ServingOptions:
    """The flags that shape the answers (ServingOptions, above). vLLM caps every request's
    max_tokens, asked for or not, by the max_new_tokens of a --generation-config folder (with
    the overrides over it: `sampling_defaults`), or else of --override-generation-config."""
    folder = args.generation_config not in ("auto", "vllm")
    cap = sampling_defaults.get("max_tokens") if folder else \
        (args.override_generation_config or {}).get("max_new_tokens")
    return ServingOptions(args.enable_prompt_tokens_details,
                          args.tool_call_parser if args.enable_auto_tool_choice else None,
                          args.return_tokens_as_token_ids, args.reasoning_parser,
                          args.default_chat_template_kwargs,
                          args.exclude_tools_when_tool_choice_none,
                          args.enable_force_include_usage, args.response_role, cap,
                          args.enable_log_requests, args.max_log_len)
