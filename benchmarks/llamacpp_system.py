"""The llama.cpp peer: bench.py's `llamacpp` system and the llama.cpp column of
scripts/bench/step_times.py, on the same weights as nanoserve (its bundled model's HF directory,
converted to F32 / BF16 GGUF) and the same work (prompt ids, exact output lengths, greedy).

llama.cpp (llama-cpp-python 0.3.36, built from source for this CPU) lives in its own venv
(.venv-llamacpp/, built by scripts/bench/setup_llamacpp.sh, which also converts the model) and
runs in its own process (benchmarks/llamacpp_worker.py): this side only finds the venv and the
GGUF, writes a job file, starts the worker and reads its result file (bench.py), or asks it for
one step at a time (StepPeer, step_times.py). Where either is missing, the one-line hint says
how to set it up.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.systems import System, SystemResult, assign_seats, check_lengths
from benchmarks.workloads import Workload

VENV = Path(__file__).resolve().parents[1] / ".venv-llamacpp"
WORKER = Path(__file__).with_name("llamacpp_worker.py")
SETUP_HINT = "bash scripts/bench/setup_llamacpp.sh"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # nanoserve dtype -> GGUF --outtype


def options() -> dict:
    """llama.cpp's own defaults (KV cache f16, flash attention auto) unless the environment says
    otherwise: NANOSERVE_LLAMACPP_KV=f32|f16|bf16, NANOSERVE_LLAMACPP_FLASH_ATTN=auto|on|off."""
    return {"kv_type": os.environ.get("NANOSERVE_LLAMACPP_KV") or None,
            "flash_attn": os.environ.get("NANOSERVE_LLAMACPP_FLASH_ATTN") or "auto"}


def gguf_dir() -> Path:
    from nanoserve.entrypoints.bundled import cache_root

    return cache_root() / "gguf"


def gguf_path(model_dir: str, dtype: str, root: Path | None = None) -> Path:
    """Where setup_llamacpp.sh writes the model's GGUF in this dtype: <dir name>-<type>.gguf."""
    return (root or gguf_dir()) / f"{Path(model_dir).name}-{GGUF_TYPES[dtype]}.gguf"


def unavailable(model_dir: str, dtype: str, venv: Path = VENV,
                root: Path | None = None) -> str | None:
    """Why llama.cpp cannot run this model in this dtype here, in one line; None if it can."""
    if dtype not in GGUF_TYPES:
        return f"llama.cpp peer runs {' and '.join(GGUF_TYPES)} only, not {dtype}"
    if not (venv / "bin" / "python").exists():
        return f"not set up: run `{SETUP_HINT}` (~6 min; no {venv.name}/)"
    gguf = gguf_path(model_dir, dtype, root)
    if not gguf.is_file():
        return f"not set up: run `{SETUP_HINT}` (no {gguf})"
    return None


def threads() -> int:
    import torch

    return torch.get_num_threads()


def run_worker(job: dict, venv: Path = VENV) -> dict:
    """Run the worker on `job` in .venv-llamacpp's python; its result, or an error with the
    worker's last lines."""
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        job_file, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        proc = subprocess.run([str(venv / "bin" / "python"), str(WORKER), str(job_file),
                               str(result)], capture_output=True, text=True, env=os.environ)
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise RuntimeError(f"the llama.cpp worker failed (exit {proc.returncode}):\n{tail}")
        return json.loads(result.read_text())


# --- step mode (scripts/bench/step_times.py) ------------------------------------------------

def step_job(gguf: Path, context: int, num_threads: int, kv_type: str | None = None) -> dict:
    return {"mode": "step", "gguf": str(gguf), "context": context, "threads": num_threads,
            **options(), **({"kv_type": kv_type} if kv_type else {})}


