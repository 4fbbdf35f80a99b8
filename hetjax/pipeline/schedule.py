"""Pipeline schedules as data: for every tick and stage, which micro-batch runs
forward and which runs backward (-1: none).

A tick is one lockstep step of all stages. In a tick a stage may run one forward
and one backward (of different micro-batches, the forward first); activations
sent at the end of tick t are used from tick t+1 on. The same tables drive the
single-program SPMD pipeline (hetjax.pipeline.spmd) and, read per stage as an
ordered list of operations (`Schedule.ops`), stages on different islands.

- gpipe: all forwards, then all backwards. Stage s keeps the inputs of all M
  micro-batches until their backward. Bubble (S-1)/(M+S-1).
- 1f1b: the classic one (PipeDream-flush, Megatron): stage s runs
  min(S-1-s, M) warm-up forwards, then alternates one forward and one backward,
  then the remaining backwards; one operation per stage per tick. Stage s keeps
  at most S-s inputs, whatever M. Forwards run every other tick (m on stage s
  at tick 2m+s), backwards in the ticks between (2m+2S-1-s), so the inputs
  arrive just in time and the stash stays S-s. In lockstep ticks each tick lasts
  a backward once the first one runs: with backward = 2 x forward the bubble is
  1 - 3M/(4M+3S-4) (on islands, where each stage runs its own `ops` without
  lockstep, it is the usual (S-1)/(M+S-1)).
- 1f1b_fused: stage s starts micro-batch m's backward as soon as the last stage
  has run it, so after a warm-up of S-1 ticks each stage runs one forward and
  one backward per tick. Bubble (S-1)/(M+S-1), but stage s keeps up to
  2(S-1-s)+1 inputs (2S-3 > S from S=4): bounded in S, not by it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hetjax.pipeline.config import PIPELINE_SCHEDULES as KINDS
from hetjax.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    kind: str
    stages: int
    microbatches: int
    forward: np.ndarray  # (ticks, stages) int32: micro-batch run forward, -1 none
    backward: np.ndarray  # (ticks, stages) int32: micro-batch run backward, -1 none

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    def tick_of(self, table: np.ndarray) -> np.ndarray:
        """(microbatches, stages): the tick at which each micro-batch runs on each stage."""
        out = np.full((self.microbatches, self.stages), -1)
        t, s = np.nonzero(table >= 0)
        out[table[t, s], s] = t
        return out

    def ops(self, stage: int) -> list[tuple[str, int]]:
        """This stage's operations in order: ("F", m) / ("B", m); a forward precedes
        the backward of the same tick."""
        out = []
        for t in range(self.ticks):
            if self.forward[t, stage] >= 0:
                out.append(("F", int(self.forward[t, stage])))
            if self.backward[t, stage] >= 0:
                out.append(("B", int(self.backward[t, stage])))
        return out

    def arrivals(self) -> np.ndarray:
        """(ticks, stages): the micro-batch whose activation stage s receives at the
        start of tick t (sent by stage s-1 at tick t-1), -1 none."""
        out = np.full_like(self.forward, -1)
        out[1:, 1:] = self.forward[:-1, :-1]
        return out

    def in_flight(self) -> np.ndarray:
        """(stages,): the most stage inputs a stage holds at once, from the input's
        arrival to the micro-batch's backward (inclusive). The first stage holds
        none: it re-embeds its tokens."""
        f, b = self.tick_of(self.forward), self.tick_of(self.backward)
        out = np.zeros(self.stages, int)
        for s in range(1, self.stages):
            arrive = f[:, s - 1] + 1
            out[s] = max(np.sum((arrive <= t) & (t <= b[:, s])) for t in range(self.ticks))
        return out

    def bubble_fraction(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """Idle share of each stage's time when every tick lasts as long as its
        slowest stage (a forward costs `forward_cost`, a backward `backward_cost`)."""
        per_stage = forward_cost * (self.forward >= 0) + backward_cost * (self.backward >= 0)
        total = per_stage.max(axis=1).sum()
        return float(1.0 - self.microbatches * (forward_cost + backward_cost) / total)


def make_schedule(kind: str, stages: int, microbatches: int) -> Schedule:
    """The schedule `kind` (one of KINDS) for S stages and M micro-batches."""
    S, M = stages, microbatches
    if kind not in KINDS:
        raise ConfigError(f"config.pipeline.schedule={kind!r}: choose one of {KINDS}")
    if S < 1 or M < 1:
        raise ConfigError(f"a schedule needs stages >= 1 and microbatches >= 1, got {S} and {M}")
    if kind.startswith("1f1b") and M < S:
        raise ConfigError(
            f"config.pipeline.microbatches={M} is smaller than the {S} pipeline stages: 1F1B "
            f"never fills the pipeline; use at least {S} micro-batches, or schedule='gpipe'")
    m, s = np.meshgrid(np.arange(M), np.arange(S), indexing="ij")  # (M, S)
    if kind == "1f1b":
        # Forwards on one parity of ticks, backwards on the other: each stage has
        # S-s forwards before its first backward (warm-up + the first of the
        # steady pairs), and every input and gradient is used in the tick after
        # it is sent.
        fwd, bwd = 2 * m + s, 2 * m + 2 * S - 1 - s
    else:
        fwd = m + s
        # The last stage runs a micro-batch's backward in the tick of its forward;
        # each earlier stage one tick after the stage behind it.
        start = (M - 1 if kind == "gpipe" else m) + S - 1
        bwd = (m if kind == "gpipe" else 0) + start + (S - 1 - s)
    ticks = int(bwd.max()) + 1
    forward = np.full((ticks, S), -1, np.int32)
    backward = np.full((ticks, S), -1, np.int32)
    forward[fwd, s] = m
    backward[bwd, s] = m
    schedule = Schedule(kind, S, M, forward, backward)
    check(schedule)
    return schedule


def forward_only(stages: int, microbatches: int) -> np.ndarray:
    """(M+S-1, S) int32: the forward table of evaluation, micro-batch m on stage s
    at tick m+s (-1 none)."""
    t, s = np.meshgrid(np.arange(microbatches + stages - 1), np.arange(stages), indexing="ij")
    return np.where((t - s >= 0) & (t - s < microbatches), t - s, -1).astype(np.int32)


def check(schedule: Schedule) -> None:
    """Raises ValueError unless every (micro-batch, stage) runs forward and backward
    exactly once, in dependency order, as the SPMD pipeline needs."""
    S, M = schedule.stages, schedule.microbatches
    for name, table in (("forward", schedule.forward), ("backward", schedule.backward)):
        for s in range(S):
            runs = sorted(table[:, s][table[:, s] >= 0].tolist())
            if runs != list(range(M)):
                raise ValueError(f"stage {s} runs {name} of micro-batches {runs}, not each of 0..{M - 1} once")
    f, b = schedule.tick_of(schedule.forward), schedule.tick_of(schedule.backward)
    if np.any(f[:, 1:] <= f[:, :-1]):
        raise ValueError("a stage runs a forward before the previous stage has sent its input")
    if np.any(b < f):
        raise ValueError("a backward runs before its forward")
    # No cotangent buffer: a stage consumes the gradient it receives in the next tick.
    if np.any(b[:, :-1] != b[:, 1:] + 1):
        raise ValueError("a stage's backward does not follow the next stage's by exactly one tick")


# ---------------------------------------------------------------------------
# Timelines for people


def timeline(schedule: Schedule) -> str:
    """One row per stage, one column per tick: `F3` forward of micro-batch 3,
    `B3` its backward, `F3B1` both in one tick, `.` idle."""
    cells = [[(f"F{f}" if f >= 0 else "") + (f"B{b}" if b >= 0 else "") or "."
              for f, b in zip(schedule.forward[:, s], schedule.backward[:, s])]
             for s in range(schedule.stages)]
    width = max(len(c) for row in cells for c in row)
    header = (f"{schedule.kind}: {schedule.stages} stages, {schedule.microbatches} micro-batches, "
              f"{schedule.ticks} ticks, bubble {schedule.bubble_fraction():.1%} "
              f"(backward = 2 x forward), at most {schedule.in_flight().max()} stashed inputs per stage")
    ticks = "tick    " + " ".join(f"{t:<{width}}" for t in range(schedule.ticks))
    rows = [f"stage {s} " + " ".join(f"{c:<{width}}" for c in row) for s, row in enumerate(cells)]
    return "\n".join([header, ticks, *rows])


def plot(schedule: Schedule, path: str, forward_cost: float = 1.0, backward_cost: float = 2.0) -> None:
    """Writes a Gantt chart of the schedule (ticks as long as their slowest stage)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_stage = forward_cost * (schedule.forward >= 0) + backward_cost * (schedule.backward >= 0)
    starts = np.concatenate([[0.0], np.cumsum(per_stage.max(axis=1))])
    fig, ax = plt.subplots(figsize=(max(6, starts[-1] * 0.3), 0.6 * schedule.stages + 1))
    colors = plt.get_cmap("tab20")
    for t in range(schedule.ticks):
        for s in range(schedule.stages):
            x = starts[t]
            for table, cost, hatch in ((schedule.forward, forward_cost, ""),
                                       (schedule.backward, backward_cost, "//")):
                m = table[t, s]
                if m >= 0:
                    ax.barh(s, cost, left=x, color=colors(m % 20), hatch=hatch, edgecolor="black")
                    ax.text(x + cost / 2, s, ("F" if table is schedule.forward else "B") + str(m),
                            ha="center", va="center", fontsize=7)
                    x += cost
    ax.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1)")
    ax.set_title(f"{schedule.kind}, S={schedule.stages}, M={schedule.microbatches}, "
                 f"bubble {schedule.bubble_fraction(forward_cost, backward_cost):.1%}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
