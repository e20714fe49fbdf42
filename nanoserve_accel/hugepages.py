"""§1 on a CPU: the weights on 2 MB pages. A one-row decode step reads every weight once; on 4 KB
pages it misses the TLB every 4 KB, and in a virtual machine each miss walks two page tables, the
guest's and the host's. In the `madvise` mode (Ubuntu's default, and this VM's) Linux gives huge
pages only to memory that asks, and torch asks for none; so once the model is laid out, its
weights' pages are made huge in place (MADV_COLLAPSE, Linux 6.1): no copy kept, no address moved.
On an older kernel, or with transparent huge pages off, the call fails and the pages stay as
they were. Figures: docs/benchmarks.md ("Huge pages")."""

from __future__ import annotations

import ctypes
import logging
import sys

import torch
from torch import nn

MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
GAP = 256 << 10  # ranges this close are one span: the heap lays weights out one after another
log = logging.getLogger("nanoserve")


def weight_ranges(model: nn.Module) -> list[tuple[int, int]]:
    """(address, bytes) of each weight `model` holds on the CPU: its parameters and buffers, and
    the layouts its GEMM modules read (oneDNN's opaque ones among them), each once."""
    ranges = {}
    for module in model.modules():
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False),
                  *(v for v in vars(module).values() if isinstance(v, torch.Tensor))):
            if t.device.type != "cpu":
                continue
            if t.is_mkldnn:
                ranges[torch.ops.mkldnn.data_ptr(t)] = torch.ops.mkldnn._nbytes(t)
            elif t.numel():
                storage = t.untyped_storage()
                ranges[storage.data_ptr()] = storage.nbytes()
    return sorted(ranges.items())


def huge_spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole 2 MB pages within runs of `ranges` no more than GAP apart, as (address, bytes):
    rounded inward, so that no memory around the weights is touched."""
    runs: list[list[int]] = []
    for start, size in sorted(ranges):
        if runs and start <= runs[-1][1] + GAP:
            runs[-1][1] = max(runs[-1][1], start + size)
        else:
            runs.append([start, start + size])
    spans = [(-(-a // HUGE_PAGE) * HUGE_PAGE, b // HUGE_PAGE * HUGE_PAGE) for a, b in runs]
    return [(a, b - a) for a, b in spans if b > a]


def collapse(ranges: list[tuple[int, int]]) -> int:
    """Make the 2 MB pages of huge_spans(ranges) huge; returns the bytes it asked for that the
    kernel took (0 where it cannot: not Linux, an old kernel, huge pages off)."""
    if not sys.platform.startswith("linux"):
        return 0
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for address, size in huge_spans(ranges):  # a span refused (EINVAL, EAGAIN...) is skipped
        done += size if madvise(address, size, MADV_COLLAPSE) == 0 else 0
    return done


def weights_on_huge_pages(model: nn.Module) -> int:
    """collapse() the model's weights; logs and returns the bytes now on huge pages."""
    ranges = weight_ranges(model)
    done = collapse(ranges)
    log.debug("huge pages: %d of %d MB of weights", done >> 20, sum(s for _, s in ranges) >> 20)
    return done
