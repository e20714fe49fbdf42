"""The fast path's linears: the C GEMM on panels (csrc/linear.c), the AVX512-BF16 GEMM
(csrc/dpbf16.c, where the library was built with it) and oneDNN's pre-packed GEMM compute what
nn.Linear computes, in fp32 and bf16; which one a CPU gets, and dtype="auto", follow the CPU
probe (faked here for each kind of CPU)."""

import weakref

import pytest
import torch
from torch import nn

from nanoserve import config
from nanoserve.utils import cpu
from nanoserve_accel import kernels
from nanoserve_accel.linear import (
    Dpbf16Linear,
    OneDNNLinear,
    PanelsLinear,
    is_blocked_64,
    reorder,
    replace_linears,
)
from nanoserve_accel.plan import DPBF16_MAX_ROWS, PANELS_MAX_ROWS
from nanoserve_accel.plan import onednn_runs as onednn_takes

LIB = kernels.compile_kernels()
needs_compiler = pytest.mark.skipif(LIB is None, reason="no C compiler here")
# The compiled code follows the real machine (-march=native), whatever CPU the probe is faked as.
needs_dpbf16 = pytest.mark.skipif(not kernels.has_dpbf16(LIB),
                                  reason="the kernels were not built with AVX512-BF16 here")


def dpbf16_only(linear: nn.Linear) -> Dpbf16Linear:
    """The dpbf16 GEMM at every row count: no handover to oneDNN (max_rows None)."""
    return Dpbf16Linear(linear, LIB)


def bf16_reference(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    bias = 0 if linear.bias is None else linear.bias.float()
    return (x.float() @ linear.weight.float().T + bias).to(torch.bfloat16)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 33])  # the GEMM takes 6 rows at a time
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(40, 96, bias=bias).requires_grad_(False)
    x = torch.randn(rows, 40)
    with torch.inference_mode():
        torch.testing.assert_close(PanelsLinear(linear, LIB)(x), linear(x), atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("leading", [(1,), (2, 3), (4, 5)])  # rows: 1, 6, 20 (panels widened)
def test_packed_linear_bf16_and_leading_dims(leading):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).requires_grad_(False).to(torch.bfloat16)
    x = torch.randn(*leading, 64).to(torch.bfloat16)
    with torch.inference_mode():
        got = PanelsLinear(linear, LIB)(x)
        expected = (x.float() @ linear.weight.float().T + linear.bias.float()).to(torch.bfloat16)
    assert got.shape == (*leading, 48) and got.dtype == torch.bfloat16
    # Both round one float32 sum to bf16; the sums differ only in their order.
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17])  # blocks of up to 8 rows
@pytest.mark.parametrize("k, n", [(64, 96), (33, 50), (577, 17)])  # odd K and N, K % 32 tails
@pytest.mark.parametrize("bias", [False, True])
def test_dpbf16_linear_matches_the_float_sum_rounded_to_bf16(rows, k, n, bias):
    torch.manual_seed(rows * k)
    linear = nn.Linear(k, n, bias=bias).requires_grad_(False).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    with torch.inference_mode():
        got = dpbf16_only(linear)(x)
    # Both round one float32 sum to bf16; the sums differ only in their order.
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, bf16_reference(x, linear), atol=1e-2, rtol=1e-2)


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 2, 6, 7])  # up to the plan's 7: one block of rows
# 1, 3, 9 and 16 blocks (K = 48, 304 or 528: oneDNN pads them, the weight stays plain)
@pytest.mark.parametrize("k, n", [(64, 64), (320, 192), (1536, 576), (512, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_dpbf16_on_onednns_blocked_weight_matches_the_float_sum(rows, k, n, bias):
    torch.manual_seed(rows * k)
    linear = nn.Linear(k, n, bias=bias).requires_grad_(False).to(torch.bfloat16)
    module = Dpbf16Linear(linear, LIB, DPBF16_MAX_ROWS)
    # oneDNN's layout follows the real CPU (not the probe's fake): 64-column VNNI blocks on
    # AVX512-BF16 (Zen 4), another blocking on AMX, where the module keeps the plain weight.
    blocked = is_blocked_64(reorder(linear.weight), linear.weight)
    assert blocked or kernels.has_amx(LIB)
    assert (module.kernel, module.layout.is_mkldnn) == (
        ("dpbf16_blocked", True) if blocked else ("dpbf16", False))
    x = torch.randn(rows, k).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), bf16_reference(x, linear), atol=1e-2, rtol=1e-2)
        if rows > 1:  # a lone row takes a path of its own (dpbf16.c's lone_row): the same bits
            assert torch.equal(module(x[:1]), module(x)[:1])


@needs_dpbf16
@pytest.mark.parametrize("leading", [(1,), (2, 3), (1, 1, 5)])
def test_dpbf16_linear_leading_dims_and_other_inputs(leading):
    torch.manual_seed(0)
    linear = nn.Linear(40, 48, bias=True).requires_grad_(False).to(torch.bfloat16)
    x = torch.randn(*leading, 40).to(torch.bfloat16)
    check_bf16_inputs(dpbf16_only(linear), linear, x)


def check_bf16_inputs(module: nn.Module, linear: nn.Linear, x: torch.Tensor) -> None:
    """A bf16 GEMM module on x [..., K] (any leading dims) and on a strided float32 input."""
    k, n = linear.in_features, linear.out_features
    with torch.inference_mode():
        got = module(x)
        assert got.shape == (*x.shape[:-1], n)
        torch.testing.assert_close(got, bf16_reference(x, linear), atol=1e-2, rtol=1e-2)
        wide = torch.randn(k, 6).T  # float32 and strided: converted first
        torch.testing.assert_close(module(wide), bf16_reference(wide.to(torch.bfloat16), linear),
                                   atol=1e-2, rtol=1e-2)


@needs_dpbf16
def test_dpbf16_linear_hands_larger_batches_to_onednn():
    linear = nn.Linear(40, 32).requires_grad_(False).to(torch.bfloat16)
    module = Dpbf16Linear(linear, LIB, DPBF16_MAX_ROWS)
    handed = []
    library = module.library
    module.library = lambda x: handed.append(x.shape[0]) or library(x)
    with torch.inference_mode():
        for rows in (DPBF16_MAX_ROWS, DPBF16_MAX_ROWS + 1):
            x = torch.randn(rows, 40).to(torch.bfloat16)
            torch.testing.assert_close(module(x), bf16_reference(x, linear), atol=2e-2, rtol=2e-2)
    assert handed == [DPBF16_MAX_ROWS + 1]


def gemms_under_test(dtype: torch.dtype) -> list:
    linear = nn.Linear(64, 96, bias=True).requires_grad_(False).to(dtype)
    gemms = [PanelsLinear(linear, LIB)]
    if dtype == torch.bfloat16 and kernels.has_dpbf16(LIB):
        gemms.append(dpbf16_only(linear))
    return gemms


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype):
    """The GEMMs split a batch into blocks (1, 5 or 6 rows; the dpbf16 one up to 8), but each
    block sums over k in the same order: a row computed alone or in any batch gives the same
    bits."""
    torch.manual_seed(0)
    for packed in gemms_under_test(dtype):
        check_rows_alone_and_together(packed, dtype)


