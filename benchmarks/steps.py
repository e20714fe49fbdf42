"""Step-level measurements of two claims of chapter 2.2, on the real model (bench.py
`--workload batching` and `--workload prefill-stutter`):

  §1  "one weight read serves many tokens": a decode step over 1, 4, 16, 64 rows costs far
      less than 1, 4, 16, 64 one-row steps, so the cost per token falls as the batch grows.
  §7  "a long prefill makes the decodes beside it stutter, unless it is chunked": requests
      decode while a long prompt arrives; without chunked prefill one step computes the whole
      prompt and every running request waits for it; with it, the prompt is spread over
      steps of at most `max_num_batched_tokens` tokens.

Each engine step is timed around `LLM.step()` (schedule + forward + sampling + update).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

STEP_WORKLOADS = ("batching", "prefill-stutter")


def token_ids(seed: int, n: int, vocab: int) -> list[int]:
    """A deterministic prompt of n ids, different for each seed (no shared prefix)."""
    return [(seed * 7919 + k * 104729) % (vocab - 1) + 1 for k in range(n)]


def make_llm(model_dir: str, dtype: str, **config: object):
    from nanoserve import LLM

    # The default KV budget (1 GiB on CPU) holds every workload here: no preemption.
    return LLM(model_dir, dtype=dtype, enable_prefix_caching=False, skip_tokenizer_init=True,
               **config)


def timed_step(llm) -> float:
    start = time.perf_counter()
    llm.step()
    return (time.perf_counter() - start) * 1000


# -- §1 ---------------------------------------------------------------------------------


def measure_batching(model_dir: str, dtype: str = "float32", rows: tuple[int, ...] = (1, 4, 16, 64),
                     num_steps: int = 20, prompt_len: int = 32) -> list[dict]:
    """For each batch size: `rows` requests prefilled together, one warm-up decode, then
    `num_steps` timed decode steps in which every row decodes exactly one token."""
    from nanoserve import SamplingParams

    width = max(rows)
    llm = make_llm(model_dir, dtype, max_num_seqs=width,
                   max_num_batched_tokens=width * prompt_len,
                   max_model_len=prompt_len + num_steps + 8)
    weights = llm.model_runner.weight_bytes  # counted as loaded (a fast path re-lays them out)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 2, ignore_eos=True)
    table = []
    for n in rows:
        for i in range(n):
            llm.add_request(token_ids(i, prompt_len, llm.vocab_size), params)
        llm.step()  # every prompt in one step (the budget holds them all)
        llm.step()  # warm-up decode
        times = []
        for _ in range(num_steps):
            times.append(timed_step(llm))
            out = llm.last_scheduler_output
            if len(out.scheduled) != n or out.num_scheduled_tokens != n:
                raise RuntimeError(f"expected {n} decode rows, got {len(out.scheduled)} "
                                   f"entries with {out.num_scheduled_tokens} tokens")
        while llm.has_unfinished_requests():
            llm.step()
        step_ms = sorted(times)[len(times) // 2]
        table.append({"rows": n, "step_ms": step_ms, "ms_per_token": step_ms / n,
                      "tokens_per_s": n * 1000 / step_ms,
                      "weight_mb_per_token": weights / n / 2**20})
    base = table[0]["ms_per_token"]
    for row in table:
        row["cost_vs_1_row"] = row["ms_per_token"] / base
    return table


def batching_table(table: list[dict]) -> str:
    lines = ["| decode rows | step ms (median) | ms per token | tokens/s | cost per token vs 1 row "
             "| weights read per token MiB |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['step_ms']:.1f} | {r['ms_per_token']:.2f} "
              f"| {r['tokens_per_s']:.0f} | {r['cost_vs_1_row']:.2f}x "
              f"| {r['weight_mb_per_token']:.1f} |" for r in table]
    return "\n".join(lines)


# -- §7 ---------------------------------------------------------------------------------


@dataclass
class StutterRun:
    chunked: bool
    token_budget: int
    step_ms: list[float] = field(default_factory=list)
    long_tokens: list[int] = field(default_factory=list)  # its prompt tokens per step
    decode_rows: list[int] = field(default_factory=list)  # running requests decoding
    long_ttft_ms: float = 0.0  # from its arrival to the end of the step that sampled it

    @property
    def stutter_steps(self) -> list[int]:
        """Steps that computed part of the long prompt while others decoded."""
        return [i for i, (t, d) in enumerate(zip(self.long_tokens, self.decode_rows)) if t and d]

    def decoder_gaps(self) -> list[float]:
        """Inter-token times of the running requests: the time of each step they decode in."""
        return [ms for ms, d in zip(self.step_ms, self.decode_rows) if d]


STUTTER_DEFAULTS = {"num_decoders": 8, "long_prompt": 1024, "chunk": 128, "arrive_after": 8,
                    "decode_tokens": 64}


def measure_prefill_stutter(model_dir: str, dtype: str = "float32", num_decoders: int = 8,
                            long_prompt: int = 1024, chunk: int = 128, arrive_after: int = 8,
                            decode_tokens: int = 64) -> list[StutterRun]:
    """`num_decoders` short requests decode; after `arrive_after` steps a `long_prompt`-token
    request arrives. Run twice: chunked prefill off (one step computes the whole prompt;
    the budget must then hold it), and on with a budget of `chunk` tokens per step."""
    from nanoserve import SamplingParams

    max_len = long_prompt + decode_tokens + 16
    runs = []
    for chunked in (False, True):
        budget = chunk if chunked else max_len
        llm = make_llm(model_dir, dtype, max_num_seqs=num_decoders + 1, max_model_len=max_len,
                       max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        run = StutterRun(chunked, budget)
        params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
        for i in range(num_decoders):
            llm.add_request(token_ids(i, 16, llm.vocab_size), params)
        decoding = 0
        while decoding < num_decoders:  # untimed: the short prompts (chunked too, when on)
            llm.step()
            decoding = sum(e.is_decode for e in llm.last_scheduler_output.scheduled)
        long_id, arrived = None, 0.0
        while llm.has_unfinished_requests():
            if long_id is None and len(run.step_ms) == arrive_after:
                long_id = llm.add_request(token_ids(999, long_prompt, llm.vocab_size),
                                          SamplingParams(temperature=0.0, max_tokens=4,
                                                         ignore_eos=True))
                arrived = time.perf_counter()
            run.step_ms.append(timed_step(llm))
            out = llm.last_scheduler_output
            mine = [e for e in out.scheduled if e.request.request_id == long_id]
            # prompt tokens computed this step (its own decodes later do not count)
            end = mine[0].request.num_computed_tokens if mine else 0
            run.long_tokens.append(max(0, min(end, long_prompt) - (end - mine[0].num_new_tokens))
                                   if mine else 0)
            if mine and mine[0].samples and not run.long_ttft_ms:
                run.long_ttft_ms = (time.perf_counter() - arrived) * 1000
            run.decode_rows.append(sum(e.is_decode and e.request.request_id != long_id
                                       for e in out.scheduled))
        runs.append(run)
    return runs


def stutter_table(runs: list[StutterRun]) -> str:
    lines = ["| chunked prefill | token budget | steps with long-prompt tokens + decodes "
             "| those steps' ms (max) | other decode steps ms (median) | running requests' TPOT "
             "ms (mean / max gap) | long prompt TTFT ms |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        hit = r.stutter_steps
        calm = sorted(ms for i, ms in enumerate(r.step_ms) if r.decode_rows[i] and i not in hit)
        gaps = r.decoder_gaps()
        lines.append(f"| {'on' if r.chunked else 'off'} | {r.token_budget} | {len(hit)} "
                     f"| {max((r.step_ms[i] for i in hit), default=0):.1f} "
                     f"| {calm[len(calm) // 2] if calm else 0:.1f} "
                     f"| {sum(gaps) / len(gaps):.1f} / {max(gaps):.1f} | {r.long_ttft_ms:.0f} |")
    return "\n".join(lines)


def draw_stutter(runs: list[StutterRun], path: Path, title: str) -> bool:
    """Per-step time of both runs (the long prompt's steps marked), and the running
    requests' inter-token time, mean and worst."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(1, 2, figsize=(12, 4), width_ratios=(3, 1))
    for r, colour in zip(runs, ("#d9534f", "#4a90d9")):
        label = f"chunked prefill {'on' if r.chunked else 'off'} (budget {r.token_budget})"
        top.plot(range(1, len(r.step_ms) + 1), r.step_ms, color=colour, lw=1.2, label=label)
        hit = [i for i, t in enumerate(r.long_tokens) if t]
        top.scatter([i + 1 for i in hit], [r.step_ms[i] for i in hit], color=colour, s=18,
                    zorder=3)
    top.set_xlabel("engine step")
    top.set_ylabel("step time ms")
    top.set_title("per-step time (dots: steps computing the long prompt)", fontsize=10)
    top.legend(fontsize=8)
    names = [f"{'on' if r.chunked else 'off'}" for r in runs]
    gaps = [r.decoder_gaps() for r in runs]
    x = range(len(runs))
    bottom.bar([i - 0.2 for i in x], [sum(g) / len(g) for g in gaps], 0.4, label="mean TPOT")
    bottom.bar([i + 0.2 for i in x], [max(g) for g in gaps], 0.4, label="worst gap")
    bottom.set_xticks(list(x), [f"chunked {n}" for n in names])
    bottom.set_ylabel("ms")
    bottom.set_title("running requests' inter-token time", fontsize=10)
    bottom.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def run(workload: str, model_dir: str, dtype: str, quick: bool, out: Path | None,
        png: Path | None) -> dict:
    """bench.py --workload batching | prefill-stutter: print the table, write JSON (and
    the §7 picture). --quick: a tiny version that only shows the workload runs."""
    import json
    import os

    from benchmarks.report import machine_info

    result: dict = {"workload": workload, "dtype": dtype, "machine": machine_info()}
    if workload == "batching":
        table = measure_batching(model_dir, dtype, **({"rows": (1, 4), "num_steps": 3}
                                                       if quick else {}))
        print(f"§1: decode step time by batch size ({dtype})\n{batching_table(table)}")
        result["table"] = table
    else:
        cfg = {"num_decoders": 2, "long_prompt": 64, "chunk": 16, "arrive_after": 2,
               "decode_tokens": 16} if quick else STUTTER_DEFAULTS
        runs = measure_prefill_stutter(model_dir, dtype, **cfg)
        print(f"§7: a long prompt arrives while requests decode ({dtype})\n"
              f"{stutter_table(runs)}")
        result["config"], result["runs"] = cfg, [dict(r.__dict__) for r in runs]
        png = png or Path("bench_results") / f"{workload}.png"
        if draw_stutter(runs, png, f"§7: a {cfg['long_prompt']}-token prompt arrives while "
                        f"{cfg['num_decoders']} requests decode; chunked prefill off vs on"):
            print(f"wrote {png}")
    result["load_average_after"] = os.getloadavg()[0]  # >> threads used: numbers not clean
    out = out or Path("bench_results") / f"{workload}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result
