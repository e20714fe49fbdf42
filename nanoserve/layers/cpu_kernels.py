"""The optimized CPU path's C kernels (cpu_kernels.c): §1's GEMM and §5's decode attention.

They are compiled for this machine when the first engine starts (~0.5 s) and used only with
`enforce_eager=False` (cpu_linear.py, cpu_attention.py); the eager path, the one a reader
steps through, stays plain torch. Without a C compiler that path stays too, with one log line."""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -march=native: this machine's vector width; -fopenmp: the work split over all cores;
# -fno-trapping-math: lets the softmax's exp loop become vector code (no FP traps are used).
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
_P, _I = ctypes.c_void_p, ctypes.c_int
ARGTYPES = {"paged_decode_f32": [_P] * 6 + [_I] * 6 + [ctypes.c_float],
            "paged_decode_bf16": [_P] * 6 + [_I] * 6 + [ctypes.c_float],
            "linear_f32": [_P] * 4 + [_I] * 3, "linear_bf16": [_P] * 4 + [_I] * 3}


@functools.cache  # once per process
def compile_kernels(compiler: str = "cc") -> ctypes.CDLL | None:
    """Build the kernels into a temporary file and load them; None if that fails."""
    log = logging.getLogger("nanoserve")
    if shutil.which(compiler) is None:
        log.warning("CPU kernels: no C compiler %r; the optimized path stays plain torch", compiler)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "cpu_kernels.so"
        build = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(target), "-lm"],
                               capture_output=True, text=True)
        if build.returncode != 0:
            log.warning("CPU kernels did not compile; the optimized path stays plain torch:"
                        "\n%s", build.stderr[-2000:])
            return None
        lib = ctypes.CDLL(str(target))  # stays mapped after the file is deleted
    for name, argtypes in ARGTYPES.items():
        getattr(lib, name).argtypes = argtypes
    return lib
