"""The fast path's linears: the C GEMM (csrc/linear.c) and oneDNN's pre-packed GEMM compute
what nn.Linear computes, in fp32 and bf16 on every machine; which one a CPU gets, and
dtype="auto", follow the CPU probe (faked here for each kind of CPU)."""

import pytest
import torch
from torch import nn

from nanoserve import config
from nanoserve.accel import kernels
from nanoserve.accel.linear import ONEDNN_FROM_ROWS, OneDNNLinear, PackedLinear, replace_linears
from nanoserve.utils import cpu

LIB = kernels.compile_kernels()
needs_compiler = pytest.mark.skipif(LIB is None, reason="no C compiler here")


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 33])  # the GEMM takes 6 rows at a time
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(40, 96, bias=bias).requires_grad_(False)
    x = torch.randn(rows, 40)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear, LIB)(x), linear(x), atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("leading", [(1,), (2, 3), (4, 5)])  # rows: 1, 6, 20 (panels widened)
def test_packed_linear_bf16_and_leading_dims(leading):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).requires_grad_(False).to(torch.bfloat16)
    x = torch.randn(*leading, 64).to(torch.bfloat16)
    with torch.inference_mode():
        got = PackedLinear(linear, LIB)(x)
        expected = (x.float() @ linear.weight.float().T + linear.bias.float()).to(torch.bfloat16)
    assert got.shape == (*leading, 48) and got.dtype == torch.bfloat16
    # Both round one float32 sum to bf16; the sums differ only in their order.
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype):
    """The GEMM splits a batch into blocks of 1, 5 or 6 rows, but each block sums over k in the
    same order: a row computed alone or in any batch gives the same bits."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(64, 96, bias=True).requires_grad_(False).to(dtype), LIB)
    x = torch.randn(40, 64).to(dtype)
    with torch.inference_mode():
        full = packed(x)
        for rows in (1, 4, 5, 6, 10, 11, 16, 23):
            for start in (0, 3, 17):
                assert torch.equal(packed(x[start:start + rows]), full[start:start + rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_onednn_linear_matches_linear(dtype, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(40, 24, bias=True).requires_grad_(False).to(dtype)
    x = torch.randn(rows, 40).to(dtype)
    with torch.inference_mode():
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(OneDNNLinear(linear)(x), linear(x), atol=tol, rtol=tol)


@needs_compiler
@pytest.mark.parametrize("kind", ["avx2", "avx512_bf16", "amx"])
def test_each_cpu_gets_its_faster_gemm(fake_cpu, kind):
    """fp32: the C GEMM everywhere; bf16: oneDNN where the CPU has native bf16, else the C GEMM
    (widening); a shape the C GEMM does not take, oneDNN; float16 stays nn.Linear."""
    fake_cpu(kind)
    native_bf16 = kind != "avx2"
    fp32 = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 32)),
                         nn.Linear(32, 20))  # 20 outputs: not a multiple of 16
    replace_linears(fp32, LIB)
    assert [type(m) for m in (fp32[0], fp32[1][1], fp32[2])] == [PackedLinear, PackedLinear,
                                                                  OneDNNLinear]
    bf16 = nn.Sequential(nn.Linear(8, 16)).to(torch.bfloat16)
    replace_linears(bf16, LIB)
    assert isinstance(bf16[0], OneDNNLinear if native_bf16 else PackedLinear)
    fp16 = nn.Sequential(nn.Linear(8, 16)).to(torch.float16)
    replace_linears(fp16, LIB)
    assert type(fp16[0]) is nn.Linear
    no_kernels = nn.Sequential(nn.Linear(8, 16))
    replace_linears(no_kernels, None)
    assert isinstance(no_kernels[0], OneDNNLinear)


@pytest.mark.parametrize("kind, expected", [("avx2", "float32"), ("avx512_bf16", "bfloat16"),
                                            ("amx", "bfloat16")])
def test_auto_dtype_on_cpu(fake_cpu, kind, expected):
    fake_cpu(kind)
    assert config.resolve_dtype("auto", "cpu") == expected
    assert config.resolve_dtype("float32", "cpu") == "float32"
    assert config.resolve_dtype("auto", "cuda") == "bfloat16"


def test_the_real_probe_answers():
    assert isinstance(cpu.has_native_bf16(), bool) and "cores" in cpu.describe()


@needs_compiler
@pytest.mark.parametrize("kind", ["avx2", "amx"])
def test_fp32_hands_large_batches_to_onednn_where_the_cpu_has_avx512(fake_cpu, kind):
    fake_cpu(kind)
    linear = nn.Linear(40, 32).requires_grad_(False)
    packed = PackedLinear(linear, LIB)
    assert (packed.onednn is not None) == (kind == "amx")
    handed = []
    if packed.onednn is not None:
        onednn_forward = packed.onednn.forward
        packed.onednn.forward = lambda x: handed.append(x.shape[0]) or onednn_forward(x)
    with torch.inference_mode():
        for rows in (ONEDNN_FROM_ROWS - 1, ONEDNN_FROM_ROWS):
            x = torch.randn(rows, 40)
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert handed == ([ONEDNN_FROM_ROWS] if kind == "amx" else [])
    bf16 = PackedLinear(nn.Linear(40, 32).to(torch.bfloat16), LIB)
    assert bf16.onednn is None  # bf16 without native units: the C GEMM at every size
