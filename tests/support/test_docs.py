"""docs/serving.md names what the server takes, so that it cannot drift from the code: every
route the app serves (and the README's list of them), every request field of every endpoint,
every field accepted only at its no-op values, every flag. A field, route or flag added without
its line in the docs fails here."""

from __future__ import annotations

import re
from pathlib import Path

from nanoserve.entrypoints import validation
from nanoserve.entrypoints.body_checker import ENDPOINTS
from nanoserve.entrypoints.cli_args import parse_args

ROOT = Path(__file__).resolve().parents[2]
SERVING = (ROOT / "docs" / "serving.md").read_text()
README = (ROOT / "README.md").read_text()


def named(name: str, text: str = SERVING) -> bool:
    return f"`{name}`" in text or re.search(rf"`[A-Z]+ {re.escape(name)}[` ]", text) is not None


def routes() -> list[str]:
    """The paths api_server.py serves, read from its source (building the app needs a model)."""
    source = (ROOT / "nanoserve" / "entrypoints" / "api_server.py").read_text()
    return sorted(set(re.findall(r'"(/[a-z0-9/_]+)"', source)))


def test_every_route_is_in_the_docs_and_the_readme():
    found = routes()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/metrics"} <= set(found)
    assert [r for r in found if not named(r)] == []
    assert [r for r in found if not named(r, README)] == []


def test_every_request_field_is_in_the_docs():
    fields = {f for e in ENDPOINTS for f in e.request_model.model_fields}
    assert {"prompt", "messages", "input", "tokens", "max_output_tokens"} <= fields
    assert sorted(f for f in fields if not named(f)) == []


def test_every_no_op_field_is_in_the_docs():
    no_ops = {f for e in ENDPOINTS for f in e.no_op} | set(validation.NO_OP)
    assert sorted(f for f in no_ops if not named(f)) == []


def test_every_flag_is_in_the_docs():
    flags = {"--" + name.replace("_", "-") for name in vars(parse_args([]))} - {
        "--model", "--model-flag"} | {"--model"}  # (positional, or --model)
    assert {"--port", "--chat-template", "--allowed-methods", "--dtype"} <= flags
    # `--[no-]enable-prefix-caching` names both spellings
    missing = [f for f in sorted(flags) if f not in SERVING and
               f.replace("--", "--[no-]", 1) not in SERVING]
    assert missing == []
