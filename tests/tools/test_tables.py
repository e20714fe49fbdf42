"""scripts/bench/tables.py puts a CPU family's table under the docs' marker: a new family is
added, the same family's older table is replaced, the others and the rest of the page stay."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "tables", Path(__file__).resolve().parents[2] / "scripts" / "bench" / "tables.py")
tables = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(tables)

DOC = f"""# Benchmarks

## Current tables, one per CPU family

{tables.MARKER}

### AVX2 only (avx2)

old avx2 figures

## Figures behind the design

kept
"""


def test_a_family_is_added_then_replaced_and_the_rest_stays():
    zen = "### AVX512-BF16, no AMX (avx512_bf16)\n\nfirst run"
    once = tables.write(DOC, "avx512_bf16", zen)
    assert "old avx2 figures" in once and "first run" in once
    assert once.index("(avx2)") < once.index("(avx512_bf16)") < once.index("## Figures")
    twice = tables.write(once, "avx512_bf16", zen.replace("first", "second"))
    assert "first run" not in twice and "second run" in twice and "old avx2 figures" in twice
    assert twice.endswith("## Figures behind the design\n\nkept\n")
    assert twice.count(tables.MARKER) == 1


def test_a_page_without_the_marker_is_refused():
    with pytest.raises(SystemExit, match="has no line"):
        tables.write("# Benchmarks\n", "avx2", "### AVX2 only (avx2)\n")
