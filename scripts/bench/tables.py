"""The current table of this machine's CPU family, written into docs/benchmarks.md.

One script writes every "current" figure, so that none is copied by hand: it runs
`step_times.py` (the bundled model, float32 and bfloat16, 1 / 16 / 64 rows decoding at 240
tokens of context; llama.cpp's columns where `setup_llamacpp.sh` was run) and `bench.py --quick`
(continuous against static batching and HF `generate`, the engine's default dtype), and puts
their tables under one header naming the CPU family, the date, the commit and the CPU line.
A later run on the same family replaces that family's table; the other families' stay.

    flock /tmp/nanoserve-bench.lock .venv/bin/python scripts/bench/tables.py
    .venv/bin/python scripts/bench/tables.py --print   # the table only, docs untouched
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nanoserve.utils import cpu  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
MARKER = "<!-- tables: scripts/bench/tables.py writes the tables below this line -->"
FAMILIES = {"amx": "AMX", "avx512_bf16": "AVX512-BF16, no AMX", "avx2": "AVX2 only"}


def family() -> str:
    """The family `make test-cpus` names: amx, avx512_bf16 or avx2."""
    flags = cpu.cpu_flags()
    return "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "avx2"


def run(args: list[str]) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def step_table(steps: int) -> list[str]:
    """step_times.py's rows, both dtypes under one header, and its roofline lines."""
    out = run(["scripts/bench/step_times.py", "--steps", str(steps)])
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| dtype |"))
    rows = [line for line in lines if re.match(r"\| (float32|bfloat16) \|", line)]
    notes = [line for line in lines if line.startswith(("(roofline", "llama.cpp"))]
    return [lines[header], lines[header + 1], *rows, "", *notes]


def bench_table() -> list[str]:
    """bench.py --quick: wall time, output tok/s, slot use and TTFT / TPOT p50 per system."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "quick.json"
        run(["bench.py", "--quick", "--out", str(out), "--png", str(Path(tmp) / "quick.png")])
        result = json.loads(out.read_text())
    rows = ["| system | wall s | output tok/s | steps | slot use | TTFT p50 s | TPOT p50 ms |",
            "|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        use = "-" if r["utilisation"] is None else f"{100 * r['utilisation']:.0f}%"
        ttft = "-" if r["ttft_p50"] is None else f"{r['ttft_p50']:.2f}"
        tpot = "-" if r["tpot_p50"] is None else f"{1e3 * r['tpot_p50']:.1f}"
        rows.append(f"| {r['system']} | {r['wall_s']:.2f} | {r['output_tps']:.0f} | "
                    f"{r['num_steps'] if r['num_steps'] is not None else '-'} | {use} | {ttft} | "
                    f"{tpot} |")
    wl = result["workload"]
    return [f"`bench.py --quick` ({result['dtype']}): {len(wl['output_lengths'])} requests, "
            f"{wl['max_num_seqs']} seats, all at t=0.", "", *rows]


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + (" plus uncommitted changes" if dirty else "")


def section(steps: int) -> str:
    name = family()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"### {FAMILIES[name]} ({name})", "",
             f"{date}, commit {commit()}; `{cpu.describe()}`. Decode step time "
             f"(`step_times.py --steps {steps}`, the bundled model, every row at 240 tokens of "
             "context, median ms):", "", *step_table(steps), "", *bench_table(), ""]
    return "\n".join(lines)


def write(doc: str, name: str, text: str) -> str:
    """`doc` with family `name`'s table replaced by (or, if new, added as) `text`."""
    if MARKER not in doc:
        raise SystemExit(f"{DOC} has no line {MARKER!r}")
    head, rest = doc.split(MARKER, 1)
    end = re.search(r"^## ", rest, re.M)
    tables, tail = (rest[:end.start()], rest[end.start():]) if end else (rest, "")
    parts = re.split(r"(?m)^(?=### )", tables.strip("\n"))
    kept = [p.strip("\n") for p in parts if p.strip() and f"({name})" not in p.splitlines()[0]]
    body = "\n\n".join(sorted([*kept, text.strip("\n")]))
    return f"{head}{MARKER}\n\n{body}\n\n{tail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15, help="step_times.py's timed steps")
    ap.add_argument("--print", action="store_true", help="print the table, leave the docs")
    args = ap.parse_args()
    text = section(args.steps)
    if args.print:
        print(text)
        return
    DOC.write_text(write(DOC.read_text(), family(), text))
    print(text)
    print(f"wrote the {family()} table into {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
