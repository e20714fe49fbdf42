"""The fast paths' one entry point: `optimize` is found through the entry point and replaces
whole modules on the default path only; `enable_fast_paths=False` leaves the reader's plain torch
model untouched and the process as it was; the chapter core imports nothing from
nanoserve_accel/, and runs its plain path when the plugin fails to load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import nanoserve
from nanoserve import LLM
from nanoserve.engine import model_runner
from nanoserve.engine.model_runner import fast_paths, step_inputs
from nanoserve_accel import kernels, optimize, plan
from nanoserve_accel.linear import (
    AmxLinear,
    DotFp32Linear,
    Dpbf16Linear,
    OneDNNLinear,
    PanelsLinear,
)
from tests.common.tiny_model import tiny_model_dir

CORE = Path(nanoserve.__file__).parent


def test_the_core_imports_nothing_from_the_fast_paths():
    offenders = [f"{path.relative_to(CORE)}:{n}" for path in CORE.rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"\b(import|from)\b.*\bnanoserve_accel\b", line)]
    assert offenders == []


def test_optimize_is_found_through_the_entry_point():
    assert ("accel", optimize) in fast_paths()


def test_a_plugin_that_fails_to_load_leaves_the_plain_path(monkeypatch, caplog):
    """Installed but broken (its folder deleted, say): one warning, and the engine runs plain."""
    class Broken:
        name = "accel"

        def load(self):
            raise ModuleNotFoundError("No module named 'nanoserve_accel'")

    monkeypatch.setattr(model_runner, "entry_points", lambda group: [Broken()])
    llm = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=8, skip_tokenizer_init=True)
    assert llm.model_runner.fast_paths == [] and "did not load" in caplog.text
    assert not any(isinstance(m, (PanelsLinear, OneDNNLinear, DotFp32Linear))
                   for m in llm.model_runner.model.modules())
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids


@pytest.fixture
def freed_memory_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "keep_freed_memory", lambda: calls.append(1))
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_path_swaps_linears_attention_and_the_heap(freed_memory_calls, dtype):
    llm = LLM(tiny_model_dir(), dtype=dtype, num_kv_blocks=8, skip_tokenizer_init=True)
    runner = llm.model_runner
    linears = [m for name, m in runner.model.named_modules()
               if name.endswith("_proj") or name == "lm_head"]
    lib = kernels.compile_kernels()  # the tiny model's shapes all fit the AMX GEMM's tiles
    kind = plan.gemm(plan.Machine.probe(lib), runner.dtype, 64, 64).kernel
    expected = {"panels": PanelsLinear, "onednn": OneDNNLinear, "dpbf16": Dpbf16Linear,
                "amx": AmxLinear, "dot_fp32": DotFp32Linear}[kind]
    assert len(linears) == 4 * 2 + 1 and {type(m) for m in linears} == {expected}  # merged
    assert not any(type(m) is nn.Linear for m in runner.model.modules())
    backend = "torch+cpu-decode" if kernels.compile_kernels() else "torch"
    if plan.prefill_attention(plan.Machine.probe(lib), runner.dtype) != "torch twin":
        backend += "+cpu-prefill"  # prefill chunks: csrc/attention_prefill.c
    assert runner.backend.name == backend
    assert all(a.backend is runner.backend for a in runner.attn_layers)  # bound to it
    assert freed_memory_calls == [1]


def test_without_fast_paths_the_model_is_the_plain_one(freed_memory_calls):
    llm = LLM(tiny_model_dir(), dtype="float32", enable_fast_paths=False, num_kv_blocks=8,
              skip_tokenizer_init=True)
    runner = llm.model_runner
    fast = (PanelsLinear, OneDNNLinear, DotFp32Linear)
    assert not any(isinstance(m, fast) for m in runner.model.modules())
    assert runner.backend.name == "torch" and freed_memory_calls == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_and_plain_models_agree(dtype):
    """One prefill step of three prompts: the same logits within rounding, whichever GEMM this
    CPU gets (greedy-token identity is tested in fp32 end to end: tests/core/test_engine_e2e.py)."""
    logits = {}
    for eager in (True, False):
        llm = LLM(tiny_model_dir(), dtype=dtype, enable_fast_paths=not eager, num_kv_blocks=16,
                  block_size=16, skip_tokenizer_init=True)
        for n in (3, 20, 9):
            llm.add_request([7] * n)
        runner = llm.model_runner
        step, _ = step_inputs(llm.scheduler.schedule(), runner.block_size)
        inputs = step.to(runner.device)
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            logits[eager] = runner.model.compute_logits(hidden).float()
    tol = 1e-4 if dtype == "float32" else 5e-2 * logits[True].abs().max().item()
    torch.testing.assert_close(logits[False], logits[True], atol=tol, rtol=0)


def test_two_ranks_take_the_c_gemms_and_keep_their_collectives():
    """Tensor parallel: o_proj and down_proj (row-parallel) run the plan's GEMM and then their
    all-reduce, the vocab-parallel lm_head its GEMM and then the gather; greedy tokens equal the
    plain path's on two ranks (fp32; every linear with a bias, added once)."""
    from nanoserve import SamplingParams
    from nanoserve_accel.linear import AllReducedLinear, GatheredLMHead
    from tests.common.architectures import architecture_dir, prompts

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for fast in (True, False):
        llm = LLM(architecture_dir("llama-bias"), dtype="float32", skip_tokenizer_init=True,
                  num_kv_blocks=32, block_size=16, tensor_parallel_size=2,
                  enable_fast_paths=fast)
        try:
            model = llm.model_runner.model
            kinds = {type(m) for m in model.modules()}
            assert (AllReducedLinear in kinds and GatheredLMHead in kinds) == fast
            tokens[fast] = [o.token_ids for o in llm.generate(prompts(), greedy, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert tokens[True] == tokens[False]
