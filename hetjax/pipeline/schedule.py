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

Interleaved (circular) stages, `virtual` = V > 1 (gpipe and 1f1b_fused): device s
holds V chunks of layers, chunk v being virtual stage j = v*S + s of S*V, and a
micro-batch goes round the devices V times (device S-1 sends chunk v's output to
device 0's chunk v+1). Micro-batches move in groups of S: device s runs the
forward of micro-batch m = g*S + i, chunk v at tick g*V*S + v*S + i + s, so every
input, including the one coming round from the last device, is used in the tick
after it is sent, and a tick holds 1/V of a stage's work: the warm-up and
cool-down shrink by about V. The backward mirrors the forward (gpipe) or starts
as soon as the last virtual stage has run the micro-batch (fused).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hetjax.pipeline.config import PIPELINE_SCHEDULES as KINDS
from hetjax.pipeline.config import VIRTUAL_SCHEDULES as VIRTUAL_KINDS
from hetjax.errors import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    kind: str
    stages: int
    microbatches: int
    forward: np.ndarray  # (ticks, stages) int32: micro-batch run forward, -1 none
    backward: np.ndarray  # (ticks, stages) int32: micro-batch run backward, -1 none
    virtual: int = 1  # chunks of layers per device (interleaved stages when > 1)
    forward_chunk: np.ndarray | None = None  # (ticks, stages) int32: the chunk of each forward, -1 none
    backward_chunk: np.ndarray | None = None  # (ticks, stages) int32: the chunk of each backward

    def __post_init__(self):
        # V = 1 needs no chunk tables: every operation runs chunk 0.
        for name, table in (("forward_chunk", self.forward), ("backward_chunk", self.backward)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.where(table >= 0, 0, -1).astype(np.int32))

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    @property
    def name(self) -> str:
        return self.kind if self.virtual == 1 else f"{self.kind} x{self.virtual} virtual"

    def tick_of(self, table: np.ndarray, chunks: np.ndarray | None = None) -> np.ndarray:
        """(microbatches, stages * virtual): the tick at which each micro-batch runs on
        each virtual stage j = v*S + s (chunks: the table's chunk table; None: chunk 0)."""
        out = np.full((self.microbatches, self.stages * self.virtual), -1)
        t, s = np.nonzero(table >= 0)
        v = 0 if chunks is None else chunks[t, s]
        out[table[t, s], v * self.stages + s] = t
        return out

    def ops(self, stage: int) -> list[tuple[str, int, int]]:
        """This stage's operations in order: ("F", m, v) / ("B", m, v), micro-batch m
        through the stage's chunk v (0 when V = 1); a forward precedes the backward of
        the same tick. Every input comes from an earlier tick, so stages that each run
        their own list without lockstep (islands) never wait on one another in a cycle."""
        out = []
        for t in range(self.ticks):
            if self.forward[t, stage] >= 0:
                out.append(("F", int(self.forward[t, stage]), int(self.forward_chunk[t, stage])))
            if self.backward[t, stage] >= 0:
                out.append(("B", int(self.backward[t, stage]), int(self.backward_chunk[t, stage])))
        return out

    def arrivals(self) -> tuple[np.ndarray, np.ndarray]:
        """(ticks, stages) twice: the micro-batch whose activation stage s receives at
        the start of tick t (sent by stage s-1, or round from the last device when
        V > 1, at tick t-1), -1 none, and the chunk it feeds."""
        out, chunk = np.full_like(self.forward, -1), np.full_like(self.forward, -1)
        out[1:, 1:], chunk[1:, 1:] = self.forward[:-1, :-1], self.forward_chunk[:-1, :-1]
        if self.virtual > 1:  # the last device's chunk v feeds device 0's chunk v+1
            wrap = (self.forward_chunk[:-1, -1] >= 0) & (self.forward_chunk[:-1, -1] < self.virtual - 1)
            out[1:, 0] = np.where(wrap, self.forward[:-1, -1], -1)
            chunk[1:, 0] = np.where(wrap, self.forward_chunk[:-1, -1] + 1, -1)
        return out, chunk

    def _holds(self) -> list[list[tuple[int, int, int, int]]]:
        """Per stage: (arrival tick, backward tick, micro-batch, chunk) of every stage
        input it keeps. The first virtual stage keeps none: it re-embeds its tokens."""
        f = self.tick_of(self.forward, self.forward_chunk)
        b = self.tick_of(self.backward, self.backward_chunk)
        out = [[] for _ in range(self.stages)]
        for j in range(1, self.stages * self.virtual):
            v, s = divmod(j, self.stages)
            out[s] += [(int(f[m, j - 1]) + 1, int(b[m, j]), m, v) for m in range(self.microbatches)]
        return out

    def in_flight(self) -> np.ndarray:
        """(stages,): the most stage inputs a stage holds at once, from the input's
        arrival to the micro-batch's backward (inclusive)."""
        return np.array([max((sum(a <= t <= b for a, b, _, _ in held) for t in range(self.ticks)), default=0)
                         for held in self._holds()], int)

    def slots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Where each stage keeps its inputs: (ticks, stages) stash slots of the input
        arriving, of the forward's input and of the backward's input (0 when none),
        and the slot count (>= 1). Slots go lowest-free-first in order of arrival, so
        in_flight().max() of them suffice."""
        arrive, fwd, bwd = (np.zeros_like(self.forward) for _ in range(3))
        f = self.tick_of(self.forward, self.forward_chunk)
        count = 1
        for s, held in enumerate(self._holds()):
            free_at = []  # per slot: the first tick it is free again
            for a, b, m, v in sorted(held):
                slot = next((k for k, t in enumerate(free_at) if t <= a), len(free_at))
                free_at[slot:slot + 1] = [b + 1]
                arrive[a, s], fwd[f[m, v * self.stages + s], s], bwd[b, s] = slot, slot, slot
            count = max(count, len(free_at))
        return arrive, fwd, bwd, count

    def bubble_fraction(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """Idle share of each stage's time when every tick lasts as long as its
        slowest stage (a forward costs `forward_cost`, a backward `backward_cost`,
        for a whole stage: a chunk costs 1/V of it)."""
        per_stage = forward_cost * (self.forward >= 0) + backward_cost * (self.backward >= 0)
        total = per_stage.max(axis=1).sum()
        return float(1.0 - self.microbatches * self.virtual * (forward_cost + backward_cost) / total)


def split_orders(schedule: Schedule, pending: int | None = None) -> list[list[tuple[str, int, int]]]:
    """Each stage's operations when its backwards are split (config.pipeline.split_backward,
    islands): ("B", m, v) gives the input gradient only, and ("W", m, v), the weight
    gradient, runs later. The order of every stage's forwards and backwards is `ops`'; a
    W runs where the stage would otherwise wait for an input (found by running the
    islands' schedule with unit costs and instant links), or right after a B that leaves
    more than `pending` (default: the stage count) waiting, the rest at the end. W's run
    in the order of their backwards, so the gradients add up in the same order as unsplit
    backwards."""
    spans, _ = _islands_run(schedule, True, schedule.stages if pending is None else pending)
    return [[op[:3] for op in ops] for ops in spans]


def _islands_run(schedule: Schedule, split: bool, cap: int):
    """(each stage's (op, m, v, start, end) in the order it runs them, the step's length):
    every island runs its `ops` without lockstep, a forward, an input-gradient and a
    weight-gradient part costing 1 each and links instant; with `split`, W's are placed as
    split_orders says."""
    S, J = schedule.stages, schedule.stages * schedule.virtual
    base = [schedule.ops(s) for s in range(S)]
    spans = [[] for _ in range(S)]
    free, at, waiting = [0.0] * S, [0] * S, [[] for _ in range(S)]
    done = {}  # (op, m, j) -> when it ends

    def ready(s):
        """When stage s's next operation may start (None: its input's time is not known yet)."""
        op, m, v = base[s][at[s]]
        j = v * S + s
        if op == "F":
            return 0.0 if j == 0 else done.get(("F", m, j - 1))
        return done.get(("F", m, j)) if j == J - 1 else done.get(("B", m, j + 1))

    def run(s, op, m, v, start):
        j = v * S + s
        # The last virtual stage's forward runs inside its backward; an unsplit backward
        # holds the weight-gradient part too.
        cost = (0.0 if (op, j) == ("F", J - 1) else 1.0) + (op == "B") * ((j == J - 1) + (not split))
        done[op, m, j] = free[s] = start + cost
        spans[s].append((op, m, v, start, start + cost))

    while any(at[s] < len(base[s]) or waiting[s] for s in range(S)):
        for s in sorted((s for s in range(S) if at[s] < len(base[s]) or waiting[s]), key=lambda s: (free[s], s)):
            if at[s] == len(base[s]):  # only W's left
                run(s, *waiting[s].pop(0), free[s])
                break
            r = ready(s)
            if r is not None and r <= free[s]:
                op, m, v = base[s][at[s]]
                at[s] += 1
                run(s, op, m, v, free[s])
                if op == "B" and split:
                    waiting[s].append(("W", m, v))
                    if len(waiting[s]) > cap:  # after the B, not before: the B is what a peer waits for
                        run(s, *waiting[s].pop(0), free[s])
                break
            if waiting[s]:  # the stage would wait: a weight gradient fills the time
                run(s, *waiting[s].pop(0), free[s])
                break
            if r is not None:
                free[s] = r
                break
        else:
            raise AssertionError(f"{schedule.name}: no stage can run its next operation")
    return spans, max(free)


def _island_bubble(schedule: Schedule, length: float) -> float:
    """The idle share of an islands' step of `length` forwards (the work is 3 per micro-batch and chunk)."""
    return 1.0 - 3 * schedule.microbatches * schedule.virtual / length


