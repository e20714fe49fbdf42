"""A decode step's layer as one C call (accel/layer.py, csrc/layer.c) computes exactly what the
fast path's modules compute, one kernel at a time, for every GEMM kind the CPU can be faked into
(the packed, dot-product and AMX GEMMs, mixed within a layer); it runs only on decode-only steps
within its GEMMs' row limits, and bad slots or block ids still raise the modules' errors."""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from nanoserve.layers.attention import Attention, get_backend
from nanoserve.models import decoder
from nanoserve_accel import kernels
from nanoserve_accel.fused import fuse_elementwise
from nanoserve_accel.layer import (
    ROW_STEP,
    FusedDecoderLayer,
    FusedDecoderModel,
    fuse_layers,
    padded_rows,
    warm_gemms,
)
from nanoserve_accel.linear import CLinear, replace_linears
from nanoserve_accel.paged_attention import with_decode_kernel
from tests.common.helpers import make_inputs

LIB = kernels.compile_kernels()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here")
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = [LlamaConfig(**SMALL), Qwen2Config(**SMALL),  # Qwen2: q/k/v biases
           LlamaConfig(**{**SMALL, "intermediate_size": 80, "num_key_value_heads": 1})]
BLOCK_SIZE, NUM_BLOCKS = 4, 24


class Counting:
    """The kernel library, counting the layers its decode_layer and decode_model calls ran."""

    def __init__(self, lib) -> None:
        self.lib, self.calls, self.model_calls = lib, 0, 0

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def decode_layer(self, *args):
        self.calls += 1
        return self.lib.decode_layer(*args)

    def decode_model(self, *args):
        self.model_calls += 1
        status = self.lib.decode_model(*args)
        self.calls += args[-1]._obj.value  # `done`, by reference
        return status


def count_calls(model) -> Counting:
    """Every C layer call of `model` through one Counting."""
    counting = Counting(LIB)
    for module in model.modules():
        if isinstance(module, (FusedDecoderLayer, FusedDecoderModel)):
            module.lib = counting
    return counting


def fast_model(config, dtype: torch.dtype, layers: bool,
               one_call: bool = True) -> decoder.DecoderForCausalLM:
    """The fast path's CPU model (as optimize() builds it) with its own zeroed cache; `layers`:
    with the fused layers, all in one call a step unless not `one_call`."""
    torch.manual_seed(0)
    model = decoder.DecoderForCausalLM(config).eval()
    with torch.no_grad():  # norms that are not all ones, so that swapping two of them shows
        for norm in (m for m in model.modules() if isinstance(m, decoder.RMSNorm)):
            norm.weight.uniform_(0.5, 1.5)
    model.to(dtype)
    replace_linears(model, LIB)
    fuse_elementwise(model, LIB)
    backend = with_decode_kernel(get_backend("torch"), LIB)
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        shape = (NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
        attn.bind(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), backend)
    if layers:
        fuse_layers(model, LIB)
        if not one_call and isinstance(model.model, FusedDecoderModel):  # the plain loop
            model.model.forward = functools.partial(decoder.DecoderModel.forward, model.model)
    return model


def forward(model, seqs) -> torch.Tensor:
    inputs = make_inputs(seqs, BLOCK_SIZE)
    with torch.inference_mode():
        return model(inputs.input_ids, inputs.positions, inputs.attn_metadata)


