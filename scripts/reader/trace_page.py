"""Turn a nanoserve trace (JSON lines, see nanoserve/trace.py) into ONE self-contained HTML
page to explore it: the seat x step grid of every run (static and continuous one above the
other), coloured by request and role, with the token budget, KV usage, waiting queue and
step time beneath, and the chapter's words in the legend.

    python scripts/reader/trace_page.py run.jsonl [--out run.html] [--screenshot page.png]

The page needs no network: the CSS and JavaScript of scripts/reader/trace_page.html are inlined and
the trace is embedded as JSON. --screenshot uses headless Chromium (Debian: `chromium`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TEMPLATE = Path(__file__).with_name("trace_page.html")
HEADER_KEYS = ("name", "policy", "max_num_seqs", "token_budget", "num_blocks", "block_size")
STEP_KEYS = ("step", "token_budget", "num_scheduled_tokens", "num_waiting", "num_running",
             "num_free_blocks", "num_blocks", "rows", "admitted", "preempted", "finished")


def read_runs(path: str | Path) -> list[dict]:
    """Split a trace into runs: [{"header": {...}, "steps": [...]}, ...]. A bad line is a
    ValueError naming the file, the line and what is wrong."""
    runs: list[dict] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        kind = record.get("type") if isinstance(record, dict) else None
        keys = {"run": HEADER_KEYS, "step": STEP_KEYS}.get(kind)
        if keys is None:
            raise ValueError(f"{where}: type must be 'run' or 'step', got {kind!r}")
        missing = [k for k in keys if k not in record]
        if missing:
            raise ValueError(f"{where}: a {kind} record needs {missing}")
        if kind == "run":
            runs.append({"header": record, "steps": []})
        elif not runs:
            raise ValueError(f"{where}: a step record before any run header")
        else:
            seats = runs[-1]["header"]["max_num_seqs"]
            bad = [r for r in record["rows"] if not 0 <= r["seat"] < seats]
            if bad:
                raise ValueError(f"{where}: seat must be in [0, {seats}), got {bad[0]}")
            runs[-1]["steps"].append(record)
    if not runs:
        raise ValueError(f"{path}: no run header (an empty trace?)")
    return runs


def build_page(runs: list[dict], title: str) -> str:
    # "</" inside a <script> would end it early; "<\/" is the same string to JSON.
    data = json.dumps(runs, separators=(",", ":")).replace("</", "<\\/")
    html = TEMPLATE.read_text(encoding="utf-8")
    return html.replace("__TITLE__", title.replace("&", "&amp;").replace("<", "&lt;")) \
               .replace("__TRACE_DATA__", data)


def chromium() -> str | None:
    """The headless browser, or None where none is installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


def run_chromium(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium with a throwaway profile; --no-sandbox because CI runs as root."""
    browser = chromium()
    if browser is None:
        raise RuntimeError("chromium is not installed (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory(prefix="nanoserve-chromium-") as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", "--no-first-run", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 900,
               fragment: str = "") -> None:
    """`fragment` "#hover=STEP,SLOT,RUN" shows that cell's details (#selftest=: clicked)."""
    png.parent.mkdir(parents=True, exist_ok=True)
    run_chromium([f"--screenshot={png.resolve()}", f"--window-size={width},{height}",
                  page.resolve().as_uri() + fragment])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="JSON-lines trace (example.py --trace-file, ...)")
    p.add_argument("--out", type=Path, default=None, help="default: the trace with .html")
    p.add_argument("--title", default=None)
    p.add_argument("--screenshot", type=Path, default=None, help="also save a PNG (Chromium)")
    p.add_argument("--window-size", default="1400,900", help="screenshot size W,H")
    p.add_argument("--show", default="", metavar="STEP,SLOT[,RUN]",
                   help="screenshot with this cell's details shown (as on hover)")
    args = p.parse_args(argv)
    out = args.out or args.trace.with_suffix(".html")
    runs = read_runs(args.trace)
    title = args.title or f"nanoserve trace: {args.trace.name} ({len(runs)} run(s))"
    out.write_text(build_page(runs, title), encoding="utf-8")
    print(f"wrote {out} ({len(runs)} run(s), "
          f"{sum(len(r['steps']) for r in runs)} steps)", file=sys.stderr)
    if args.screenshot is not None:
        width, height = (int(x) for x in args.window_size.split(","))
        screenshot(out, args.screenshot, width, height,
                   f"#hover={args.show}" if args.show else "")
        print(f"wrote {args.screenshot}", file=sys.stderr)


if __name__ == "__main__":
    main()
