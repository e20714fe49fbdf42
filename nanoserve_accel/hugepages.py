"""§1 on a CPU: the weights on 2 MB pages. A one-row decode step reads every weight once; on 4 KB
pages it misses the TLB every 4 KB, and in a virtual machine each miss walks two page tables, the
guest's and the host's. In the `madvise` mode (Ubuntu's default, and this VM's) Linux gives huge
pages only to memory that asks, and torch asks for none; so once the model is laid out, its
weights' pages are made huge in place (MADV_COLLAPSE, Linux 6.1): no copy kept, no address moved.
Every 2 MB page that holds a weight byte, whole: oneDNN's laid-out weights lie apart in the heap,
and whole pages within them alone left most of qkv_proj's and o_proj's on 4 KB pages. The bytes
of the heap that share a page with a weight move with it (the kernel copies the page; their
values and addresses stay). On an older kernel, or with transparent huge pages off, the call
fails and the pages stay as they were. Figures: docs/benchmarks.md ("Huge pages")."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
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
    """The 2 MB pages that hold any byte of `ranges`, as (address, bytes): runs of them, those
    no more than GAP apart joined (one madvise call for the heap's weights laid out in turn)."""
    runs: list[list[int]] = []
    for start, size in sorted(r for r in ranges if r[1] > 0):
        first, end = start // HUGE_PAGE * HUGE_PAGE, -(-(start + size) // HUGE_PAGE) * HUGE_PAGE
        if runs and first <= runs[-1][1] + GAP:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([first, end])
    return [(a, b - a) for a, b in runs]


def collapse(ranges: list[tuple[int, int]]) -> int:
    """Make the 2 MB pages of huge_spans(ranges) huge; returns the bytes it asked for that the
    kernel took (0 where it cannot: not Linux, an old kernel, huge pages off)."""
    if not sys.platform.startswith("linux"):
        return 0
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for address, size in huge_spans(ranges):
        if madvise(address, size, MADV_COLLAPSE) == 0:
            done += size
            continue
        # Refused: a page of the run the kernel cannot make huge (past the end of its mapping,
        # EAGAIN...) fails the whole call. Page by page, the others still are.
        for page in range(address, address + size, HUGE_PAGE):
            done += HUGE_PAGE if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0 else 0
    return done


def weights_on_huge_pages(model: nn.Module) -> int:
    """collapse() the model's weights; logs and returns the bytes now on huge pages."""
    ranges = weight_ranges(model)
    done = collapse(ranges)
    log.debug("huge pages: %d MB made huge for %d MB of weights", done >> 20,
              sum(s for _, s in ranges) >> 20)
    return done


def huge_zeros(*size: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(*size) on memory of its own asked to be backed by 2 MB pages (MADV_HUGEPAGE)
    before anything touches it: the KV cache, a few blocks of which a decode step reads in every
    layer. Linux hands the pages out zeroed as they are first touched (a collapse, as for the
    weights, would copy the whole pool); one byte a 4 KB page is touched now, so that no step
    waits on the kernel to clear a page, as torch.zeros' memset did. Elsewhere: torch.zeros."""
    nbytes = math.prod(size) * dtype.itemsize
    if torch.device(device).type != "cpu" or not sys.platform.startswith("linux") or not nbytes:
        return torch.zeros(*size, dtype=dtype, device=device)
    # Private: shared anonymous memory is shmem, which huge pages skip by default.
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(memory)) % HUGE_PAGE  # 2 MB aligned
    with contextlib.suppress(OSError):  # no huge pages in this kernel: 4 KB ones, still zeroed
        memory.madvise(mmap.MADV_HUGEPAGE, offset, len(memory) - offset)
    flat = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=offset)
    flat[::4096].zero_()  # resident now: huge pages where the kernel has them, else 4 KB ones
    return flat.view(dtype).view(size)  # the tensor holds `memory`: unmapped when it is freed
