"""GPU check (issue #6), one prepared run of a few minutes on a CUDA machine:

  1. the CUDA tests and the model-free / tiny-model tests, on the GPU machine;
  2. flash-attn vs torch-twin backends on the same requests (if flash_attn imports);
  3. a compact bench in bf16 on random-weight models of real shapes (Qwen3-0.6B and
     SmolLM2-135M, built from configs: no download): nanoserve continuous with eager
     decode vs CUDA-graph decode, nanoserve static, and HF `generate` on padded batches.

    python scripts/gpu_check.py             # on the GPU machine
    python scripts/gpu_check.py --small     # a dry run of the same code on CPU
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from nanoserve import LLM, SamplingParams

TESTS = ["tests/test_cuda.py", "tests/test_gpu_logic.py", "tests/test_scheduler.py",
         "tests/test_attention.py", "tests/test_models.py", "tests/test_properties.py"]

SHAPES = {  # the public configs' shapes; weights are random
    "qwen3-0.6b-shape": lambda: Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1_000_000, tie_word_embeddings=True,
        eos_token_id=None, bos_token_id=None, pad_token_id=None),
    "smollm2-135m-shape": lambda: LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000, tie_word_embeddings=True,
        eos_token_id=None, bos_token_id=None, pad_token_id=None),
}
SMALL = {"tiny-llama": lambda: LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None,
    pad_token_id=None)}


def run_tests() -> str:
    tests = [t for t in TESTS if os.path.exists(t)]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *tests], capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-2000:])
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output"


def build(name: str, make_config, device: str, dtype: torch.dtype) -> str:
    path = tempfile.mkdtemp(prefix=f"{name}-")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(make_config(), dtype=dtype)
    model.save_pretrained(path)
    return path


def workload(num: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 16-256 tokens and long-tailed output lengths (lognormal, 16-256)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, rng.integers(16, 257)).tolist() for _ in range(num)]
    lengths = np.clip(rng.lognormal(np.log(48), 0.8, num), 16, 256).astype(int).tolist()
    return prompts, lengths


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_nanoserve(path, prompts, lengths, device, dtype_name, **config) -> tuple[float, int]:
    llm = LLM(path, device=device, dtype=dtype_name, skip_tokenizer_init=True, **config)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    sync(device)
    steps_before, start = llm.num_steps, time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    wall = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == lengths
    steps = llm.num_steps - steps_before
    del llm, outputs
    gc.collect()  # the runner and its graphs form a cycle: free the KV cache now
    if device == "cuda":
        torch.cuda.empty_cache()
    return wall, steps


def run_hf_static(path, prompts, lengths, device, dtype, batch) -> float:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, n = prompts[i:i + batch], max(lengths[i:i + batch])
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk],
                            device=device)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0)
    sync(device)
    return time.perf_counter() - start


def compare_backends(path: str, device: str) -> str:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash-attn vs torch: skipped, flash_attn is not importable here"
    prompts, lengths = workload(16, 512, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = {}
    for backend in ("flash-attn", "torch"):
        llm = LLM(path, device=device, dtype="bfloat16", skip_tokenizer_init=True,
                  attention_backend=backend, block_size=256)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(outs["flash-attn"], outs["torch"]))
    return f"flash-attn vs torch: {same}/{len(prompts)} requests token-identical (bf16)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="dry run on CPU, tiny model")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    dtype_name = "float32" if args.small else "bfloat16"
    dtype = getattr(torch, dtype_name)
    if device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    summary = [] if args.skip_tests else [f"tests on this machine: {run_tests()}"]
    shapes = SMALL if args.small else SHAPES
    rows = []
    for name, make_config in shapes.items():
        path = build(name, make_config, device, dtype)
        if name == next(iter(shapes)):
            summary.append(compare_backends(build("tiny", SMALL["tiny-llama"], device, dtype),
                                            device))
        vocab = make_config().vocab_size
        num = 8 if args.small else args.num_requests
        prompts, lengths = workload(num, vocab)
        useful = sum(lengths)
        common = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                      max_model_len=1024, num_kv_blocks=4096)
        systems = {
            "nanoserve continuous, eager": dict(enforce_eager=True),
            "nanoserve continuous, CUDA graphs": dict(enforce_eager=False),
            "nanoserve static, CUDA graphs": dict(enforce_eager=False,
                                                  scheduling_policy="static"),
        }
        for system, extra in systems.items():
            wall, steps = run_nanoserve(path, prompts, lengths, device, dtype_name,
                                        **common, **extra)
            rows.append((name, system, wall, useful / wall, steps))
            print(rows[-1], flush=True)
        wall = run_hf_static(path, prompts, lengths, device, dtype, args.max_num_seqs)
        rows.append((name, "HF generate, static batches", wall, useful / wall, None))
        print(rows[-1], flush=True)
    print(f"\n{num} requests, prompts 16-256 tokens, outputs lognormal 16-256 "
          f"({dtype_name}, max_num_seqs {args.max_num_seqs})")
    print("| model | system | wall s | output tok/s | steps |\n|---|---|---|---|---|")
    for name, system, wall, tps, steps in rows:
        print(f"| {name} | {system} | {wall:.2f} | {tps:.0f} | {steps or '-'} |")
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
