"""bench.py's step workloads (§1 batching, §7 prefill stutter) on a tiny random model: what
they schedule must be what they claim to measure. No timing is asserted."""

from __future__ import annotations

import pytest
import torch

from benchmarks.steps import measure_batching, measure_prefill_stutter
from tests.common.tiny_model import tiny_model_dir


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_batching_times_steps_of_exactly_n_decode_rows():
    """measure_batching raises unless every timed step decodes exactly `rows` requests."""
    table = measure_batching(tiny_model_dir(), rows=(1, 3), num_steps=2, prompt_len=8)
    assert [r["rows"] for r in table] == [1, 3]
    assert table[0]["cost_vs_1_row"] == 1.0
    assert table[0]["weight_mb_per_token"] == pytest.approx(3 * table[1]["weight_mb_per_token"])


def test_prefill_stutter_one_step_without_chunking_spread_with_it():
    """Off: the whole long prompt in one step, beside the decodes. On: spread over steps of
    at most the budget, and every running request still decodes in each of them."""
    off, on = measure_prefill_stutter(tiny_model_dir(), num_decoders=3, long_prompt=40,
                                      chunk=12, arrive_after=2, decode_tokens=20)
    assert (off.chunked, on.chunked, on.token_budget) == (False, True, 12)
    assert [t for t in off.long_tokens if t] == [40]
    assert len(off.stutter_steps) == 1
    chunks = [t for t in on.long_tokens if t]
    assert sum(chunks) == 40 and chunks == [9, 9, 9, 9, 4]  # budget 12 - 3 decodes
    assert all(on.decode_rows[i] == 3 for i in on.stutter_steps)
    assert on.long_ttft_ms > 0 and off.long_ttft_ms > 0
