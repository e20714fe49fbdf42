"""The optimized CPU path: pre-packed fp32 linears compute what nn.Linear computes, and
dtype="auto" picks bf16 on a CPU only where it has bf16 matmul units."""

import pytest
import torch
from torch import nn

from nanoserve import config
from nanoserve.layers import cpu_linear
from nanoserve.layers.cpu_linear import PackedLinear, pack_linears


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias).requires_grad_(False)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_pack_linears_swaps_fp32_only():
    fp32 = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4)))
    pack_linears(fp32)
    assert isinstance(fp32[0], PackedLinear) and isinstance(fp32[1][1], PackedLinear)
    bf16 = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    pack_linears(bf16)
    assert isinstance(bf16[0], nn.Linear)


@pytest.mark.parametrize("native_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_on_cpu(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(config, "cpu_has_bf16_matmul", lambda: native_bf16)
    assert config.resolve_dtype("auto", "cpu") == expected
    assert config.resolve_dtype("float32", "cpu") == "float32"
    assert config.resolve_dtype("auto", "cuda") == "bfloat16"
    assert isinstance(cpu_linear.cpu_has_bf16_matmul(), bool)
