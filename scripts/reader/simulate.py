"""The chapter's figures (2.2 §2, §3, §6.3), reproduced by the step-level simulator
(nanoserve/simulator.py: the real schedulers and BlockManager, a stand-in runner, no model),
static batching above continuous batching, as text grids and as PNG pictures.

    python scripts/reader/simulate.py chapter3                    # the text figure
    python scripts/reader/simulate.py chapter3 --png docs/sim-chapter3.png --trace chapter3.jsonl
    python scripts/reader/simulate.py all --png-dir docs          # the four figures of the README
    python scripts/reader/trace_page.py chapter3.jsonl            # explore the trace in a browser

Text grid: one row per seat (a seat in the batch), one column per step (or per 10 steps):
the request's letter while it computes, '/' a finished static row still computed for
nothing ("seat quay không"), '!' the seat of a request just preempted, '.' an empty seat.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoserve.simulator import SimRequest, Simulation, simulate

# The chapter's figures: jobs (name, prompt length, output length, arrival step), seats,
# KV blocks of 4 tokens, and what the figure shows.
FIGURES: dict[str, tuple[list[SimRequest], int, int, str]] = {
    "chapter2": ([SimRequest("A", 4, 20), SimRequest("B", 4, 500), SimRequest("C", 4, 100)], 3, 256,
                 "§2: three requests in one batch over 500 steps"),
    "chapter2-example": ([SimRequest(n, 4, k) for n, k in zip("ABCDEFGH", (20, 500, 30, 40, 50, 60,
                         70, 80))], 8, 256, "§2: 8 requests, the longest 500 steps, the "
                         "other 7 averaging 50"),
    "chapter3": ([SimRequest("A", 4, 3), SimRequest("B", 4, 10), SimRequest("C", 4, 5),
                  SimRequest("D", 4, 7), SimRequest("E", 4, 5, 2), SimRequest("F", 4, 4, 3),
                  SimRequest("G", 4, 6, 4)], 4, 256,
                 "§3: 4 seats; A-D arrive together, E, F, G later; B ends at step 10"),
    "preemption": ([SimRequest("A", 4, 6), SimRequest("B", 4, 9), SimRequest("C", 4, 8),
                    SimRequest("D", 4, 4, 2)], 3, 6,
                   "§6.3: a KV pool of 6 blocks of 4 tokens; D arrives at step 2"),
}


def run_figure(name: str, trace: str | None = None) -> list[Simulation]:
    """The figure's jobs under static batching (§2), then continuous batching (FCFS, §3)."""
    jobs, seats, blocks, _ = FIGURES[name]
    return [simulate(jobs, policy, seats, blocks, trace=trace) for policy in ("static", "fcfs")]


BLUE, GOLD, RED = "#4a90d9", "#f2c14e", "#d9534f"  # the chapter's "xanh", "vàng"; preempted
LABELS = {"static": "static batching (§2)", "fcfs": "continuous batching, FCFS (§3)"}


