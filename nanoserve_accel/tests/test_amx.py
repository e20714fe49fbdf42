"""The AMX GEMM (csrc/amx.c, where the library was built with it and Linux grants the tiles)
computes what nn.Linear computes in bf16, at every row count of one pass and past it (oneDNN on
the same weight, or the tiles' passes), and a CPU whose probe shows amx_bf16 gets it for the
shapes its tiles take; other CPUs, other libraries and other shapes keep their GEMMs."""

import pytest
import torch
from torch import nn

from nanoserve_accel import kernels
from nanoserve_accel.linear import (
    AmxLinear,
    DotFp32Linear,
    Dpbf16Linear,
    OneDNNLinear,
    PanelsLinear,
    amx_fits,
    pack_tiles,
    replace_linears,
)
from nanoserve_accel.plan import AMX_MAX_ROWS, onednn_runs
from nanoserve_accel.tests.test_linear import (
    LIB,
    bf16_reference,
    check_bf16_inputs,
)

needs_compiler = pytest.mark.skipif(LIB is None, reason="no C compiler here")
# The compiled code follows the real machine (-march=native), whatever CPU the probe is faked as.
needs_amx = pytest.mark.skipif(not kernels.has_amx(LIB),
                               reason="the kernels were not built with AMX here (or no tiles)")


def bf16_linear(k: int, n: int, bias: bool = True) -> nn.Linear:
    return nn.Linear(k, n, bias=bias).requires_grad_(False).to(torch.bfloat16)


