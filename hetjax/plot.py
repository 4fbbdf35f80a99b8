"""Curves of one or several runs in one PNG: loss (and eval loss), throughput, MFU (both
counts: `mfu`, PaLM's 6N + full attention, solid; `mfu_maxtext`, causal attention
halved, dashed) and, for a job over islands, each island's step and transfer times.

    python -m hetjax.plot runs/tiny runs/tiny_hetero --out curves.png

A run is a run_dir of hetjax.train: its metrics.jsonl, plus those the other processes
of an islands job wrote under RUN/islands/*/. The first step of each process's run is
left out of the throughput, MFU and island panels: it carries the warm-up, which would
flatten the rest. That is each file's first row, and where a run resumed in the same
run_dir appended to it, the row marked `run_start` (or, in a file without that mark, a
row whose step does not follow the one before).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from hetjax import cli
from hetjax.errors import ConfigError


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of a run: metrics.jsonl and its islands' files, rows of one
    step merged (each process writes its own island's series), in step order."""
    run_dir = Path(run_dir)
    main = run_dir / "metrics.jsonl"
    if not main.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl here; give the run_dir of a hetjax.train run "
                          f"(--config.run_dir=...)")
    train: dict[int, dict] = {}
    evals = []
    for i, path in enumerate([main, *sorted(run_dir.glob("islands/*/metrics.jsonl"))]):
        previous = None  # the step of the file's last training row
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
            if "eval_loss" in row:
                if i == 0:
                    evals.append(row)
                continue
            # metrics.truncate keeps a file's steps increasing across a resume: a resumed
            # run's first row is known by train.py's mark. A step that goes back (a file
            # not truncated) starts a run too.
            start = previous is None or row["step"] <= previous or bool(row.get("run_start"))
            previous, step = row["step"], row["step"]
            if i > 0:  # an island's own series only: the job's loss and times are the writer's
                if step not in train:
                    continue
                row = {k: v for k, v in row.items() if "/" in k}
            row["warmup"] = start or train.get(step, {}).get("warmup", False)
            train.setdefault(step, {}).update(row)
    return [train[s] for s in sorted(train)], evals


def islands(rows: list[dict]) -> list[str]:
    """The islands whose `<island>/step_time` series the rows hold."""
    names = {m.group(1) for r in rows for k in r if (m := re.fullmatch(r"(.+)/step_time", k))}
    return sorted(names)


def steady(rows: list[dict], key: str, like: str | None = None) -> tuple[list, list]:
    """(steps, values) of `key` over the rows that have `like` (default: `key`; a missing
    value is 0), with each warm-up row (a run's or resume's first step) a gap, not a point:
    a line drawn across it would join two runs' steady states."""
    steps, values = [], []
    for r in rows:
        if (like or key) in r:
            steps.append(r["step"])
            values.append(math.nan if r["warmup"] else r.get(key, 0.0))
    return steps, values


def draw(runs: list[str | Path], out: str | Path) -> Path:
    """Writes the PNG of `runs`' curves to `out`."""
    cli.need("matplotlib", "plot", "python -m hetjax.plot")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = {_label(r, runs): read_metrics(r) for r in runs}
    any_islands = any(islands(rows) for rows, _ in data.values())
    panels = 4 if any_islands else 3
    fig, axes = plt.subplots(panels, 1, figsize=(9, 2.8 * panels), sharex=True)
    for i, (label, (rows, evals)) in enumerate(data.items()):
        color = f"C{i % 10}"
        axes[0].plot([r["step"] for r in rows], [r["loss"] for r in rows], color=color, label=label)
        if evals:
            axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o", color=color,
                         label=f"{label} (eval)")
        axes[1].plot(*steady(rows, "tokens_per_sec"), color=color, label=label)
        axes[2].plot(*steady(rows, "mfu"), color=color, label=f"{label} mfu")
        if any("mfu_maxtext" in r for r in rows):
            axes[2].plot(*steady(rows, "mfu_maxtext"), "--", color=color, label=f"{label} mfu_maxtext")
        for j, name in enumerate(islands(rows)):
            style = ["-", ":", "-.", (0, (5, 1))][j % 4]
            axes[3].plot(*steady(rows, f"{name}/step_time"), linestyle=style, color=color, label=f"{label} {name} step")
            axes[3].plot(*steady(rows, f"{name}/transfer_time", like=f"{name}/step_time"), linestyle=style,
                         color=color, alpha=0.45, label=f"{label} {name} transfer")
    titles = ["loss", "tokens/s", "MFU (solid: PaLM 6N + attention; dashed: MaxText, causal halved)",
              "per island: step time, transfer time (pale), s"]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10, loc="left")
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def loss_gaps(reference: str | Path, others: dict[str, str | Path], out: str | Path, rtol: float,
              reference_name: str | None = None) -> Path:
    """One PNG of each run's relative loss gap to `reference`, step by step (from their
    fingerprints.jsonl, which hold the losses bit for bit), with the tolerance drawn."""
    cli.need("matplotlib", "plot", "the loss-gap picture")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from hetjax.repro.record import read
    _, ref, _ = read(reference)
    fig, ax = plt.subplots(figsize=(9, 4))
    smallest = rtol
    for i, (name, run_dir) in enumerate(others.items()):
        _, rows, _ = read(run_dir)
        steps = sorted(set(ref) & set(rows))
        gaps = [abs(ref[s]["loss"] - rows[s]["loss"]) / max(abs(ref[s]["loss"]), 1e-30) for s in steps]
        smallest = min([smallest, *(g for g in gaps if g > 0)])
        ax.plot(steps, gaps, ".-", color=f"C{i % 10}", label=name)
    ax.axhline(rtol, color="C3", linestyle="--", label=f"tolerance {rtol:g}")
    ax.set_yscale("symlog", linthresh=smallest)  # bit-identical runs sit at 0
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("relative loss gap")
    ax.set_title(f"loss gap of each layout to {reference_name or Path(reference).name}: "
                 f"|loss - reference| / |reference|", fontsize=10, loc="left")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _label(run, runs) -> str:
    names = [Path(r).name for r in runs]
    path = Path(run)
    return path.name if names.count(path.name) == 1 else str(path)


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m hetjax.plot", description=__doc__,
                           example="python -m hetjax.plot runs/tiny                    # runs/tiny/curves.png\n"
                                   "python -m hetjax.plot runs/a runs/b --out ab.png")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (config.run_dir)")
    p.add_argument("--out", default=None, help="the PNG (default: RUN/curves.png for one run, "
                                               "curves.png here for several)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    def run() -> int:
        out = args.out or (Path(args.runs[0]) / "curves.png" if len(args.runs) == 1 else Path("curves.png"))
        print(f"curves of {len(args.runs)} run(s): {draw(args.runs, out)}")
        return 0
    return cli.run_main(run)


if __name__ == "__main__":
    sys.exit(main())
