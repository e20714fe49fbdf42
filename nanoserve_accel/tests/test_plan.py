"""The one dispatch plan (plan.py): the README's table is its printout; the C layer's GEMM enum
is its GEMM_KINDS; every faked CPU family's linears are the modules the plan names."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from nanoserve_accel import kernels, plan
from nanoserve_accel.linear import MODULES, OneDNNLinear, replace_linears

HERE = Path(plan.__file__).parent


def test_the_readme_table_is_the_plans_printout():
    out = subprocess.run([sys.executable, "-m", "nanoserve_accel", "--plan", "--family"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == plan.table(plan.FAMILIES)
    assert out in (HERE / "README.md").read_text()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_the_kernels_compile_where_there_is_a_compiler():
    """The kernels' own tests skip where the library did not build (no compiler): here, with
    one, a source that does not compile is a failure, not a suite of skips."""
    assert kernels.compile_kernels() is not None


def test_the_c_layers_gemm_enum_is_the_plans():
    enum = re.search(r"enum \{([^}]*)\}", (HERE / "csrc" / "layer.c").read_text()).group(1)
    found = {name.removeprefix("GEMM_").lower(): int(value) for name, value in
             re.findall(r"(GEMM_\w+) = (\d+)", enum)}
    assert found == plan.GEMM_KINDS


@pytest.mark.parametrize("family", list(plan.FAMILIES))
def test_each_row_limit_is_inclusive_and_beyond_is_onednn(family):
    m = plan.FAMILIES[family]
    for dtype in plan.DTYPES:
        g = plan.gemm(m, dtype, 576, 576)
        assert (g.max_rows is None) == (g.beyond is None)
        assert g.beyond in (None, "onednn", "amx passes")


@pytest.mark.skipif(kernels.compile_kernels() is None, reason="no C compiler here")
@pytest.mark.parametrize("kind", ["avx2", "avx512_bf16", "amx"])
def test_the_modules_follow_the_plan(fake_cpu, kind):
    fake_cpu(kind)
    lib = kernels.compile_kernels()
    machine = plan.Machine.probe(lib)
    for dtype in plan.DTYPES:
        model = nn.Sequential(nn.Linear(64, 96), nn.Linear(64, 20)).to(dtype)
        replace_linears(model, lib)
        for module, (n, k) in zip(model, [(96, 64), (20, 64)]):
            g = plan.gemm(machine, dtype, n, k)
            expected = MODULES.get(g.kernel, OneDNNLinear if g.kernel == "onednn" else nn.Linear)
            assert type(module) is expected
            assert getattr(module, "max_rows", None) == g.max_rows
    fp16 = nn.Sequential(nn.Linear(8, 16)).to(torch.float16)
    replace_linears(fp16, lib)
    assert type(fp16[0]) is nn.Linear
