"""GPU check: the one prepared run a session with a lent GPU makes first (--quick, 3.5 minutes on
an H200), and its dry run on a CPU. Each section prints what it found; the last lines sum up.

  0. versions, and what runs: the engine's start-up line (device, dtype, attention backend and
     why, block size, KV blocks, CUDA graphs, torch.compile).
  1. attention kernels, one shot each, on shuffled block tables whose unused blocks are NaN
     (a kernel that reads one fails), for three request mixes (whole prompts, GQA 1; chunks
     starting mid-page, GQA 3; lengths crossing 256 and 512, GQA 8): the fp32 torch twins
     against a dense fp64 reference; flash-attn against the fp32 twin where it imports, else
     the bf16 twins with flash-attn's contract checks on. CUDA-graph replay vs eager for one
     decode step with padding rows (logits within tolerance, padding writes only the sink).
  2. tests/gpu/test_cuda.py (pytest).
  3. end to end in fp32 with the torch twins and CUDA graphs: prompts sharing a prefix (prefix
     cache hits) and a small token budget (chunks that start mid-block): HF generate's tokens.
  4. KV sizing from gpu_memory_utilization on a Qwen3-0.6B-shaped model (random weights).
  5. nano-vllm's benchmark workload on that model (256 requests, 100-1024 input and output
     tokens), greedy and at temperature 0.6: tok/s.

    python scripts/dev/gpu_check.py --quick            # on the GPU: all of it
    python scripts/dev/gpu_check.py --quick --dry-run  # the same code on a CPU, tiny sizes
    python scripts/dev/gpu_check.py --checks-only      # 0 and 1 (about a minute)

The tensor logic of section 1 is importable; tests/support/test_gpu_check.py runs it on CPU.
"""

from __future__ import annotations

import argparse
import gc
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.shapes import make_random_model  # noqa: E402
from benchmarks.workloads import nano_vllm_workload  # noqa: E402
from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.engine.cuda_graph import CUDAGraphRunner, padded_batch_size  # noqa: E402
from nanoserve.layers import torch_attention  # noqa: E402
from nanoserve.layers.attention import AttentionMetadata  # noqa: E402

TESTS = ["tests/gpu/test_cuda.py"]
NANO_VLLM_FIGURE = ("nano-vllm's README: 1434 tok/s on an RTX 4070 Laptop (vLLM 1362), "
                    "Qwen3-0.6B, the same workload")


# -- 0. versions -------------------------------------------------------------------------

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


# -- 1. attention kernels (pure tensors) --------------------------------------------------

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


# -- 1. CUDA-graph replay vs eager -------------------------------------------------------

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
                  num_kv_blocks=64, max_model_len=1024, skip_tokenizer_init=True,
                  gpu_memory_utilization=0.3)
        graphs = llm.model_runner.model
        if not isinstance(graphs, CUDAGraphRunner) or not graphs.graphs:
            results.append(dict(backend=backend, dtype=dtype, skipped="no captured graphs"))
            continue
        results.append(dict(dtype=dtype, **graph_vs_eager(llm)))
        free(llm)
    return results


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


def free(*engines) -> None:
    """Drop engines and give their GPU memory back before the next one sizes its KV cache."""
    for llm in engines:
        del llm
    gc.collect()  # the runner and its graphs form a cycle
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- 2. the CUDA tests -------------------------------------------------------------------

def run_tests(timeout: float) -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *TESTS], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    print(proc.stdout[-3000:], proc.stderr[-1000:])
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output"


# -- 3. end to end against HF --------------------------------------------------------------

