"""The fast path's C kernels: §1's GEMMs (csrc/linear.c; csrc/dpbf16.c where the CPU has
AVX512-BF16, csrc/amx.c where it has AMX, csrc/dot_fp32.c where it has AVX-512), the element-wise
steps (csrc/fused.c), §5's decode attention (csrc/attention*.c) and a decode step's whole layer
(csrc/layer.c), built for this CPU into one
library on first use, then cached. Without a C compiler the fast path uses the library's kernels
only."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from nanoserve.entrypoints.bundled import cache_root

CSRC = Path(__file__).with_name("csrc")
# -march=native: this machine's vector width; -fopenmp: the work split over all cores;
# -fno-trapping-math: lets the softmax's exp loop become vector code (no FP traps are used).
# NANOSERVE_KERNEL_CFLAGS adds flags (`make test-sanitize`: AddressSanitizer and UBSan); they
# are part of the cache key, so such a build never replaces the plain one.
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
         *os.environ.get("NANOSERVE_KERNEL_CFLAGS", "").split()]
_P, _I, _F, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
# The last int of each but store_kv (which copies bytes): 1 if bf16 (paged_decode's is followed
# by the memory to ask for while its threads wait: None, 0 from Python).
ARGTYPES = {"paged_decode": [_P] * 6 + [_I] * 7 + [_F, _I, _P, _I64],
            "store_kv": [_P] * 5 + [_I, _I, _I64], "largest": [_P, _I, _I, _P, _P, _I],
            "linear_panels": [_P] * 4 + [_I] * 4, "has_dpbf16": [], "has_amx": [],
            "has_dot_fp32": [],
            "rms_norm": [_P] * 3 + [_I, _I, _F, _I], "add": [_P] * 3 + [_I] * 3,
            "add_rms_norm": [_P] * 5 + [_I, _I, _F, _I], "qkv_rope": [_P] * 6 + [_I] * 5,
            "silu_mul": [_P] * 2 + [_I] * 3, "decode_layer": [_P] * 8 + [_I, _I],
            "decode_layers": [_P, _I] + [_P] * 7 + [_I, _I, _P],
            "decode_model": [_P, _P, _I] + [_P] * 6 + [_I, _I, _P]}
# Built only where -march=native targets AVX512-BF16 (csrc/dpbf16.c), AMX (csrc/amx.c) or
# AVX-512F (csrc/dot_fp32.c, csrc/attention_prefill.c): these have no dtype flag, but
# paged_prefill's (its bf16 path only where built for AVX512-BF16), followed by its AMX flag.
OPTIONAL_ARGTYPES = {"linear_dpbf16": [_P] * 4 + [_I] * 3,
                     "linear_dpbf16_blocked": [_P] * 4 + [_I] * 3,
                     "linear_amx": [_P] * 4 + [_I] * 3, "amx_init": [],
                     "linear_dot_fp32": [_P] * 4 + [_I] * 3,
                     "linear_fp32_blocked": [_P] * 4 + [_I] * 3,
                     "paged_prefill": [_P] * 7 + [_I] * 10 + [_F, _I, _I],
                     "has_paged_prefill": [], "has_paged_prefill_fp32": []}


@functools.cache  # once per process
def compile_kernels(compiler: str = "cc", csrc: Path = CSRC) -> ctypes.CDLL | None:
    """The kernels, built once into the cache (keyed by source, flags, -march=native), or None.
    `csrc`: another copy of the sources (scripts/bench/kernel_ab.py builds changed ones)."""
    sources, header = sorted(csrc.glob("*.c")), csrc / "kernels.h"  # the header they share
    log = logging.getLogger("nanoserve")
    if shutil.which(compiler) is None:
        log.warning("CPU kernels: no C compiler %r; the fast path uses torch's kernels", compiler)
        return None
    native = subprocess.run([compiler, "-march=native", "-dM", "-E", "-"], input="",
                            capture_output=True, text=True).stdout  # its macros: __AVX2__...
    texts = [path.read_text() for path in [header, *sources]]
    key = hashlib.sha256("\n".join([*texts, *FLAGS, native]).encode()).hexdigest()
    cache = cache_root()
    with contextlib.suppress(OSError):
        cache.mkdir(parents=True, exist_ok=True)
    if not os.access(cache, os.W_OK):  # read-only, or not a directory: build for this process
        cache = Path(tempfile.mkdtemp())
    target = cache / f"nanoserve-kernels-{key[:16]}.so"
    if not target.is_file():
        # Built as a temporary file, then renamed: no start ever loads a half-written library.
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        build = subprocess.run([compiler, *FLAGS, *map(str, sources), "-o", str(tmp), "-lm"],
                               capture_output=True, text=True)
        if build.returncode != 0:
            log.warning("CPU kernels did not compile; the fast path uses torch's kernels:"
                        "\n%s", build.stderr[-2000:])
            return None
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    for name, argtypes in ARGTYPES.items():
        getattr(lib, name).argtypes = argtypes
    for name, argtypes in OPTIONAL_ARGTYPES.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
    return lib


def has_dpbf16(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` was built with csrc/dpbf16.c's AVX512-BF16 GEMM (the compiler's target, not
    the CPU probe: a faked CPU cannot add instructions the library was not built with)."""
    return lib is not None and bool(lib.has_dpbf16())