def check_rows_alone_and_together(packed: nn.Module, dtype: torch.dtype) -> None:
    x = torch.randn(40, 64).to(dtype)
    with torch.inference_mode():
        full = packed(x)
        for rows in (1, 4, 5, 6, 10, 11, 16, 23):
            for start in (0, 3, 17):
                assert torch.equal(packed(x[start:start + rows]), full[start:start + rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_onednn_linear_matches_linear(dtype, rows):
    if not onednn_takes(dtype):
        pytest.skip("oneDNN's bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT here")
    torch.manual_seed(rows)
    linear = nn.Linear(40, 24, bias=True).requires_grad_(False).to(dtype)
    x = torch.randn(rows, 40).to(dtype)
    with torch.inference_mode():
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(OneDNNLinear(linear)(x), linear(x), atol=tol, rtol=tol)


class LibBuiltFor:
    """LIB as if built with (or without) csrc/dpbf16.c, whatever this machine is: its GEMM is
    looked up, never called."""

    linear_dpbf16 = None

    def __init__(self, dpbf16: bool) -> None:
        self.dpbf16 = dpbf16

    def has_dpbf16(self) -> int:
        return int(self.dpbf16)

    def has_dot_fp32(self) -> int:
        return 0  # fp32's AVX-512 GEMM: nanoserve_accel/tests/test_dot_fp32.py

    def __getattr__(self, name: str):
        return getattr(LIB, name)


@needs_compiler
@pytest.mark.parametrize("kind", ["avx2", "avx512_bf16", "amx"])
@pytest.mark.parametrize("built_with_dpbf16", [True, False])
def test_each_cpu_gets_its_faster_gemm(fake_cpu, kind, built_with_dpbf16):
    """fp32: the C GEMM everywhere; bf16: the dpbf16 GEMM where the CPU has AVX512-BF16 and the
    library was built with it (any N), else oneDNN where the CPU has native bf16, else the C GEMM
    (widening); a shape the C GEMM does not take, oneDNN; float16 stays nn.Linear. (The module
    is only built here, never run: a faked dpbf16 library is not called.)"""
    fake_cpu(kind)
    lib = LibBuiltFor(built_with_dpbf16)
    native_bf16 = kind != "avx2"
    fp32 = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 32)),
                         nn.Linear(32, 20))  # 20 outputs: not a multiple of 16
    replace_linears(fp32, lib)
    assert [type(m) for m in (fp32[0], fp32[1][1], fp32[2])] == [PanelsLinear, PanelsLinear,
                                                                  OneDNNLinear]
    bf16 = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 20)).to(torch.bfloat16)
    replace_linears(bf16, lib)
    # oneDNN's bf16 needs AVX512-BW/VL/DQ, which this machine has or not whatever the fake says.
    onednn = OneDNNLinear if onednn_takes(torch.bfloat16) else None
    bf16_gemm = Dpbf16Linear if native_bf16 and built_with_dpbf16 else onednn
    assert type(bf16[0]) is ((bf16_gemm or PanelsLinear) if native_bf16 else PanelsLinear)
    assert type(bf16[1]) is (Dpbf16Linear if bf16_gemm is Dpbf16Linear else onednn or nn.Linear)
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
    """The plan's fp32 panels (a library without the dot GEMM): oneDNN from 64 rows on AVX-512."""
    fake_cpu(kind)
    linear = nn.Linear(40, 32).requires_grad_(False)
    model = nn.Sequential(linear)
    replace_linears(model, LibBuiltFor(False))
    packed = model[0]
    assert type(packed) is PanelsLinear
    assert packed.max_rows == (PANELS_MAX_ROWS if kind == "amx" else None)
    handed = []
    library = packed.library
    packed.library = lambda x: handed.append(x.shape[0]) or library(x)
    with torch.inference_mode():
        for rows in (PANELS_MAX_ROWS, PANELS_MAX_ROWS + 1):
            x = torch.randn(rows, 40)
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert handed == ([PANELS_MAX_ROWS + 1] if kind == "amx" else [])
    bf16 = PanelsLinear(nn.Linear(40, 32).to(torch.bfloat16), LIB)
    assert bf16.max_rows is None  # bf16 without native units: the C GEMM at every size


