"""What bench.py prints and writes: tables, ratios, a text timeline per system, JSON and a
PNG of seats x steps (chapter 2.2 §2's and §3's figures, measured)."""

from __future__ import annotations

import os
import platform
import subprocess
import textwrap
import time
from pathlib import Path

import torch

from benchmarks.systems import SystemResult, percentile
from benchmarks.vllm_system import identical_requests
from benchmarks.workloads import Job

SLOT_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def throughput_table(results: list[SystemResult]) -> str:
    lines = ["| system | wall s | output tok/s | total tok/s | steps | seat util | wasted rows "
             "| preempt | peak KV |", "|" + "---|" * 9]
    for r in results:
        util = "-" if r.utilisation is None else f"{r.utilisation:.1%}"
        lines.append(f"| {r.system} | {r.wall_s:.1f} | {r.output_tps:.1f} | {r.total_tps:.1f} "
                     f"| {fmt(r.num_steps, digits=0)} | {util} "
                     f"| {fmt(r.wasted_request_steps, digits=0)} "
                     f"| {fmt(r.preemptions, digits=0)} | {fmt(r.peak_kv_usage, 100, 0)}"
                     f"{'' if r.peak_kv_usage is None else '%'} |")
    return "\n".join(lines)


def latency_table(results: list[SystemResult]) -> str:
    lines = ["| system | TTFT p50/p95/p99 s | TPOT p50/p95/p99 ms | E2E p50/p95/p99 s |",
             "|---|---|---|---|"]
    for r in results:
        def triple(values: list, scale: float, digits: int) -> str:
            return " / ".join(fmt(percentile(values, p), scale, digits) for p in (50, 95, 99))
        lines.append(f"| {r.system} | {triple(r.ttft, 1, 2)} | {triple(r.tpot, 1000, 0)} "
                     f"| {triple(r.e2e, 1, 2)} |")
    return "\n".join(lines)


def startup_table(results: list[SystemResult]) -> str:
    """Start-up apart from throughput: vLLM compiles for about a minute, nanoserve doesn't."""
    rows = [r for r in results if r.startup_s is not None]
    lines = ["| system | start-up s: LLM() until ready | LLM() until a first token s |",
             "|---|---|---|"]
    lines += [f"| {r.system} | {r.startup_s:.1f} | {fmt(r.first_token_s, digits=1)} |"
              for r in rows]
    return "\n".join(lines) if rows else ""


def best_utilisation(jobs: list[Job], max_num_seqs: int) -> float:
    """An upper bound for any scheduler: a request needs at least max_tokens steps (one
    prefill step, then one decode per further token), and all work needs
    sum(max_tokens) / max_num_seqs steps."""
    useful = sum(j.max_tokens for j in jobs)
    min_steps = max(max(j.max_tokens for j in jobs), -(-useful // max_num_seqs))
    return useful / (min_steps * max_num_seqs)


def ratio_lines(results: list[SystemResult]) -> list[str]:
    by = {r.system: r for r in results}
    if "continuous" not in by:
        return []
    c = by["continuous"].output_tps
    lines = [f"continuous / {s}: {c / by[s].output_tps:.2f}x output tok/s"
             for s in ("static", "hf-static", "hf-cb") if s in by]
    if "vllm" in by:
        lines.append(f"nanoserve (continuous) / vLLM: {c / by['vllm'].output_tps:.2f}x output "
                     "tok/s")
    if "llamacpp" in by:
        lines.append(f"nanoserve (continuous) / llama.cpp: "
                     f"{c / by['llamacpp'].output_tps:.2f}x output tok/s")
    return lines


def identical_counts(results: list[SystemResult]) -> dict[str, int]:
    """Per system: requests whose greedy tokens equal the continuous system's, token for
    token (expected in float32; bf16 rounding may flip a near-tie)."""
    by = {r.system: r for r in results}
    ours = by.get("continuous")
    if ours is None or ours.token_ids is None:
        return {}
    return {r.system: identical_requests(ours.token_ids, r.token_ids) for r in results
            if r.system != "continuous" and r.token_ids is not None}


def text_timeline(r: SystemResult, width: int = 100) -> str:
    """One line per seat: a letter per request computing usefully, '/' for a wasted row
    of a finished request (§2's hatched cells), '.' for an empty seat; k steps per char."""
    grid = r.timeline or []
    k = max(1, -(-len(grid) // width))
    lines = [f"{r.system}: {len(grid)} steps, {k} step(s) per character"]
    for seat in range(r.max_num_seqs):
        chars = []
        for g in range(0, len(grid), k):
            cells = [row[seat] for row in grid[g:g + k]]
            useful = [c for c in cells if c > 0]
            if useful:
                chars.append(SLOT_CHARS[(useful[-1] - 1) % len(SLOT_CHARS)])
            else:
                chars.append("/" if any(c < 0 for c in cells) else ".")
        lines.append(f"  seat {seat:2d} |{''.join(chars)}|")
    return "\n".join(lines)


def draw_png(results: list[SystemResult], path: Path, title: str) -> bool:
    """Seats x steps, one colour per request, hatched = computing for a finished request,
    white = empty seat; static above continuous, on the same step axis (§2, §3 figures)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    panels = sorted((r for r in results if r.timeline), key=lambda r: r.system != "static")
    if not panels:
        return False
    cmap = plt.get_cmap("tab20")
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.28 * panels[0].max_num_seqs
                                                       * len(panels)),
                             sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], panels):
        for seat in range(r.max_num_seqs):
            for first, length, code in runs([row[seat] for row in r.timeline]):
                if code == 0:
                    continue
                colour = cmap((abs(code) - 1) % 20)
                ax.broken_barh([(first, length)], (seat - 0.4, 0.8), facecolor=colour,
                               alpha=1.0 if code > 0 else 0.35, hatch=None if code > 0 else "///",
                               edgecolor="none" if code > 0 else "grey", linewidth=0)
        ax.set_ylim(r.max_num_seqs - 0.5, -0.5)
        ax.set_ylabel("seat")
        ax.set_title(f"{r.system}: {len(r.timeline)} steps, seat utilisation "
                     f"{r.utilisation:.0%}, {r.wall_s:.1f} s", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("engine step")
    fig.legend(handles=[Patch(facecolor=cmap(0), label="computing (one colour per request)"),
                        Patch(facecolor=cmap(0), alpha=0.35, hatch="///",
                              label="wasted: computing for a finished request"),
                        Patch(facecolor="white", edgecolor="grey", label="empty seat")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(textwrap.fill(title, 110), fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def runs(cells: list[int]) -> list[tuple[int, int, int]]:
    """(first step, length, code) of each run of equal cells."""
    out, first = [], 0
    for i in range(1, len(cells) + 1):
        if i == len(cells) or cells[i] != cells[first]:
            out.append((first, i - first, cells[first]))
            first = i
    return out


def machine_info() -> dict:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                   if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        cpu = platform.processor() or "unknown"
    import transformers

    from nanoserve.utils import cpu as cpu_probe

    return {"cpu": cpu, "cpu_flags": cpu_probe.describe(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M")}
