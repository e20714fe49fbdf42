"""Start-up time (issue: "start-up stays cheap"), cold and warm, each in a fresh process.

cold: empty caches. NANOSERVE_CACHE_DIR points to an empty temp dir, so the bundled model is
      converted from its GGUF again; TORCHINDUCTOR_CACHE_DIR (and for vLLM VLLM_CACHE_ROOT,
      where it keeps its compiled graphs) point to empty temp dirs too.
warm: the usual caches, filled by one unreported run first.
Measured per process: import, `LLM()` until ready, and `LLM()` until the first token of a
first request; plus the whole process's wall time.

    python scripts/bench/startup.py                   # nanoserve, float32
    python scripts/bench/startup.py --dtype bfloat16
    python scripts/bench/startup.py --engine vllm     # needs .venv-vllm (3 starts of ~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ (for the vLLM worker's job file)
PROMPT = "Explain the water cycle."


def child(dtype: str) -> None:
    """One start of nanoserve in this (fresh) process; prints the timings as JSON."""
    t0 = time.perf_counter()
    from nanoserve import LLM, SamplingParams

    t1 = time.perf_counter()
    llm = LLM(dtype=dtype)
    t2 = time.perf_counter()
    llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    t3 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "startup_s": t2 - t1, "first_token_s": t3 - t1}))


def vllm_command(dtype: str, tmp: str) -> list[str]:
    """The bench's vLLM worker on one prompt, one token: it times LLM() and the first token."""
    from transformers import AutoTokenizer

    from benchmarks.vllm_system import VENV, WORKER, vllm_job
    from benchmarks.workloads import Job, Workload, chat_ids
    from nanoserve.entrypoints.bundled import default_model_dir

    model = default_model_dir()
    ids = chat_ids(AutoTokenizer.from_pretrained(model), PROMPT)
    job = vllm_job(Workload("startup", [Job(ids, 1)], 1, ""), model, dtype, 512)
    Path(tmp, "job.json").write_text(json.dumps(job))
    return [str(VENV / "bin" / "python"), str(WORKER), f"{tmp}/job.json", f"{tmp}/result.json"]


def measure(engine: str, dtype: str, cold: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "VLLM_CPU_KVCACHE_SPACE": "2"}
        if cold:
            for var in ("NANOSERVE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"):
                env[var] = tempfile.mkdtemp(prefix=var.lower() + "-", dir=tmp)
        cmd = ([sys.executable, __file__, "--child", "--dtype", dtype] if engine == "nanoserve"
               else vllm_command(dtype, tmp))
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"{engine} start failed:\n{proc.stderr[-3000:]}")
        if engine == "nanoserve":
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            result = json.loads(Path(tmp, "result.json").read_text())
    return {"process_s": wall, **result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("nanoserve", "vllm"), default="nanoserve")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="float32")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.dtype)
    if args.engine == "vllm" and not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        sys.exit("no .venv-vllm/; build it with `bash scripts/bench/setup_vllm_venv.sh`")
    cold = measure(args.engine, args.dtype, cold=True)
    measure(args.engine, args.dtype, cold=False)  # fills the usual caches
    warm = measure(args.engine, args.dtype, cold=False)
    print(f"| {args.engine} {args.dtype} | process s | import s | LLM() until ready s "
          "| LLM() until first token s |\n|---|---|---|---|---|")
    for name, r in (("cold", cold), ("warm", warm)):
        imp = f"{r['import_s']:.1f}" if "import_s" in r else "-"
        print(f"| {name} | {r['process_s']:.1f} | {imp} | {r['startup_s']:.1f} "
              f"| {r['first_token_s']:.1f} |")


if __name__ == "__main__":
    main()