def test_packed_tiles_hold_each_weight_where_the_tile_unit_reads_it():
    n, k = 96, 96
    w = torch.arange(n * k, dtype=torch.float32).view(n, k).to(torch.bfloat16)
    tiles = pack_tiles(w)  # [block][chunk][k-pair][column][2]
    assert tiles.shape == (n // 32, k // 32, 16, 32, 2) and tiles.is_contiguous()
    for b, c, p, j, e in [(0, 0, 0, 0, 1), (1, 2, 5, 3, 0), (2, 1, 15, 31, 1), (1, 0, 7, 20, 0)]:
        assert tiles[b, c, p, j, e] == w[32 * b + j, 32 * c + 2 * p + e]


@needs_amx
@pytest.mark.skipif(not onednn_runs(torch.bfloat16), reason="oneDNN does not run bf16 here")
@pytest.mark.parametrize("n, k", [(96, 64), (576, 1536), (3072, 576)])
def test_the_module_keeps_onednns_weight_where_it_is_the_tiles_layout(n, k):
    """On an AMX CPU oneDNN lays these shapes out as pack_tiles does: the module keeps that one
    copy, and oneDNN reads it beyond max_rows."""
    torch.manual_seed(n)
    linear = bf16_linear(k, n)
    module = AmxLinear(linear, LIB, AMX_MAX_ROWS)
    assert module.layout.is_mkldnn and module.w_ptr == torch.ops.mkldnn.data_ptr(module.layout)
    x = torch.randn(AMX_MAX_ROWS + 9, k).to(torch.bfloat16)
    with torch.inference_mode():
        for rows in (1, 3, AMX_MAX_ROWS, AMX_MAX_ROWS + 9):
            torch.testing.assert_close(module(x[:rows]), bf16_reference(x[:rows], linear),
                                       atol=2e-2, rtol=2e-2)
    assert not AmxLinear(linear, LIB, None).layout.is_mkldnn  # no limit: the tiles' passes


@pytest.mark.parametrize("shape", [(64, 20), (40, 32), (64, 48)])  # N % 32, K % 32
def test_shapes_the_tiles_do_not_take_are_refused(shape):
    linear = bf16_linear(*shape)
    assert not amx_fits(linear) and not amx_fits(nn.Linear(64, 32))  # nor float32
    with pytest.raises(ValueError, match="N % 32 == 0 and K % 32 == 0"):
        AmxLinear(linear, LIB, None)


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 65, 130])  # blocks of 16, passes of 64
@pytest.mark.parametrize("k, n", [(64, 96), (576, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_the_float_sum_rounded_to_bf16(rows, k, n, bias):
    torch.manual_seed(rows * k)
    linear = bf16_linear(k, n, bias)
    x = torch.randn(rows, k).to(torch.bfloat16)
    with torch.inference_mode():
        got = AmxLinear(linear, LIB, None)(x)
    # Both round one float32 sum to bf16; the sums differ only in their order.
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got, bf16_reference(x, linear), atol=1e-2, rtol=1e-2)


@needs_amx
@pytest.mark.parametrize("leading", [(1,), (2, 3), (1, 1, 5), (4, 5)])
def test_amx_linear_leading_dims_and_other_inputs(leading):
    torch.manual_seed(0)
    linear = bf16_linear(64, 32)
    module = AmxLinear(linear, LIB, None)
    check_bf16_inputs(module, linear, torch.randn(*leading, 64).to(torch.bfloat16))
    with torch.inference_mode():
        assert module(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)


@needs_amx
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Blocks of 16 rows and a last, shorter one: on the tiles each row sums its k in one order.
    A lone row takes the dot products (amx.c, row_dots): the same sums in another order."""
    torch.manual_seed(0)
    module = AmxLinear(bf16_linear(576, 96), LIB, None)
    x = torch.randn(40, 576).to(torch.bfloat16)
    with torch.inference_mode():
        full = module(x)
        for rows in (2, 4, 5, 6, 10, 11, 16, 23):
            for start in (0, 3, 17):
                assert torch.equal(module(x[start:start + rows]), full[start:start + rows])
        alone = torch.cat([module(x[i:i + 1]) for i in range(len(x))])
    torch.testing.assert_close(alone, full, atol=1e-2, rtol=1e-2)


@needs_amx
def test_amx_linear_hands_larger_batches_to_its_library():
    linear = bf16_linear(64, 32)
    module = AmxLinear(linear, LIB, AMX_MAX_ROWS)
    handed = []
    library = module.library
    module.library = lambda x: handed.append(x.shape[0]) or library(x)
    with torch.inference_mode():
        for rows in (AMX_MAX_ROWS, AMX_MAX_ROWS + 1):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            torch.testing.assert_close(module(x), bf16_reference(x, linear), atol=2e-2, rtol=2e-2)
    assert handed == [AMX_MAX_ROWS + 1]


class LibWithAmx:
    """LIB as if built with (or without) csrc/amx.c, or refused the tiles by Linux: its GEMM is
    looked up, never called."""

    linear_amx = None

    def __init__(self, built: bool, granted: bool = True) -> None:
        self.built, self.granted = built, granted

    def has_amx(self) -> int:
        return int(self.built)

    def amx_init(self) -> int:
        return int(self.granted)

    def __getattr__(self, name: str):
        return getattr(LIB, name)


@needs_compiler
@pytest.mark.parametrize("kind", ["avx2", "avx512_bf16", "amx"])
@pytest.mark.parametrize("built, granted", [(True, True), (True, False), (False, True)])
def test_only_an_amx_cpu_with_an_amx_library_gets_the_amx_gemm(fake_cpu, kind, built, granted):
    fake_cpu(kind)
    lib = LibWithAmx(built, granted)
    model = nn.Sequential(bf16_linear(64, 32), bf16_linear(40, 32))  # K = 40: not the tiles'
    replace_linears(model, lib)
    amx = kind == "amx" and built and granted
    onednn = OneDNNLinear if onednn_runs(torch.bfloat16) else PanelsLinear  # (this machine's)
    others = {"avx2": PanelsLinear, "avx512_bf16": Dpbf16Linear if kernels.has_dpbf16(LIB)
              else onednn}
    others["amx"] = others["avx512_bf16"]
    assert type(model[0]) is (AmxLinear if amx else others[kind])
    assert type(model[1]) is others[kind]
    fp32 = nn.Sequential(nn.Linear(64, 32))
    replace_linears(fp32, lib)  # fp32 never takes the AMX GEMM
    wide = kind != "avx2" and kernels.has_dot_fp32(LIB)
    assert type(fp32[0]) is (DotFp32Linear if wide else PanelsLinear)


@needs_amx
def test_the_real_library_gets_the_amx_gemm_on_an_amx_cpu(fake_cpu):
    fake_cpu("amx")
    linear = bf16_linear(64, 32)
    model = nn.Sequential(linear)
    replace_linears(model, LIB)  # the module keeps only its packed tiles, not linear.weight
    assert type(model[0]) is AmxLinear and model[0].max_rows == AMX_MAX_ROWS
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), bf16_reference(x, linear), atol=1e-2, rtol=1e-2)