def weight_bytes_held(module: nn.Module) -> int:
    """The bytes of every tensor `module` references (its parameters, buffers and tensor
    attributes, oneDNN's opaque ones by their size), the bias left out."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers(),
                                  *(v for v in vars(module).values() if torch.is_tensor(v))]
               if t is not getattr(module, "bias", None)}
    return sum(torch.ops.mkldnn._nbytes(t) if t.is_mkldnn else t.untyped_storage().nbytes()
               for t in tensors.values())


@pytest.mark.parametrize("kind", ["avx2", "avx512_bf16", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replaced_linear_holds_its_weight_once(fake_cpu, kind, dtype):
    """Issue 37: one layout per linear, the plain parameter freed where another layout replaced
    it, and the same values as nn.Linear at and beyond the C GEMM's row limit."""
    fake_cpu(kind)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 192, bias=True)).requires_grad_(False).to(dtype)
    plain = nn.Linear(128, 192).requires_grad_(False).to(dtype)
    plain.load_state_dict(model[0].state_dict())
    gone, plain_memory = weakref.ref(model[0].weight), model[0].weight.data_ptr()
    replace_linears(model, LIB)
    module = model[0]
    assert weight_bytes_held(module) == 192 * 128 * dtype.itemsize, type(module)
    if type(module) is nn.Linear:
        return  # no fast path for this dtype here
    layout = getattr(module, "layout", None)
    if layout is not None and not layout.is_mkldnn and layout.shape == (192, 128):
        assert layout.data_ptr() == plain_memory  # the kernel reads the parameter's memory
    else:
        assert gone() is None  # another layout replaced it: the parameter is freed
    limit = getattr(module, "max_rows", None) or 16
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for rows in (1, limit, limit + 1, limit + 70):
            x = torch.randn(rows, 128).to(dtype)
            torch.testing.assert_close(module(x), plain(x), atol=tol, rtol=tol)