def end_to_end(device: str) -> str:
    """fp32, torch twins, CUDA graphs on a GPU: HF generate's greedy tokens, with prefix hits
    and chunks that start mid-block (a budget of 40 tokens, blocks of 16)."""
    from transformers import AutoModelForCausalLM

    path = make_random_model("tiny-llama", dtype=torch.float32, tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.no_grad():  # wide logits: greedy far from near-ties
        for p in hf.parameters():
            p.mul_(5.0)
    hf.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 512, (37,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 20, 41)]
    prompts += [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 66)]
    llm = LLM(path, device=device, dtype="float32", attention_backend="torch",
              skip_tokenizer_init=True, block_size=16, max_num_batched_tokens=40,
              max_num_seqs=4, max_model_len=512, gpu_memory_utilization=0.3, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    hits = llm.scheduler.block_manager.prefix_cache_hits
    graphs = isinstance(llm.model_runner.model, CUDAGraphRunner)
    same = sum(a == b for a, b in zip(got, want))
    free(llm)
    return (f"end to end fp32 vs HF generate: {same}/{len(prompts)} requests identical "
            f"({hits} prefix-hit tokens, chunks of <= 40 tokens, CUDA graphs "
            f"{'on' if graphs else 'off'})")


# -- 4 and 5. KV sizing and nano-vllm's workload ---------------------------------------------

def kv_sizing(llm: LLM, device: str, utilization: float) -> str:
    r = llm.model_runner
    line = (f"KV sizing: {r.num_kv_blocks} blocks of {r.block_size} tokens = "
            f"{r.kv_cache_bytes / 2**30:.2f} GiB, weights {r.weight_bytes / 2**30:.2f} GiB")
    if not device.startswith("cuda"):
        return line + " (CPU: kv_cache_memory_gib)"
    free_b, total = torch.cuda.mem_get_info()
    used = (total - free_b) / total
    verdict = "ok" if used <= utilization + 0.03 else "OVER"
    return (f"{line}; GPU in use {used:.1%} of {total / 2**30:.0f} GiB after the runs "
            f"(gpu_memory_utilization {utilization}: {verdict})")


def nano_vllm_bench(llm: LLM, device: str, dry_run: bool) -> list[str]:
    wl = nano_vllm_workload(np.random.default_rng(0), quick=dry_run, max_num_seqs=None,
                            gpu=not dry_run)
    prompts = [[t % llm.vocab_size for t in j.prompt_ids] for j in wl.jobs]  # (tiny vocabs)
    lines = []
    useful = sum(j.max_tokens for j in wl.jobs)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for temperature in (0.0, 0.6):
        params = [SamplingParams(temperature=temperature, max_tokens=j.max_tokens,
                                 ignore_eos=True) for j in wl.jobs]
        sync(device)
        start, steps = time.perf_counter(), llm.num_steps
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        wall = time.perf_counter() - start
        assert [len(o.token_ids) for o in outs] == [j.max_tokens for j in wl.jobs]
        lines.append(f"nano-vllm workload ({wl.description}), temperature {temperature}: "
                     f"{useful} tokens in {wall:.2f} s = {useful / wall:.0f} tok/s, "
                     f"{llm.num_steps - steps} steps")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sections 0-5 (3.5 min on an H200)")
    parser.add_argument("--dry-run", action="store_true", help="on a CPU, tiny sizes")
    parser.add_argument("--checks-only", action="store_true", help="sections 0 and 1")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: use --dry-run on a CPU")
    start = time.perf_counter()

    def elapsed() -> str:
        return f"[{time.perf_counter() - start:.0f} s]"

    print(versions_line(), flush=True)
    half = "float32" if args.dry_run else "bfloat16"
    tiny = make_random_model("tiny-llama", dtype=getattr(torch, half), tokenizer=False)
    summary = print_checks(device, tiny)
    print(elapsed(), flush=True)
    if not args.checks_only:
        summary.append(f"tests on this machine: {run_tests(150)} {elapsed()}")
        summary.append(f"{end_to_end(device)} {elapsed()}")
        shape = "tiny-llama" if args.dry_run else "qwen3-0.6b"
        # No tokenizer: the bundled one's package need not be on the GPU machine.
        path = make_random_model(shape, dtype=getattr(torch, half), device=device,
                                 tokenizer=False)
        utilization = 0.9
        # nano-vllm's settings but for max_num_seqs: its 256 requests at once, not 512.
        llm = LLM(path, device=device, dtype=half, max_model_len=2048, skip_tokenizer_init=True,
                  max_num_seqs=256, gpu_memory_utilization=utilization,
                  **({"num_kv_blocks": 512} if args.dry_run else {}))
        summary.append(f"what runs ({shape}): {llm.describe()}")
        print(summary[-1], flush=True)
        summary += nano_vllm_bench(llm, device, args.dry_run)
        summary.append(f"{kv_sizing(llm, device, utilization)} {elapsed()}")
        summary.append(NANO_VLLM_FIGURE)
        free(llm)
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
