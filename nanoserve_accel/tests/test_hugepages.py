"""hugepages.py: which memory it asks to make huge (every weight the model reads, each once, and
every 2 MB page that holds a byte of one), that the kernel then backs it with huge pages where it
can, that the values stay, and that the default path asks for the model's weights; that the KV
cache's allocation gives zeros on memory asked to be huge."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
from torch import nn

from nanoserve import LLM
from nanoserve_accel import hugepages
from nanoserve_accel.hugepages import HUGE_PAGE, collapse, huge_spans, huge_zeros, weight_ranges
from tests.common.tiny_model import tiny_model_dir

MB = 1 << 20


def test_spans_are_the_huge_pages_that_hold_the_ranges():
    base = 100 * HUGE_PAGE
    assert huge_spans([(base + 1, 5 * MB)]) == [(base, 6 * MB)]  # outward: every page touched
    assert huge_spans([(base + MB, MB // 2)]) == [(base, 2 * MB)]  # under one page: that page
    assert huge_spans([(base, 0)]) == []
    # ranges a few bytes apart (the heap's order) are one run, as are two sharing a page; far
    # apart, two
    near = [(base, 3 * MB), (base + 3 * MB + 64, 3 * MB - 64)]
    assert huge_spans(near) == [(base, 6 * MB)]
    same_page = [(base + 64, 64), (base + MB, 64)]
    assert huge_spans(same_page) == [(base, 2 * MB)]
    far = [(base, 4 * MB), (base + 64 * MB, 4 * MB)]
    assert huge_spans(far) == [(base, 4 * MB), (base + 64 * MB, 4 * MB)]


def test_weight_ranges_hold_each_weight_once():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    model[1].weight = model[0].weight  # tied: one range, not two
    del model[1].bias
    model[1].register_buffer("bias", torch.zeros(8))
    model[0].layout = torch.ones(4, 4)  # a GEMM module's own layout, a plain attribute
    ranges = weight_ranges(model)
    tensors = (model[0].weight, model[0].bias, model[1].bias, model[0].layout)
    assert sorted(ranges) == sorted((t.data_ptr(), t.untyped_storage().nbytes()) for t in tensors)


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside, kb = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                kb = int(line.split()[1])
    return kb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")
def test_collapse_backs_whole_pages_and_keeps_the_values():
    # A mapping of its own, written on 4 KB pages: the heap may hold pages made huge before.
    memory = mmap.mmap(-1, 12 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(memory, dtype=torch.float32)
    t.copy_(torch.arange(len(t), dtype=torch.float32))  # at least 4 whole 2 MB pages
    before = t.clone()
    ranges = [(t.data_ptr(), t.nbytes)]
    huge_before = anon_huge_kb(t.data_ptr())
    done = collapse(ranges)
    if done == 0:
        pytest.skip("this kernel makes no huge pages here (before 6.1, or THP off)")
    if huge_before >= 8 * MB // 1024:  # its mapping, or one merged with it, was huge already
        pytest.skip("transparent huge pages 'always': the pages were huge before")
    # the pages wholly inside the mapping (at least 5 of 12 MB); those it shares with its
    # neighbours cannot be made huge, and are skipped
    assert sum(size for _, size in huge_spans(ranges)) >= done >= 8 * MB
    assert anon_huge_kb(t.data_ptr()) - huge_before >= 8 * MB // 1024
    assert torch.equal(t, before)
    del t
    memory.close()


def test_the_default_path_asks_for_the_model_weights(monkeypatch):
    asked = []
    monkeypatch.setattr(hugepages, "collapse", lambda ranges: asked.append(ranges) or 0)
    llm = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=8, skip_tokenizer_init=True)
    [ranges] = asked
    model = llm.model_runner.model
    kv = llm.model_runner.kv_cache.untyped_storage().data_ptr()
    assert kv not in dict(ranges)  # the KV cache comes after: not asked for
    assert set(ranges) == {r for r in weight_ranges(model) if r[0] != kv}
    assert sum(size for _, size in ranges) >= llm.model_runner.weight_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")
def test_huge_zeros_are_zeros_on_memory_asked_to_be_huge():
    assert huge_zeros(0, 4, dtype=torch.float32, device="cpu").shape == (0, 4)
    assert torch.equal(huge_zeros(3, dtype=torch.float32, device="cpu"), torch.zeros(3))
    t = huge_zeros(3, 5 * MB // 2, dtype=torch.bfloat16, device="cpu")  # 15 MB
    assert t.shape == (3, 5 * MB // 2) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    huge_kb = anon_huge_kb(t.data_ptr())  # before any write of ours
    t.fill_(1.5)
    assert bool((t == 1.5).all())
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages off: 4 KB pages, still zeroed")
    # resident since it was made (no step faults on it later), huge where the kernel could
    assert huge_kb >= 8 * MB // 1024


def test_the_default_path_allocates_the_kv_cache_with_huge_zeros():
    llm = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=8, skip_tokenizer_init=True)
    runner = llm.model_runner
    assert runner.kv_zeros is huge_zeros and runner.kv_cache.data_ptr() % HUGE_PAGE == 0
    plain = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=8, skip_tokenizer_init=True,
                enable_fast_paths=False).model_runner
    assert plain.kv_zeros is torch.zeros and plain.kv_cache.shape == runner.kv_cache.shape