# How make_schedule's errors name its settings: the config's fields by default; a command
# passes its own option names.
CONFIG_NAMES = {"schedule": "config.pipeline.schedule={!r}", "stages": "config.mesh.pipeline={}",
                "microbatches": "config.pipeline.microbatches={}",
                "virtual": "config.pipeline.virtual_stages={}"}


def make_schedule(kind: str, stages: int, microbatches: int, virtual: int = 1, names=CONFIG_NAMES) -> Schedule:
    """The schedule `kind` (one of KINDS) for S stages, M micro-batches and V chunks
    of layers per stage (virtual stages; V > 1 for gpipe and 1f1b_fused). `names`: how
    a ConfigError names the settings (CONFIG_NAMES' keys, as format strings)."""
    S, M, V = stages, microbatches, virtual
    if kind not in KINDS:
        raise ConfigError(f"{names['schedule'].format(kind)}: choose one of {KINDS}")
    for key, value in (("stages", S), ("microbatches", M), ("virtual", V)):
        if value < 1:
            raise ConfigError(f"{names[key].format(value)}: must be at least 1")
    if kind.startswith("1f1b") and M < S:
        raise ConfigError(
            f"{names['microbatches'].format(M)} is smaller than the {S} pipeline stages: 1F1B "
            f"never fills the pipeline; use at least {S} micro-batches, or {names['schedule'].format('gpipe')}")
    if V > 1 and kind not in VIRTUAL_KINDS:
        raise ConfigError(f"{names['virtual'].format(V)} with {names['schedule'].format(kind)}: interleaved "
                          f"stages run with {' or '.join(VIRTUAL_KINDS)}; set {names['virtual'].format(1)} "
                          f"or change the schedule")
    m, v, s = np.meshgrid(np.arange(M), np.arange(V), np.arange(S), indexing="ij")  # (M, V, S)
    if kind == "1f1b":
        # Forwards on one parity of ticks, backwards on the other: each stage has
        # S-s forwards before its first backward (warm-up + the first of the
        # steady pairs), and every input and gradient is used in the tick after
        # it is sent.
        fwd, bwd = 2 * m + s, 2 * m + 2 * S - 1 - s
    else:
        g, i = np.divmod(m, S)  # groups of S micro-batches go round the devices together
        order = g * V * S + i  # a micro-batch's place in its device's forward order, chunk 0
        fwd = order + v * S + s
        last = fwd[:, V - 1, S - 1][:, None, None]  # when the last virtual stage runs m
        # The last virtual stage runs a micro-batch's backward in the tick of its
        # forward (fused) or after all forwards (gpipe); each earlier virtual stage
        # one tick after the one behind it.
        start = fwd.max() + order if kind == "gpipe" else last
        bwd = start + (V - 1 - v) * S + (S - 1 - s)
    ticks = int(bwd.max()) + 1
    forward, backward, forward_chunk, backward_chunk = (np.full((ticks, S), -1, np.int32) for _ in range(4))
    forward[fwd, s], forward_chunk[fwd, s] = m, v
    backward[bwd, s], backward_chunk[bwd, s] = m, v
    schedule = Schedule(kind, S, M, forward, backward, V, forward_chunk, backward_chunk)
    check(schedule)
    return schedule


