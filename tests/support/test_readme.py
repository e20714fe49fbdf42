"""The README states counts (lines of the chapter core, the entry points, the fast-path plugin):
each is recomputed here, so none can drift; and the README stays short (for users, <= 350 lines)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def chapter_core() -> list[Path]:
    """engine/, models/, layers/, config, sampling params, utils: nanoserve/ without the entry
    points, the simulator, the trace and the GPU's CUDA graphs."""
    return [p for p in (ROOT / "nanoserve").rglob("*.py")
            if "entrypoints" not in p.parts and p.name not in ("simulator.py", "trace.py",
                                                                "cuda_graph.py", "serve.py")]


def test_the_counts_the_readme_states_are_the_trees():
    text = " ".join(README.read_text().split())
    found = re.search(r"is (\d+) lines of Python, tensor parallel included; the entry points "
                      r"(\d+), the fast-path plugin (\d+) of Python and (\d+) of C", text)
    assert found, "the README's counts sentence is gone or reworded"
    accel = ROOT / "nanoserve_accel"
    actual = (lines(chapter_core()),
              lines([*(ROOT / "nanoserve" / "entrypoints").glob("*.py"),
                     ROOT / "nanoserve" / "serve.py"]),
              lines(p for p in accel.glob("*.py")),
              lines([*(accel / "csrc").glob("*.c"), *(accel / "csrc").glob("*.h")]))
    stated = tuple(map(int, found.groups()))
    if not accel.is_dir():  # a checkout without the plugin (its folder deleted): the core's
        stated, actual = stated[:2], actual[:2]
    assert stated == actual


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 350


def test_the_readmes_use_example_runs():
    """The "Use" snippet, as written, on the bundled model: it cannot drift from the API."""
    use = README.read_text()[README.read_text().index("## Use"):]
    start = use.index("```python\n") + len("```python\n")
    printed: list[tuple] = []
    names = {"print": lambda *args: printed.append(args)}
    exec(use[start:use.index("```\n", start)], names)
    out, b = names["out"], names["b"]
    assert [len(o.outputs) for o in names["outputs"]] == [1, 1] and len(out.outputs) == 3
    assert len(b.sequences) == 4 and b.sequences[0].text.startswith("The sea is")
    assert printed[-1][0].num_running == printed[-1][0].num_waiting == 0  # llm.stats()
