"""The trace page (issue 11 item 3) in a real browser: headless Chromium opens the page built
from a real static + continuous run, the DOM must hold seats x steps cells per run, and a
click on a cell must show its request, step and role. A screenshot is saved too (to docs/
with NANOSERVE_UPDATE_DOCS=1, so `make test` does not rewrite a tracked file)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from nanoserve import LLM, SamplingParams
from tests.common.tiny_model import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("trace_page",
                                               ROOT / "scripts" / "reader" / "trace_page.py")
trace_page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_page)

needs_chromium = pytest.mark.skipif(
    trace_page.chromium() is None,
    reason="headless Chromium is not installed (Debian: apt-get install -y chromium); "
           ".ci/run installs it")


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """Static then continuous on the same 6 requests, in one trace file (two runs)."""
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    prompts = [list(range(20 + i, 20 + i + n)) for i, n in enumerate([17, 4, 9, 30, 6, 12])]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (12, 3, 8, 5, 10, 4)]
    for policy in ("static", "fcfs"):
        llm = LLM(tiny_model_dir(), max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
                  num_kv_blocks=64, trace_file=str(path),
                  batching="static" if policy == "static" else "continuous")
        llm.generate(prompts, params, use_tqdm=False)
    return path


def test_read_runs_splits_runs_and_rejects_bad_lines(trace, tmp_path):
    runs = trace_page.read_runs(trace)
    assert [r["header"]["name"] for r in runs] == ["static", "continuous"]
    assert all(r["steps"] and r["steps"][0]["step"] == 1 for r in runs)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(trace.read_text().splitlines()[1] + "\n")
    with pytest.raises(ValueError, match="before any run header"):
        trace_page.read_runs(bad)
    bad.write_text('{"type": "run", "name": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a run record needs \['policy'"):
        trace_page.read_runs(bad)


def test_page_is_self_contained(trace):
    html = trace_page.build_page(trace_page.read_runs(trace), "t")
    assert not re.search(r"https?://|<script[^>]+src|<link|@import|url\(", html)
    assert '"name":"continuous"' in html and "__TRACE_DATA__" not in html


def dump_dom(page: Path, fragment: str) -> str:
    return trace_page.run_chromium(["--dump-dom", page.as_uri() + fragment]).stdout


def pick(steps: list[dict], role: str) -> tuple[dict, dict]:
    return next((s, r) for s in steps[1:] for r in s["rows"] if r["role"] == role)


@needs_chromium
def test_page_in_headless_chromium(trace, tmp_path):
    runs = trace_page.read_runs(trace)
    page = tmp_path / "page.html"
    page.write_text(trace_page.build_page(runs, "nanoserve trace: static vs continuous"))
    checks = [(1, *pick(runs[1]["steps"], "prefill")), (1, *pick(runs[1]["steps"], "decode")),
              (0, *pick(runs[0]["steps"], "idle"))]
    for run, step, row in checks:
        dom = dump_dom(page, f"#selftest={step['step']},{row['seat']},{run}")
        for i, r in enumerate(runs):  # one cell per seat x step, for each run
            cells = re.findall(rf'<div class="c[^"]*" data-run="{i}" ', dom)
            assert len(cells) == r["header"]["max_num_seqs"] * len(r["steps"]) > 0
        shown = re.search(r'<pre id="selftest">(.*?)</pre>', dom, re.S).group(1)
        expected = f"request {row['request']} · step {step['step']} · seat {row['seat']} · " \
                   f"role {row['role']}"
        assert expected in shown, shown
        if row["role"] != "idle":
            assert f"tokens [{row['start']}, {row['end']})" in shown
        assert f"ngân sách token {step['num_scheduled_tokens']}/{step['token_budget']}" in shown
    docs = os.environ.get("NANOSERVE_UPDATE_DOCS") == "1"
    png = ROOT / "docs" / "trace-page.png" if docs else tmp_path / "trace-page.png"
    run, step, row = checks[-1]  # with an idle row's details shown
    trace_page.screenshot(page, png, 1400, 1000, f"#hover={step['step']},{row['seat']},{run}")
    matplotlib_image = pytest.importorskip("matplotlib.image")
    pixels = matplotlib_image.imread(png)
    assert pixels.shape[:2] == (1000, 1400)
    colours = {tuple(p) for p in (pixels[::7, ::7, :3] * 255).astype(int).reshape(-1, 3)}
    assert len(colours) > 20, "the screenshot looks blank"
    print(f"screenshot: {png}; trace: {json.dumps([r['header']['name'] for r in runs])}")
