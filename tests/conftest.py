"""Hypothesis profiles. `NANOSERVE_HYPOTHESIS_PROFILE=mutate` (set by scripts/mutate.py)
makes the property tests derandomized and database-free, so a mutant is killed or survives
the same way on every run; the default profile stays random, to keep finding new cases."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("mutate", derandomize=True, database=None, print_blob=False)
settings.load_profile(os.environ.get("NANOSERVE_HYPOTHESIS_PROFILE", "default"))