def text_figure(sim: Simulation, max_width: int = 100) -> str:
    """The grid, compressed to one column per 10 steps when it is wider than max_width
    (a column then shows '!' if any of its steps has one, else a letter, else '/')."""
    n, grid = len(sim.records), sim.grid()
    k = 1 if n <= max_width else 10 * -(-n // (10 * max_width))
    cols = -(-n // k)

    def cell(window: str) -> str:
        letters = [c for c in window if c.isalpha()]
        return "!" if "!" in window else letters[0] if letters else "/" if "/" in window \
            else "."

    head = f"{LABELS[sim.policy]}: {sim.summary()}"
    lines = [head + (f"; 1 column = {k} steps" if k > 1 else "")]
    lines += [f"seat {i:<3}" + "".join(cell(row[c * k:(c + 1) * k]) for c in range(cols))
              for i, row in enumerate(grid)]
    ruler = [" "] * cols
    for c in range(9, cols, 10):
        label = str((c + 1) * k)
        ruler[c - len(label) + 1:c + 1] = label
    lines.append("step    " + "".join(ruler))
    return "\n".join(lines + sim.notes)


def request_lines(sim: Simulation) -> list[str]:
    """When each request was admitted, computed and handed back (static: with its batch)."""
    lines = []
    for name in sorted({r["request"] for rec in sim.records for r in rec["rows"]}):
        steps, runs = sim.steps_of(name), []
        for s in steps:  # consecutive steps as ranges: "1-5, 7-9"
            if runs and runs[-1][1] == s - 1:
                runs[-1][1] = s
            else:
                runs.append([s, s])
        left = next(rec["step"] for rec in sim.records
                    if name in [f["request"] for f in rec["finished"]])
        lines.append(f"  {name}: admitted at step {', '.join(map(str, sim.admitted(name)))}; "
                     f"computes {', '.join(f'{a}-{b}' for a, b in runs)}; leaves at {left}")
    return lines


def draw(name: str, sims: list[Simulation], path: Path) -> None:
    """Static above continuous: one bar per run of a request in a seat, blue for requests
    there from the start, gold for later arrivals, hatched for idle rows, red '!' for a
    preemption, and the simulator's notes beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    jobs, seats, _, caption = FIGURES[name]
    late = {j.name for j in jobs if j.arrival_step > 0}
    num_steps = max(len(s.records) for s in sims)
    notes = [f"{LABELS[s.policy].split(' ')[0]}: {n}" for s in sims for n in s.notes]
    fig, axes = plt.subplots(len(sims), 1, sharex=True,
                             figsize=(11, 0.9 + (0.45 * seats + 0.8) * len(sims)
                                      + 0.22 * len(notes)))
    for ax, sim in zip(axes, sims):
        cells: list[list[tuple]] = [[None] * len(sim.records) for _ in range(seats)]
        victims = set()
        for i, rec in enumerate(sim.records):
            for r in rec["rows"]:
                kind = "re" if r["request"] in victims and r["role"] == "prefill" else \
                    r["role"] == "idle"
                cells[r["seat"]][i] = (r["request"], kind)
            for p in rec["preempted"]:
                cells[p["seat"]][i] = (p["request"], "!")
                victims.add(p["request"])
        for seat, row in enumerate(cells):
            start = 0
            for i in range(1, len(row) + 1):  # one bar per run of equal cells
                if i < len(row) and row[i] == row[start]:
                    continue
                if row[start] is not None:
                    rid, kind = row[start]
                    color = RED if kind == "!" else GOLD if rid in late else BLUE
                    ax.barh(seat, i - start, left=start, height=0.8, color=color,
                            alpha=0.45 if kind is True else 1.0, edgecolor="white",
                            hatch={True: "///", "re": "xx"}.get(kind), linewidth=0.8)
                    if kind is not True and (i - start) / num_steps > 0.012:
                        ax.text((start + i) / 2, seat, "!" if kind == "!" else rid,
                                ha="center", va="center", fontsize=9, weight="bold")
                start = i
        ax.set_yticks(range(seats), [f"seat {s}" for s in range(seats)])
        ax.set_ylim(seats - 0.5, -0.5)
        ax.set_title(f"{LABELS[sim.policy]}: {sim.summary()}", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
        if num_steps <= 30:
            ax.set_xticks(range(0, num_steps + 1))
    axes[-1].set_xlim(0, num_steps)
    axes[-1].set_xlabel("step (time: step s is drawn from s-1 to s)")
    handles = [Patch(color=BLUE, label="there from step 0 (xanh)"),
               Patch(facecolor=BLUE, alpha=0.45, hatch="///", edgecolor="white",
                     label="idle row: finished, still computed (seat quay không)"),
               Patch(facecolor="white", edgecolor="grey", label="empty seat")]
    if late:
        handles.insert(1, Patch(color=GOLD, label="arrives later (vàng)"))
    if any(s.notes for s in sims):
        handles += [Patch(color=RED, label="preempted (nạn nhân)"),
                    Patch(facecolor=BLUE, hatch="xx", edgecolor="white",
                          label="recompute (its prefill again)")]
    arrivals = ", ".join(f"{j.name} at step {j.arrival_step}" for j in jobs if j.name in late)
    height = fig.get_size_inches()[1]
    fig.suptitle(f"{name}: {caption}" + (f" (arrivals: {arrivals})" if late else ""),
                 x=0.01, y=1 - 0.08 / height, ha="left", va="top", fontsize=11)
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.01, 1 - 0.4 / height),
               fontsize=8, ncol=min(len(handles), 4), frameon=False)
    if notes:
        fig.text(0.01, 0.1 / height, "\n".join(notes), fontsize=8, va="bottom",
                 family="monospace")
    top = 0.55 + 0.2 * -(-len(handles) // 4)  # title and legend rows
    fig.tight_layout(rect=(0, (0.2 + 0.16 * len(notes)) / height, 1, 1 - top / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("figure", choices=[*FIGURES, "all"])
    p.add_argument("--png", type=Path, default=None, help="draw the figure here")
    p.add_argument("--png-dir", type=Path, default=None, help="draw <dir>/sim-<figure>.png")
    p.add_argument("--trace", default=None, help="write the runs to this JSON-lines file "
                   "(overwritten), for scripts/reader/trace_page.py")
    args = p.parse_args(argv)
    if args.trace:
        open(args.trace, "w").close()  # the tracer appends: start afresh
    for name in FIGURES if args.figure == "all" else [args.figure]:
        sims = run_figure(name, args.trace)
        print(f"== {name}: {FIGURES[name][3]}")
        for sim in sims:
            print(text_figure(sim))
            if len(FIGURES[name][0]) <= 8:
                print("\n".join(request_lines(sim)))
            print()
        png = args.png or (args.png_dir / f"sim-{name}.png" if args.png_dir else None)
        if png is not None:
            draw(name, sims, png)
            print(f"wrote {png}\n")


if __name__ == "__main__":
    main()