def forward_only(stages: int, microbatches: int, virtual: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Evaluation's forward table and its chunk table, (ticks, S) int32 each (-1 none):
    the training schedule's forward order, micro-batch m = g*S + i, chunk v on stage s
    at tick g*V*S + v*S + i + s (m + s when V = 1)."""
    S, M, V = stages, microbatches, virtual
    m, v, s = np.meshgrid(np.arange(M), np.arange(V), np.arange(S), indexing="ij")
    g, i = np.divmod(m, S)
    fwd = g * V * S + v * S + i + s
    table, chunk = (np.full((int(fwd.max()) + 1, S), -1, np.int32) for _ in range(2))
    table[fwd, s], chunk[fwd, s] = m, v
    return table, chunk


def check(schedule: Schedule) -> None:
    """Raises ValueError unless every (micro-batch, virtual stage) runs forward and
    backward exactly once, in dependency order, as the SPMD pipeline needs."""
    S, M, V = schedule.stages, schedule.microbatches, schedule.virtual
    for name, table, chunk in (("forward", schedule.forward, schedule.forward_chunk),
                               ("backward", schedule.backward, schedule.backward_chunk)):
        for s in range(S):
            runs = sorted(zip(chunk[:, s][table[:, s] >= 0].tolist(), table[:, s][table[:, s] >= 0].tolist()))
            if runs != [(c, mb) for c in range(V) for mb in range(M)]:
                raise ValueError(f"stage {s} runs {name} of (chunk, micro-batch) {runs}, not each of "
                                 f"{V} x 0..{M - 1} once")
    f = schedule.tick_of(schedule.forward, schedule.forward_chunk)
    b = schedule.tick_of(schedule.backward, schedule.backward_chunk)
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
    `B3` its backward, `F3B1` both in one tick, `.` idle; with virtual stages
    `F3.1` is micro-batch 3's forward through the stage's chunk 1."""
    def op(name, m, v):
        return "" if m < 0 else op_label(name, m, v, schedule.virtual)
    cells = [[op("F", f, fv) + op("B", b, bv) or "."
              for f, fv, b, bv in zip(schedule.forward[:, s], schedule.forward_chunk[:, s],
                                      schedule.backward[:, s], schedule.backward_chunk[:, s])]
             for s in range(schedule.stages)]
    width = max(len(c) for row in cells for c in row)
    header = (f"{schedule.name}: {schedule.stages} stages, {schedule.microbatches} micro-batches, "
              f"{schedule.ticks} ticks, bubble {schedule.bubble_fraction():.1%} "
              f"(backward = 2 x forward), at most {schedule.in_flight().max()} stashed inputs per stage")
    ticks = "tick    " + " ".join(f"{t:<{width}}" for t in range(schedule.ticks))
    rows = [f"stage {s} " + " ".join(f"{c:<{width}}" for c in row) for s, row in enumerate(cells)]
    return "\n".join([header, ticks, *rows])


def island_orders(schedule: Schedule, split: bool = False) -> str:
    """Each stage's operations in the order an island holding it runs them (`Schedule.ops`:
    no lockstep ticks, each waits only for its own inputs), one line per island; with
    `split`, backwards split into B and W (split_orders). The header gives the step's
    length in forwards of one chunk, at unit costs."""
    spans, length = _islands_run(schedule, split, schedule.stages)
    how = "backwards split into B (input gradient) and W (weight gradient)" if split else "whole backwards"
    return "\n".join([f"{schedule.name} on islands, {how} (each runs its own order, no lockstep): "
                      f"{length:g} forwards a step at unit costs, bubble {_island_bubble(schedule, length):.1%}"] + [
        f"island {s} " + " ".join(op_label(*op[:3], schedule.virtual) for op in ops) for s, ops in enumerate(spans)])


def plot(schedule: Schedule, path: str, forward_cost: float = 1.0, backward_cost: float = 2.0) -> None:
    """Writes a Gantt chart of the schedule (ticks as long as their slowest stage)."""
    per_stage = forward_cost * (schedule.forward >= 0) + backward_cost * (schedule.backward >= 0)
    starts = np.concatenate([[0.0], np.cumsum(per_stage.max(axis=1))])
    bars = []  # (row, op, m, v, start, end)
    for t in range(schedule.ticks):
        for s in range(schedule.stages):
            x = starts[t]
            for op, table, chunks, cost in (("F", schedule.forward, schedule.forward_chunk, forward_cost),
                                            ("B", schedule.backward, schedule.backward_chunk, backward_cost)):
                if table[t, s] >= 0:
                    bars.append((s, op, table[t, s], chunks[t, s], x, x + cost))
                    x += cost
    _gantt(schedule, bars, starts[-1], "stage", f"{schedule.name}, S={schedule.stages}, M={schedule.microbatches}, "
           f"bubble {schedule.bubble_fraction(forward_cost, backward_cost):.1%}", path)


def plot_islands(schedule: Schedule, path: str, split: bool = False) -> None:
    """Writes a Gantt chart of islands running `schedule` at unit costs (as island_orders), with
    split backwards if `split`: forwards plain, B's (or whole backwards) hatched, W's dotted."""
    spans, length = _islands_run(schedule, split, schedule.stages)
    # The last virtual stage's forward runs inside its backward: it takes no time of its own.
    bars = [(s, *op) for s, ops in enumerate(spans) for op in ops if op[4] > op[3]]
    _gantt(schedule, bars, length, "island", f"{schedule.name} on islands, {'split' if split else 'whole'} "
           f"backwards, S={schedule.stages}, M={schedule.microbatches}, bubble {_island_bubble(schedule, length):.1%}",
           path)


def op_label(op: str, m: int, v: int, virtual: int) -> str:
    """`F3`, or `F3.1` (micro-batch 3 through chunk 1) with virtual stages: how timelines,
    plots and the islands' traces name an operation."""
    return f"{op}{m}" + (f".{v}" if virtual > 1 else "")


def _gantt(schedule: Schedule, bars, length: float, row: str, title: str, path: str) -> None:
    """Draws bars (row, op, micro-batch, chunk, start, end), one row per stage, into `path`:
    forwards plain, backwards (B's) hatched, W's dotted, colour by micro-batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, length * 0.3), 0.6 * schedule.stages + 1))
    colors = plt.get_cmap("tab20")
    for s, op, m, v, start, end in bars:
        ax.barh(s, end - start, left=start, color=colors(m % 20), hatch={"F": "", "B": "//", "W": ".."}[op],
                edgecolor="black")
        ax.text((start + end) / 2, s, op_label(op, m, v, schedule.virtual), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(schedule.stages), [f"{row} {s}" for s in range(schedule.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
