"""csrc/dot_fp32.c's AVX-512 GEMM (DotFp32Linear) computes what nn.Linear computes in fp32, whatever
rows surround a row, and is what fp32 gets on AVX-512 CPUs (only where the library was built with
it; never on avx2); skipped where the real CPU's library lacks it."""

import pytest
import torch
from torch import nn

from nanoserve_accel import kernels, plan
from nanoserve_accel.linear import (
    DotFp32Linear,
    OneDNNLinear,
    PanelsLinear,
    replace_linears,
)
from nanoserve_accel.plan import DOT_FP32_MAX_ROWS

LIB = kernels.compile_kernels()
# The compiled code follows the real machine (-march=native), whatever CPU the probe is faked as.
needs_dot_fp32 = pytest.mark.skipif(not kernels.has_dot_fp32(LIB),
                                    reason="the kernels were not built with AVX-512F here")


def dot_only(linear: nn.Linear) -> DotFp32Linear:
    """The dot_fp32 GEMM at every row count: no handover to oneDNN."""
    return DotFp32Linear(linear, LIB)


def reference(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """x @ w.T (+ bias) summed in float64, then rounded to float32."""
    bias = 0 if linear.bias is None else linear.bias.double()
    return (x.double() @ linear.weight.double().T + bias).float()


@needs_dot_fp32
@pytest.mark.parametrize("rows", range(1, 18))  # blocks of up to 6 rows, split evenly
@pytest.mark.parametrize("k, n", [(64, 96), (33, 50), (577, 17), (7, 3)])  # K % 16 tails, odd N
@pytest.mark.parametrize("bias", [False, True])
def test_dot_fp32_matches_linear(rows, k, n, bias):
    torch.manual_seed(rows * k)
    linear = nn.Linear(k, n, bias=bias).requires_grad_(False)
    x = torch.randn(rows, k)
    with torch.inference_mode():
        got = dot_only(linear)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, reference(x, linear), atol=1e-5, rtol=1e-5)


@needs_dot_fp32
@pytest.mark.parametrize("leading", [(1,), (2, 3), (1, 1, 5)])
def test_dot_fp32_leading_dims_and_other_inputs(leading):
    torch.manual_seed(0)
    linear = nn.Linear(40, 48, bias=True).requires_grad_(False)
    x = torch.randn(*leading, 40)
    module = dot_only(linear)
    with torch.inference_mode():
        got = module(x)
        assert got.shape == (*leading, 48)
        torch.testing.assert_close(got, reference(x, linear), atol=1e-5, rtol=1e-5)
        strided = torch.randn(40, 6).T  # strided: copied first
        torch.testing.assert_close(module(strided), reference(strided, linear), atol=1e-5,
                                   rtol=1e-5)
        bf16 = torch.randn(3, 40).to(torch.bfloat16)  # another dtype: widened first
        torch.testing.assert_close(module(bf16), reference(bf16.float(), linear), atol=1e-5,
                                   rtol=1e-5)