def has_paged_prefill(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` was built with csrc/attention_prefill.c's bf16 path (AVX512-BF16, as
    has_dpbf16)."""
    return lib is not None and hasattr(lib, "has_paged_prefill")


def has_paged_prefill_fp32(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` was built with csrc/attention_prefill.c's fp32 path (AVX-512F)."""
    return lib is not None and hasattr(lib, "has_paged_prefill_fp32")


def has_amx(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` was built with csrc/amx.c's AMX GEMM (as has_dpbf16) and Linux lets this
    process use the tiles: asked here, before any use (without leave, the first tile instruction
    kills the process); asking again is harmless."""
    return lib is not None and bool(lib.has_amx()) and bool(lib.amx_init())


def has_dot_fp32(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` was built with csrc/dot_fp32.c's AVX-512 GEMM (as has_dpbf16: the target)."""
    return lib is not None and bool(lib.has_dot_fp32())


def keep_freed_memory() -> None:
    """Keep freed buffers of up to 32 MB in the heap (glibc only; vLLM's CPU docs preload tcmalloc
    for this). glibc hands large ones (logits, the MLP's rows, the KV gathers of prefill) back to
    the OS, and every step would page-fault them in again. Process-wide: optimize() calls it."""
    if os.name != "posix":  # CDLL(None), the process's own symbols, exists on POSIX only
        return
    libc = ctypes.CDLL(None)  # the C library's symbols among them
    if hasattr(libc, "gnu_get_libc_version"):
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: allocate up to 32 MB from the heap...
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: ...and keep up to 256 MB of it when freed


def c_gemm(x: torch.Tensor, module: nn.Module, dtype: torch.dtype, weight_ptr: int,
           *flag: int) -> torch.Tensor:
    """x [..., k] -> [..., n] through `module.gemm`, a C GEMM taking (x, w, bias, y, N, M, K[,
    flag]) in `dtype`. The model's activations are already [tokens, k], contiguous, this dtype:
    then nothing is copied."""
    n, k, rows = module.n, module.k, x
    if x.dim() != 2 or x.dtype != dtype or not x.is_contiguous():
        rows = x.reshape(-1, k).to(dtype).contiguous()
    y = torch.empty(rows.shape[0], n, dtype=dtype)
    module.gemm(rows.data_ptr(), weight_ptr, module.bias_ptr, y.data_ptr(), n, rows.shape[0], k,
                *flag)
    return y if rows is x else y.view(*x.shape[:-1], n)