# Three requests: prefilled together, then decoding 1, 2 or 3 rows a step, then a mixed step.
TABLES = [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
STEPS = [[(TABLES[0], 0, [5, 9, 2, 7, 1]), (TABLES[1], 0, [3, 3, 8]),
          (TABLES[2], 0, [4, 1, 6, 2, 2, 9, 10])],
         [(TABLES[0], 5, [11])],
         [(TABLES[0], 6, [12]), (TABLES[1], 3, [13])],
         [(TABLES[0], 7, [14]), (TABLES[1], 4, [15]), (TABLES[2], 7, [16])],
         [(TABLES[0], 8, [17]), (TABLES[2], 8, [18, 19, 20])]]
C_LAYER_STEPS = [False, True, True, True, False]  # decode-only steps: one call per layer


@pytest.mark.parametrize("cpu_kind", ["native", "avx2", "avx512_bf16", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS, ids=["llama", "qwen2", "mqa-odd-mlp"])
@pytest.mark.parametrize("one_call", [True, False], ids=["model", "layer"])
def test_one_call_per_layer_computes_what_the_modules_do(config, dtype, cpu_kind, one_call,
                                                         fake_cpu):
    """Bit for bit: the same kernels in the same order, whichever GEMMs the CPU gives each
    linear (on the faked CPUs only those the library was built with); all layers in one call
    a step, or one call a layer."""
    if cpu_kind != "native":
        fake_cpu(cpu_kind)
    modules = fast_model(config, dtype, False)
    layers = fast_model(config, dtype, True, one_call)
    fused = [m for m in layers.modules() if isinstance(m, FusedDecoderLayer)]
    if cpu_kind == "native":  # the real CPU's library has a C GEMM for all these shapes
        assert len(fused) == config.num_hidden_layers
    else:  # a faked native-bf16 CPU whose library lacks its kernels (an AVX2 machine faked as
        assert len(fused) in (0, config.num_hidden_layers)  # AMX) sends bf16 to oneDNN
    assert isinstance(layers.model, FusedDecoderModel) == bool(fused)
    counting = count_calls(layers)
    for step, c_layer in zip(STEPS, C_LAYER_STEPS):
        calls, model_calls = counting.calls, counting.model_calls
        expected, got = forward(modules, step), forward(layers, step)
        assert torch.equal(got, expected)
        assert counting.calls - calls == (len(fused) if c_layer else 0)
        assert counting.model_calls - model_calls == (c_layer and one_call and bool(fused))
    for a, b in zip(*([m for m in model.modules() if isinstance(m, Attention)]
                      for model in (modules, layers))):  # the caches too
        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_beyond_the_c_gemms_take_the_modules(dtype):
    modules, layers = fast_model(CONFIGS[0], dtype, False), fast_model(CONFIGS[0], dtype, True)
    counting = count_calls(layers)
    for layer in (m for m in layers.modules() if isinstance(m, FusedDecoderLayer)):
        layer.max_rows = 1
    layers.model.max_rows = 1
    for step in STEPS[:3]:
        assert torch.equal(forward(layers, step), forward(modules, step))
    assert counting.calls == CONFIGS[0].num_hidden_layers  # the one-row step only


def test_qwen3_head_norms_keep_the_modules():
    config = Qwen3Config(head_dim=16, **SMALL)
    model = fast_model(config, torch.float32, True)
    assert not any(isinstance(m, FusedDecoderLayer) for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bad_slots_and_block_ids_raise_the_modules_errors(dtype):
    model = fast_model(CONFIGS[0], dtype, True)
    forward(model, STEPS[0])
    inputs = make_inputs(STEPS[1], BLOCK_SIZE)
    meta = inputs.attn_metadata
    meta.slot_mapping[0] = NUM_BLOCKS * BLOCK_SIZE  # one past the cache
    with pytest.raises(ValueError, match="slot_mapping"), torch.inference_mode():
        model(inputs.input_ids, inputs.positions, meta)
    meta = make_inputs(STEPS[1], BLOCK_SIZE).attn_metadata
    meta.decode_block_tables[0, 1] = NUM_BLOCKS  # the block the context reaches into
    with pytest.raises(ValueError, match="block"), torch.inference_mode():
        model(inputs.input_ids, inputs.positions, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bad_token_ids_and_positions_raise_the_modules_errors(dtype):
    """decode_model refuses them before it writes anything; the modules then raise."""
    modules, model = fast_model(CONFIGS[0], dtype, False), fast_model(CONFIGS[0], dtype, True)
    counting = count_calls(model)
    for m in (modules, model):
        forward(m, STEPS[0])
    for field, bad in (("input_ids", SMALL["vocab_size"]),
                       ("positions", SMALL["max_position_embeddings"])):
        inputs = make_inputs(STEPS[1], BLOCK_SIZE)
        getattr(inputs, field)[0] = bad
        for m in (modules, model):
            with pytest.raises(IndexError), torch.inference_mode():
                m(inputs.input_ids, inputs.positions, inputs.attn_metadata)
    assert counting.calls == 0 and counting.model_calls == 2
    assert torch.equal(forward(model, STEPS[1]), forward(modules, STEPS[1]))  # still serving


def test_rebuilt_rotary_tables_are_bound_again():
    modules, model = fast_model(CONFIGS[0], torch.float32, False), fast_model(
        CONFIGS[0], torch.float32, True)
    counting = count_calls(model)
    for m in (modules, model):
        forward(m, STEPS[0])
    assert torch.equal(forward(model, STEPS[1]), forward(modules, STEPS[1]))
    for m in (modules, model):  # as the loader does on the model's device, base changed
        m.model.rotary_emb.base = 500.0
        m.model.rotary_emb.reset_cache()
    assert torch.equal(forward(model, STEPS[2]), forward(modules, STEPS[2]))
    assert counting.model_calls == 2 and counting.calls == 2 * CONFIGS[0].num_hidden_layers


def test_the_input_rows_are_not_written():
    model = fast_model(CONFIGS[0], torch.float32, True)
    forward(model, STEPS[0])
    inputs = make_inputs(STEPS[1], BLOCK_SIZE)
    layer = next(m for m in model.modules() if isinstance(m, FusedDecoderLayer))
    x = torch.randn(1, SMALL["hidden_size"])
    before = x.clone()
    cos, sin = model.model.rotary_emb.cos_sin(inputs.positions, x.dtype)
    with torch.inference_mode():
        out = layer(x, cos, sin, inputs.attn_metadata)
    assert torch.equal(x, before) and not torch.equal(out, x)


def test_step_parts_build_times_each_part_and_computes_the_same(monkeypatch):
    """bench/step_breakdown.py's build (-DSTEP_PARTS): the same values, and each part's time,
    handed over once."""
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, "-DSTEP_PARTS"])
    parts_lib = kernels.compile_kernels.__wrapped__()  # (the cached call: the engine's build)
    parts_lib.step_parts.argtypes = [ctypes.c_void_p]
    parts = (ctypes.c_int64 * 6)()
    plain, timed = (fast_model(CONFIGS[0], torch.float32, True) for _ in "ab")
    for module in timed.modules():
        if isinstance(module, (FusedDecoderLayer, FusedDecoderModel)):
            module.lib = parts_lib
    forward(plain, STEPS[0]), forward(timed, STEPS[0])  # prefill: the modules
    parts_lib.step_parts(parts)
    assert torch.equal(forward(timed, STEPS[3]), forward(plain, STEPS[3]))  # three decode rows
    parts_lib.step_parts(parts)
    assert all(ns > 0 for ns in parts)  # other, qkv, attention, o, gate_up, down
    parts_lib.step_parts(parts)
    assert not any(parts)  # handed over: from 0 again
    assert not hasattr(LIB, "step_parts")  # the engine's build has no marks


def test_rows_padded_for_onednn_change_no_row(monkeypatch):
    """Beyond the C GEMMs' rows, a step's rows are padded with zero rows to a multiple of
    ROW_STEP, so that oneDNN meets only a few row counts; the step's own rows and the cache are
    what the modules compute without the padding."""
    assert [padded_rows(n) for n in (1, 16, 17, 390)] == [16, 16, 32, 400]
    modules, layers = (fast_model(CONFIGS[0], torch.bfloat16, f) for f in (False, True))
    seen = []
    for model in (modules, layers):  # oneDNN (or the tiles' passes) beyond 2 rows
        for linear in (m for m in model.modules() if isinstance(m, CLinear)):
            linear.max_rows = 2
    for linear in (m for m in layers.modules() if isinstance(m, CLinear)):
        library = linear.library
        linear.library = lambda x, library=library: seen.append(len(x)) or library(x)
    layers.model.max_rows = 2
    for step in (STEPS[0], STEPS[4]):  # 15 prefill rows; a mixed step of 5
        got, expected = forward(layers, step), forward(modules, step)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert seen and all(rows % ROW_STEP == 0 for rows in seen)
    for a, b in zip(*([m for m in model.modules() if isinstance(m, Attention)]
                      for model in (modules, layers))):
        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)


def test_warm_gemms_builds_each_shape_for_each_padded_row_count_and_team():
    layers = fast_model(CONFIGS[0], torch.bfloat16, True)
    layers.model.max_rows = 20
    built = []
    for linear in (m for m in layers.modules() if isinstance(m, CLinear)):
        linear.max_rows = 20  # a C GEMM up to 20 rows, the library beyond
        linear.library = lambda x, linear=linear: built.append(
            (linear.n, linear.k, len(x), torch.get_num_threads()))
    shapes = {(64 + 2 * 32, 64), (64, 64), (2 * 96, 64), (64, 96)}  # qkv, o, gate|up, down
    team = torch.get_num_threads()
    try:
        for threads, teams in ((3, {3, 2}), (2, {2, 1}), (1, {1})):  # whole, one fewer
            torch.set_num_threads(threads)
            built.clear()
            warm_gemms(layers, 70)
            assert sorted(built) == sorted((n, k, rows, t) for n, k in shapes
                                           for rows in (32, 48, 64) for t in teams)
            assert torch.get_num_threads() == threads  # the team is left as it was
            built.clear()
            warm_gemms(layers, 20)  # no step goes beyond the C GEMMs
            assert built == []
    finally:
        torch.set_num_threads(team)
