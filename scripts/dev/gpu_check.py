"""GPU check: one prepared run of a few minutes on a CUDA machine.

Checks, in order (each prints one line; the kernel and graph checks print a table):
  0. versions: flash-attn / torch / CUDA / GPU name and SM (compute capability).
  1. the CUDA tests and the model-free / tiny-model tests, on this machine (pytest).
  2. attention kernels, one shot each, on shuffled block tables whose unused blocks are
     NaN (a kernel that reads one fails), for three request mixes: whole prompts (GQA 1);
     chunks starting mid-page (GQA 3); lengths crossing 256 and 512 (GQA 8):
       - flash-attn (bf16, 256-token pages) vs the fp32 torch twin, within tolerance,
         prefill (varlen) and decode (kvcache), if flash_attn imports and SM >= 8.0;
       - otherwise the torch twins on CUDA standing in for flash-attn (bf16, 256-token
         pages, contract checks on) vs a dense fp64 reference;
       - always: the fp32 torch twins (16-token pages) vs the dense fp64 reference.
  3. CUDA-graph replay vs eager for one decode step with padding rows, per backend:
     logits within tolerance (never bitwise: flash-attn's num_splits depends on the batch),
     padding rows write only the sink block and read nothing else (their outputs finite).
  4. flash-attn vs torch backends end to end (token agreement; informational, bf16 ties).
  5. a compact bench in bf16 on random-weight models of real shapes (Qwen3-0.6B and
     SmolLM2-135M, built from configs: no download): nanoserve continuous with eager
     decode vs CUDA-graph decode, nanoserve static, and HF `generate` on padded batches.

    python scripts/dev/gpu_check.py                # everything, on the GPU machine
    python scripts/dev/gpu_check.py --checks-only  # 0, 2, 3 only (about a minute)
    python scripts/dev/gpu_check.py --small        # a dry run of the same code on CPU

The tensor logic of checks 2 and 3 is importable; tests/test_gpu_check.py runs it on CPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from nanoserve import LLM, SamplingParams
from nanoserve.engine.cuda_graph import CUDAGraphRunner, padded_batch_size
from nanoserve.layers import torch_attention
from nanoserve.layers.attention import AttentionMetadata

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


# -- 0. versions ---------------------------------------------------------------------

def versions_line() -> str:
    try:
        import flash_attn
        fa = flash_attn.__version__
    except ImportError:
        fa = "absent"
    gpu = "no CUDA"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        gpu = f"{torch.cuda.get_device_name(0)}, SM {major}.{minor}, CUDA {torch.version.cuda}"
    return f"flash-attn {fa} | torch {torch.__version__} | {gpu}"


# -- 2. attention kernels (pure tensors) --------------------------------------------------

KERNEL_CASES = {  # name: ([(context_len, chunk_len) per request], GQA group)
    "whole prompts, GQA 1": ([(7, 7), (33, 33), (1, 1), (256, 256)], 1),
    "chunks mid-page, GQA 3": ([(20, 6), (300, 45), (16, 1), (9, 4), (270, 13)], 3),
    "crossing 256/512, GQA 8": ([(255, 255), (257, 2), (511, 100), (513, 513), (600, 88)], 8),
}
HALF_ATOL, FP32_ATOL = 2e-2, 1e-4


def paged_case(lens: list[tuple[int, int]], group: int, block_size: int, num_kv_heads: int = 2,
               head_dim: int = 64, seed: int = 0) -> dict:
    """fp32 CPU inputs: each request's K/V in shuffled blocks of one paged cache; table rows
    padded with the row's own first block (finite, as the engine pads with real blocks);
    every block no request uses is NaN, so a kernel that reads past a context fails."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    needed = [-(-ctx // block_size) for ctx, _ in lens]
    num_blocks = sum(needed) + 4
    ids = rng.sample(range(num_blocks), num_blocks)
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at:at + n])
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k[ids[at:]] = float("nan")
    v[ids[at:]] = float("nan")
    q = torch.randn(sum(c for _, c in lens), num_kv_heads * group, head_dim, generator=gen)
    width = max(needed) + 1
    table = torch.tensor([t + t[:1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return dict(q=q, k=k, v=v, lens=lens, block_table=table, block_size=block_size)


def run_backend(varlen, with_kvcache, case: dict, dtype: torch.dtype, device: str,
                **flags) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill every chunk (varlen), and decode each request's last query over its whole
    context (kvcache). Outputs in fp32 on the CPU."""
    lens = case["lens"]
    q, k, v = (case[n].to(device=device, dtype=dtype) for n in ("q", "k", "v"))

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    cu_q, cu_k = np.cumsum([0] + [c for _, c in lens]), np.cumsum([0] + [c for c, _ in lens])
    table, scale = case["block_table"].to(device), q.shape[-1] ** -0.5
    prefill = varlen(q, k, v, cu_seqlens_q=i32(cu_q.tolist()), cu_seqlens_k=i32(cu_k.tolist()),
                     max_seqlen_q=max(c for _, c in lens), max_seqlen_k=max(c for c, _ in lens),
                     softmax_scale=scale, causal=True, block_table=table, **flags)
    last = torch.tensor(cu_q[1:] - 1, device=device)
    decode = with_kvcache(q[last].unsqueeze(1), k, v, cache_seqlens=i32([c for c, _ in lens]),
                          block_table=table, softmax_scale=scale, causal=True, **flags)
    return prefill.float().cpu(), decode.squeeze(1).float().cpu()


def dense_reference(case: dict, dtype: torch.dtype = torch.float32,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same outputs, slot by slot and in fp64 (inputs rounded to `dtype` first)."""
    bs, table = case["block_size"], case["block_table"].tolist()
    q, k, v = (case[n].to(dtype).double() for n in ("q", "k", "v"))
    k, v = k.flatten(0, 1), v.flatten(0, 1)  # [slots, Hkv, D]
    outs, start = [], 0
    for i, (ctx, chunk) in enumerate(case["lens"]):
        slots = torch.tensor([table[i][p // bs] * bs + p % bs for p in range(ctx)])
        group = q.shape[1] // k.shape[1]
        ki, vi = (t[slots].repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[start:start + chunk], ki) / q.shape[-1] ** 0.5
        visible = torch.arange(ctx)[None, :] <= torch.arange(chunk)[:, None] + (ctx - chunk)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vi))
        start += chunk
    prefill = torch.cat(outs).float()
    last = torch.tensor(np.cumsum([c for _, c in case["lens"]]) - 1)
    return prefill, prefill[last]


def check_kernels(label: str, run, reference, block_size: int, atol: float,
                  ) -> list[tuple[str, str, float, bool]]:
    """(label, case, max |error| over prefill and decode, within atol) per KERNEL_CASES entry.
    `run(case)` and `reference(case)` return (prefill, decode) outputs."""
    rows = []
    for seed, (name, (lens, group)) in enumerate(KERNEL_CASES.items()):
        case = paged_case(lens, group, block_size, seed=seed)
        errors = [(a - b).abs().max().item() for a, b in zip(run(case), reference(case))]
        rows.append((label, name, max(errors), all(e <= atol for e in errors)))  # NaN fails
    return rows


def kernel_checks(device: str) -> list[tuple[str, str, float, bool]]:
    twins = (torch_attention.flash_attn_varlen_func, torch_attention.flash_attn_with_kvcache)
    rows = check_kernels("torch twins fp32, pages of 16, vs dense",
                         lambda c: run_backend(*twins, c, torch.float32, device),
                         dense_reference, 16, FP32_ATOL)
    flash = None
    if device == "cuda" and torch.cuda.get_device_capability(0) >= (8, 0):
        try:
            import flash_attn
            flash = (flash_attn.flash_attn_varlen_func, flash_attn.flash_attn_with_kvcache)
        except ImportError:
            pass
    if flash is not None:
        rows += check_kernels("flash-attn bf16 vs torch twin fp32, pages of 256",
                              lambda c: run_backend(*flash, c, torch.bfloat16, device),
                              lambda c: run_backend(*twins, c, torch.float32, device),
                              256, HALF_ATOL)
    else:
        rows += check_kernels("torch twins as flash-attn (bf16, contract), pages of 256",
                              lambda c: run_backend(*twins, c, torch.bfloat16, device,
                                                    flash_contract=True),
                              lambda c: dense_reference(c, torch.bfloat16), 256, HALF_ATOL)
    return rows


# -- 3. CUDA-graph replay vs eager -------------------------------------------------------

def graph_vs_eager(llm: LLM, ctx_lens: tuple[int, ...] = (37, 300, 5)) -> dict:
    """One decode step of len(ctx_lens) rows, eager and then replayed from the graph of the
    next captured size (so padding rows exist). The cache is random, and NaN in blocks no
    row uses. The engine's cache is garbage afterwards: use a throwaway LLM."""
    runner, graphs = llm.model_runner, llm.model_runner.model  # a CUDAGraphRunner
    bs, sink, kv = runner.block_size, runner.num_kv_blocks, runner.kv_cache
    n, per, device = len(ctx_lens), -(-max(ctx_lens) // runner.block_size), kv.device
    if n * per > sink:
        raise ValueError(f"graph_vs_eager needs {n * per} KV blocks, the engine has {sink}")
    tables = [[i * per + j for j in range(per)] for i in range(n)]
    torch.manual_seed(0)
    kv.normal_()
    kv[:, :, n * per:sink] = float("nan")
    slots = [tables[i][(c - 1) // bs] * bs + (c - 1) % bs for i, c in enumerate(ctx_lens)]

    def t(values, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=t(slots, torch.int64), num_decode_tokens=n, decode_context_lens=t(ctx_lens),
        decode_block_tables=t(tables), num_prefill_tokens=0, cu_seqlens_q=t([0]),
        cu_seqlens_k=t([0]), max_seqlen_q=0, max_seqlen_k=0,
        prefill_block_tables=t([[0]])[:0])
    ids, positions = t([11 + i for i in range(n)], torch.int64), t([c - 1 for c in ctx_lens],
                                                                  torch.int64)
    with torch.inference_mode():
        eager = graphs.compute_logits(graphs.model(ids, positions, meta)).float()
        before = kv.clone()
        replay = graphs.compute_logits(graphs(ids, positions, meta)).float()
    changed = (kv != before) & ~(kv.isnan() & before.isnan())  # [2, L, blocks, bs, H, D]
    touched = set(changed.any(-1).any(-1).any(0).any(0).flatten().nonzero().flatten().tolist())
    allowed = set(slots) | set(range(sink * bs, (sink + 1) * bs))
    padded = padded_batch_size(n, graphs.sizes)
    diff = (eager - replay).abs().max().item()
    half = kv.dtype in (torch.float16, torch.bfloat16)
    tolerance = (1e-2 if half else 1e-4) * max(1.0, eager.abs().max().item())
    return dict(backend=runner.backend.name, rows=n, padded_to=padded, max_logit_diff=diff,
                logits_within_tolerance=diff <= tolerance,
                writes_only_own_slots_and_sink=touched <= allowed,
                padding_outputs_finite=bool(graphs.outputs[padded][n:].isfinite().all()))


def graph_checks(path: str, device: str) -> list[dict]:
    """graph_vs_eager for the auto backend in bf16 and the torch twins in fp32."""
    results = []
    for dtype, backend in (("bfloat16", "auto"), ("float32", "torch")):
        llm = LLM(path, device=device, dtype=dtype, attention_backend=backend, max_num_seqs=8,
                  num_kv_blocks=64, max_model_len=1024, skip_tokenizer_init=True)
        graphs = llm.model_runner.model
        if not isinstance(graphs, CUDAGraphRunner) or not graphs.graphs:
            results.append(dict(backend=backend, dtype=dtype, skipped="no captured graphs"))
            continue
        results.append(dict(dtype=dtype, **graph_vs_eager(llm)))
        del llm
        gc.collect()
    return results


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
    return (f"flash-attn vs torch: {same}/{len(prompts)} requests token-identical (bf16; "
            "informational: near-ties may differ, check 2 is the pass/fail)")


def print_checks(device: str, path: str) -> list[str]:
    """Checks 2 and 3: print their tables; return one summary line each."""
    rows = kernel_checks(device)
    print("\n| kernels | requests | max abs error | ok |\n|---|---|---|---|")
    for label, name, err, ok in rows:
        print(f"| {label} | {name} | {err:.2e} | {'yes' if ok else 'NO'} |")
    graphs = graph_checks(path, device) if device == "cuda" else []
    for result in graphs:
        print(result)
    bad = [r for r in graphs if "skipped" not in r and not (
        r["logits_within_tolerance"] and r["writes_only_own_slots_and_sink"]
        and r["padding_outputs_finite"])]
    return [f"kernel checks: {sum(ok for *_, ok in rows)}/{len(rows)} within tolerance",
            f"graph vs eager: {len(graphs) - len(bad)}/{len(graphs)} ok" if graphs
            else "graph vs eager: not run (no CUDA)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="dry run on CPU, tiny model")
    parser.add_argument("--checks-only", action="store_true",
                        help="versions, kernel and graph checks only (0, 2, 3)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.small else "cuda"
    dtype_name = "float32" if args.small else "bfloat16"
    dtype = getattr(torch, dtype_name)
    print(versions_line(), flush=True)
    summary = [] if args.skip_tests or args.checks_only else [
        f"tests on this machine: {run_tests()}"]
    summary += print_checks(device, build("tiny", SMALL["tiny-llama"], device, dtype))
    if args.checks_only:
        print("\n" + "\n".join(summary))
        return
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
