"""The GPU path, run only where CUDA is available (scripts/dev/gpu_check.py runs it there).

Each test states its backend. Exact token equality is asserted only for the torch twins
in fp32 (attention_backend="torch"): nanoserve gives HF's greedy tokens, and CUDA-graph
replay of decode steps gives eager's tokens. With flash-attn (bf16) graph replay and eager
are not bitwise equal (num_splits depends on the batch and table width), so those tests
compare logits within a tolerance.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from nanoserve import LLM, SamplingParams
from nanoserve.engine.cuda_graph import CUDAGraphRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIGS = {
    "llama": lambda: LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=1024,
                                 eos_token_id=None, bos_token_id=None, pad_token_id=None),
    "qwen3": lambda: Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                                 num_hidden_layers=2, num_attention_heads=4, head_dim=64,
                                 num_key_value_heads=2, max_position_embeddings=1024,
                                 eos_token_id=None, bos_token_id=None, pad_token_id=None),
}
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():  # wider logits keep greedy argmax away from near-ties
        for p in model.parameters():
            p.mul_(5.0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return str(path), model.to("cuda").eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 17, 40, 3, 64, 9)]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, min_new_tokens=0, pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_greedy_matches_hf(tiny, enforce_eager):
    path, hf = tiny
    llm = LLM(path, device="cuda", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
              enforce_eager=enforce_eager, max_num_seqs=8, num_kv_blocks=64,
              attention_backend="torch")  # fp32: exact tokens are a torch-twin property
    assert isinstance(llm.model_runner.model, CUDAGraphRunner) != enforce_eager
    outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts(), outputs):
        assert out.token_ids == hf_greedy(hf, prompt)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cuda_graphs_equal_eager_under_preemption(tiny):
    """Torch twins, fp32, 16-token blocks: token equality is exact there (not with flash-attn)."""
    path, _ = tiny
    results = []
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="float32", skip_tokenizer_init=True, max_model_len=512,
                  enforce_eager=eager, max_num_seqs=6, num_kv_blocks=14, block_size=16,
                  attention_backend="torch")
        results.append([o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)])
        assert llm.stats().num_preemptions > 0
    assert results[0] == results[1]


def test_kv_cache_sized_from_gpu_memory(tiny):
    path, _ = tiny
    gc.collect()  # earlier tests' engines count as this process's memory until collected
    torch.cuda.empty_cache()
    llm = LLM(path, device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.05,
              max_model_len=512)
    runner = llm.model_runner
    kv_bytes = runner.num_kv_blocks * runner.kv_bytes_per_block()
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0 < kv_bytes < 0.05 * total


@pytest.mark.parametrize(("dtype", "backend"), [("bfloat16", "auto"), ("float32", "torch")])
def test_graph_replay_matches_eager_logits_within_tolerance(tiny, dtype, backend):
    """bf16 with `auto` is flash-attn where it runs (else the torch twins): logits within
    tolerance, padding rows writing only the sink block and reading nothing else."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))
    from gpu_check import graph_vs_eager

    path, _ = tiny
    llm = LLM(path, device="cuda", dtype=dtype, attention_backend=backend, max_num_seqs=8,
              num_kv_blocks=64, max_model_len=1024, skip_tokenizer_init=True)
    assert llm.model_runner.model.graphs, "capture failed (see the warning)"
    result = graph_vs_eager(llm)
    assert result["logits_within_tolerance"], result
    assert result["writes_only_own_slots_and_sink"] and result["padding_outputs_finite"], result


def test_auto_backend_on_this_gpu_follows_dtype_and_compute_capability(tiny):
    from nanoserve.config import resolve_attention_backend

    cuda = torch.device("cuda")
    assert resolve_attention_backend("auto", cuda, torch.float32) == "torch"
    try:
        import flash_attn  # noqa: F401
        usable = torch.cuda.get_device_capability() >= (8, 0)
    except ImportError:
        usable = False
    assert resolve_attention_backend("auto", cuda, torch.bfloat16) == ("flash-attn" if usable
                                                                       else "torch")