class StepPeer:
    """llama.cpp's decode step on demand, in its worker process (the worker's step mode):
    step_times.py times one of its steps between each of nanoserve's, so that both engines meet
    this VM's memory rate in the same moments (it drifts 40-85 GB/s within minutes: two runs a
    minute apart could differ by a third). `info`: llama-cpp-python's version, threads, KV type,
    flash attention, system info."""

    def __init__(self, gguf: Path, context: int, num_threads: int, kv_type: str | None = None,
                 venv: Path = VENV, worker: Path = WORKER) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-llamacpp-")
        job, self.log = Path(self.tmp.name) / "job.json", Path(self.tmp.name) / "stderr"
        job.write_text(json.dumps(step_job(gguf, context, num_threads, kv_type)))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([str(venv / "bin" / "python"), str(worker), str(job),
                                          "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=os.environ)
        try:
            self.info = json.loads(self.read())
        except BaseException:
            self.close()
            raise

    def read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"the llama.cpp worker failed (exit {self.proc.returncode}):\n"
                               f"{tail}")
        return line.strip()

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def rows(self, rows: int) -> None:
        """From now on each step decodes `rows` sequences (prefilled now, untimed)."""
        if (answer := self.ask(f"rows {rows}")) != "ready":
            raise RuntimeError(f"the llama.cpp worker answered {answer!r} to rows {rows}")

    def step(self) -> float:
        """One step's seconds, as the worker timed it (llama_decode and the argmax)."""
        return float(self.ask("step"))

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()  # end of input: the worker returns
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.tmp.cleanup()

    def __enter__(self) -> StepPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- workload mode (bench.py) ---------------------------------------------------------------

def llamacpp_job(wl: Workload, gguf: Path, max_num_batched_tokens: int, num_threads: int,
                 kv_type: str | None = None) -> dict:
    """The worker's job file: the same requests nanoserve and vLLM get."""
    return {"mode": "workload", "gguf": str(gguf),
            "prompts": [j.prompt_ids for j in wl.jobs],
            "max_tokens": [j.max_tokens for j in wl.jobs],
            "max_num_seqs": wl.max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max(len(j.prompt_ids) + j.max_tokens for j in wl.jobs),
            "threads": num_threads, **options(), **({"kv_type": kv_type} if kv_type else {})}


def llamacpp_result(data: dict, wl: Workload) -> SystemResult:
    """The worker's result file as a SystemResult; the lengths are checked per request."""
    tokens = data["token_ids"]
    check_lengths("llamacpp", wl.jobs, [len(t) for t in tokens])
    steps = data["steps"]
    tpot = [(e - f) / (j.max_tokens - 1) if j.max_tokens > 1 else None
            for f, e, j in zip(data["ttft"], data["e2e"], wl.jobs)]
    return SystemResult(
        "llamacpp", data["wall_s"], len(steps), wl.max_num_seqs, wl.useful_tokens,
        wl.prompt_tokens, useful_request_steps=sum(len(s) for s in steps),
        wasted_request_steps=0, ttft=data["ttft"], tpot=tpot, e2e=data["e2e"],
        startup_s=data["startup_s"], first_token_s=data["first_token_s"], token_ids=tokens,
        timeline=assign_seats([[(j, True) for j in s] for s in steps], wl.max_num_seqs),
        notes=[f"llama.cpp via llama-cpp-python {data.get('llama_cpp_python')} in its own "
               f"process, {data.get('threads')} threads; server-style slots (one KV stream per "
               f"sequence, n_ctx_seq {data.get('n_ctx_seq')}), KV cache {data.get('kv_type')}, "
               f"flash attention {data.get('flash_attn')}; all requests at t=0",
               f"llama.cpp system info: {data.get('system_info')}"])


@dataclass
class LlamaCpp(System):
    name = "llamacpp"
    venv: Path = field(default=VENV)

    def unavailable(self) -> str | None:
        return unavailable(self.model_dir, self.dtype, self.venv)

    def run(self, wl: Workload) -> SystemResult:
        job = llamacpp_job(wl, gguf_path(self.model_dir, self.dtype),
                           self.max_num_batched_tokens, threads())
        return llamacpp_result(run_worker(job, self.venv), wl)