@needs_dot_fp32
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Rows go in blocks of as even a size as can be (up to 6), but every (row, column) sums its
    k in one order: a row alone or in any batch gives the same bits."""
    torch.manual_seed(0)
    module = dot_only(nn.Linear(70, 50, bias=True).requires_grad_(False))
    x = torch.randn(40, 70)
    with torch.inference_mode():
        full = module(x)
        for rows in (1, 4, 5, 6, 7, 10, 11, 13, 16, 23):
            for start in (0, 3, 17):
                assert torch.equal(module(x[start:start + rows]), full[start:start + rows])


@needs_dot_fp32
def test_dot_fp32_hands_larger_batches_to_onednn_on_the_same_weight():
    linear = nn.Linear(40, 32).requires_grad_(False)
    module = DotFp32Linear(linear, LIB, DOT_FP32_MAX_ROWS)
    handed = []
    library = module.library
    module.library = lambda x: handed.append(x.shape[0]) or library(x)
    with torch.inference_mode():
        for rows in (DOT_FP32_MAX_ROWS, DOT_FP32_MAX_ROWS + 1):
            x = torch.randn(rows, 40)
            torch.testing.assert_close(module(x), reference(x, linear), atol=1e-5, rtol=1e-5)
    assert handed == [DOT_FP32_MAX_ROWS + 1]


class LibBuiltFor:
    """LIB as if built with (or without) csrc/dot_fp32.c: its GEMM is looked up, never called."""

    linear_dot_fp32 = None

    def __init__(self, dot_fp32: bool) -> None:
        self.dot_fp32 = dot_fp32

    def has_dot_fp32(self) -> int:
        return int(self.dot_fp32)

    def __getattr__(self, name: str):
        return getattr(LIB, name)


@pytest.mark.skipif(LIB is None, reason="no C compiler here")
@pytest.mark.parametrize("kind", ["avx2", "avx512_bf16", "amx"])
@pytest.mark.parametrize("built_with_dot_fp32", [True, False])
def test_fp32_gets_the_dot_gemm_only_on_avx512_with_a_library_built_for_it(
        fake_cpu, kind, built_with_dot_fp32):
    """Any N for the dot GEMM; else the packed C GEMM (N a multiple of 16) or oneDNN."""
    fake_cpu(kind)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 20))  # 20: not a multiple of 16
    replace_linears(model, LibBuiltFor(built_with_dot_fp32))
    if kind != "avx2" and built_with_dot_fp32:
        assert [type(m) for m in model] == [DotFp32Linear, DotFp32Linear]
    else:
        assert [type(m) for m in model] == [PanelsLinear, OneDNNLinear]


def blocked(linear: nn.Linear, max_rows: int = 64) -> DotFp32Linear:
    """DotFp32Linear on oneDNN's reordered weight (it hands over beyond max_rows). oneDNN pads K
    to a multiple of 16, which the kernel does not read: such a weight stays plain."""
    module = DotFp32Linear(linear, LIB, max_rows)
    assert module.kernel == "dot_fp32_blocked" and module.layout.is_mkldnn
    return module


@needs_dot_fp32
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 8, 13, 15, 22])  # 7-row blocks; K chunks from 8
@pytest.mark.parametrize("k, n", [(48, 64), (304, 192), (528, 1024)])  # 1, 3, 16 blocks
@pytest.mark.parametrize("bias", [False, True])
def test_the_blocked_gemm_on_onednns_weight_matches_linear(rows, k, n, bias):
    torch.manual_seed(rows * k)
    linear = nn.Linear(k, n, bias=bias).requires_grad_(False)
    x = torch.randn(rows, k)
    with torch.inference_mode():
        got = blocked(linear)(x)
    torch.testing.assert_close(got, reference(x, linear), atol=1e-4, rtol=1e-5)


@needs_dot_fp32
def test_the_blocked_gemm_gives_a_row_the_same_bits_in_any_batch_and_hands_over():
    """K is summed in chunks once there are 8 rows or more, the partial sums kept in float32 in
    the output: exact, so a row alone or in any batch gives the same bits. Beyond max_rows oneDNN
    takes the rows, on the same reordered tensor."""
    torch.manual_seed(0)
    linear = nn.Linear(608, 128, bias=True).requires_grad_(False)
    module = blocked(linear, max_rows=16)
    handed = []
    library = module.library
    module.library = lambda x: handed.append(x.shape[0]) or library(x)
    x = torch.randn(16, 608)
    with torch.inference_mode():
        full = module(x)
        for rows in (1, 3, 7, 8, 9, 15):
            for start in (0, 1):
                assert torch.equal(module(x[start:start + rows]), full[start:start + rows])
        more = torch.randn(17, 608)
        torch.testing.assert_close(module(more), reference(more, linear), atol=1e-4, rtol=1e-5)
    assert handed == [17]


@needs_dot_fp32
def test_a_weight_onednn_pads_stays_plain():
    """oneDNN pads K = 40 to 48: not the layout the blocked GEMM reads, so dot_fp32 keeps the plain
    weight and oneDNN re-packs it beyond max_rows."""
    module = DotFp32Linear(nn.Linear(40, 64).requires_grad_(False), LIB, 16)
    assert module.kernel == "dot_fp32" and not module.layout.is_mkldnn


@needs_dot_fp32
def test_a_tied_fp32_head_reads_the_embeddings_table_and_the_rest_are_blocked():
    """An lm_head tied to the embedding keeps that one table (dot_fp32 at every row count); an
    untied linear of the same shape takes oneDNN's blocked weight, its plain one dropped."""
    model = nn.Module()
    model.embed = nn.Embedding(128, 64)
    model.head = nn.Linear(64, 128, bias=False)
    model.head.weight = model.embed.weight
    model.other = nn.Linear(64, 128, bias=False)
    model.requires_grad_(False)
    x = torch.randn(3, 64)
    want_head, want_other = reference(x, model.head), reference(x, model.other)
    replace_linears(model, LIB, plan.FAMILIES["AVX512-BF16, no AMX (AMD Zen 4, Zen 5)"])
    assert model.head.kernel == "dot_fp32" and model.head.max_rows is None
    assert model.head.layout.data_ptr() == model.embed.weight.data_ptr()
    assert model.other.kernel == "dot_fp32_blocked"
    with torch.inference_mode():
        torch.testing.assert_close(model.head(x), want_head, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.other(x), want_other, atol=1e-4, rtol=1e-5)
