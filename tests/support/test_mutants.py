"""scripts/dev/mutate.py's mutants stay planted: each one's `original` snippet occurs exactly
once in its file, and its replacement differs. A mutant whose snippet is gone (the code moved on)
is only reported "stale" by the tool and guards nothing: here it fails a model-free test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "dev"))
import mutate  # noqa: E402


def test_mutant_names_are_unique():
    names = [m.name for m in mutate.MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mutant", mutate.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_plants_its_bug_in_the_current_code(mutant):
    path = ROOT / mutant.file
    assert path.is_file(), f"{mutant.name}: {mutant.file} no longer exists"
    count = path.read_text().count(mutant.original)
    assert count == 1, f"{mutant.name}: its snippet occurs {count} times in {mutant.file}"
    assert mutant.replacement != mutant.original
