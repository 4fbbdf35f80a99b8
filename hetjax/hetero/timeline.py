"""Where an island's step time goes, as numbers every step and as a picture on request.

Every step, an island splits the time of its host thread (the one that runs the
schedule) into:
  dispatch    enqueueing its own programs (they run asynchronously on the device);
  wait_peer   waiting for a message of which no byte had arrived: the peer was still
              computing, or had not sent yet;
  wait_bytes  waiting from a message's first byte to its last (and its copy to the
              device): bytes in flight;
  wait_sends  waiting for our own sends to be taken, at the end of the step;
  compute     the rest: the host thread blocked on its own device's programs (before
              every wait on a link it first waits for them, so that a link wait is
              never our own device's time), and Python.
host_copy counts the seconds that transfer threads spent copying between device and
host memory; they run beside the host thread, so it is not part of that sum. On the
`direct` backend the first byte of a message is not visible, so its whole wait counts as
wait_peer.

With config.profile_steps=A:B an island also records those steps' operations, waits,
copies and messages in flight as spans, and writes run_dir/trace/<island>-<rank>.json
(Chrome's trace format, which Perfetto opens), with every step's program outputs
watched by a thread that marks when the device finished them; each program call of
those steps is also a TraceAnnotation of the same name in the jax.profiler trace of the
window (hetjax.profiler). The files of all islands share one wall clock:

    python -m hetjax.hetero.timeline RUN_DIR [--png PATH]

merges the newest job's files (an earlier job's left in trace/ are named and left out)
into RUN_DIR/trace.json, one process track per island, and draws the steps as
RUN_DIR/timeline.png.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path

import jax

from hetjax.errors import HetjaxError

PARTS = ("compute", "dispatch", "wait_peer", "wait_bytes", "wait_sends")
WAITS = PARTS[2:]  # time on the links (the step's transfer_time)
COLORS = {"compute": "#4c72b0", "dispatch": "#dd8452", "wait_peer": "#c44e52", "wait_bytes": "#8172b3",
          "wait_sends": "#937860", "host_copy": "#55a868", "message": "#bbbbbb", "step": "#eeeeee"}
TRACKS = ("host", "device", "copies", "messages")


class Timeline:
    """One island's clock: per-step seconds by part, and spans while recording."""

    def __init__(self, island: str, index: int, rank: int = 0, window: tuple[int, int] | None = None):
        self.island, self.index, self.rank, self.window = island, index, rank, window
        # One trace process per island and rank: the ranks of an island write one file each,
        # and merged they must not share tracks (or async ids).
        self.pid = index * 1000 + rank
        self.seconds: collections.Counter = collections.Counter()
        self.recording = False
        self.events: list[dict] = []
        self._lock = threading.Lock()
        # One wall clock for every process; perf_counter for the intervals.
        self._wall0, self._perf0 = time.time(), time.perf_counter()
        self._watch: queue.Queue | None = None
        self._last = None  # outputs of the last dispatched program (settle)
        self._step_start, self._step_end, self._loop = 0.0, None, 0.0

    # -- clock ---------------------------------------------------------------------

    def _us(self, t: float) -> float:
        return (self._wall0 + (t - self._perf0)) * 1e6

    def add(self, part: str, name: str, start: float, end: float, track: str = "host") -> None:
        """Counts end - start seconds (perf_counter times) into `part`; a span while recording."""
        with self._lock:
            self.seconds[part] += end - start
            if self.recording:
                self.events.append({"name": name, "cat": part, "ph": "X", "ts": self._us(start),
                                    "dur": (end - start) * 1e6, "pid": self.pid, "tid": TRACKS.index(track)})

    def waited(self, handle, start: float, sent: bool) -> None:
        """Counts a wait on `handle` from `start` until now: wait_sends for a send; for a
        receive, wait_peer until its first byte and wait_bytes after."""
        end, first = time.perf_counter(), handle.first_byte
        name = handle.describe.split(" from ")[0]
        if sent:
            self.add("wait_sends", name, start, end)
        elif first is None or first >= end:  # direct: the first byte is not seen
            self.add("wait_peer", name, start, end)
        else:
            first = min(max(first, start), end)
            self.add("wait_peer", name, start, first)
            self.add("wait_bytes", name, first, end)

    def message(self, name: str, handle) -> None:
        """While recording, a message in flight from now until `handle` completes."""
        if not self.recording:
            return
        start = time.perf_counter()
        handle.future.add_done_callback(lambda _: self._flight(name, start, time.perf_counter()))

    def _flight(self, name: str, start: float, end: float) -> None:
        with self._lock:  # async spans: messages overlap each other
            ident = self.pid * 10**7 + len(self.events)
            common = {"name": name, "cat": "message", "id": ident, "pid": self.pid, "tid": TRACKS.index("messages")}
            self.events += [dict(common, ph="b", ts=self._us(start)), dict(common, ph="e", ts=self._us(end))]

    # -- programs ------------------------------------------------------------------

    def program(self, name: str, fn):
        """fn (a compiled program) with its dispatch timed; while recording, its outputs are
        watched so that the device track shows when the device finished each program."""
        def call(*args, label: str = ""):  # label: this call's name in the trace (F3, B0...)
            t = time.perf_counter()
            # The window's jax.profiler trace names the call as this one does.
            with jax.profiler.TraceAnnotation(label or name) if self.recording else contextlib.nullcontext():
                out = fn(*args)
            end = time.perf_counter()
            self.add("dispatch", label or name, t, end)
            self._last = out
            if self._watch is not None:
                self._watch.put((label or name, end, out))
            return out
        return call

    def settle(self) -> None:
        """Waits, as `compute`, for the island's last dispatched program: a wait on a link
        that follows counts only the time the peer or the bytes take."""
        out, self._last = self._last, None
        if out is None:
            return
        t = time.perf_counter()
        _ready(out)
        self.add("compute", "own device", t, time.perf_counter())

    def _watcher(self, work: queue.Queue) -> None:
        done = time.perf_counter()
        while (item := work.get()) is not None:
            name, dispatched, out = item
            _ready(out)
            start, done = max(dispatched, done), time.perf_counter()
            with self._lock:  # queued while recording: kept even if it ends after the window
                self.events.append({"name": name, "cat": "compute", "ph": "X", "ts": self._us(start),
                                    "dur": (done - start) * 1e6, "pid": self.pid,
                                    "tid": TRACKS.index("device")})

    # -- steps ---------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Starts step `step`: zeroes the counts; records when the step is in the window."""
        recording = self.window is not None and self.window[0] <= step < self.window[1]
        if recording and self._watch is None:
            self._watch = queue.Queue()
            threading.Thread(target=self._watcher, args=(self._watch,), daemon=True).start()
        elif not recording and self._watch is not None:
            self._watch.put(None)
            self._watch = None
        self.recording = recording
        with self._lock:
            self.seconds.clear()
        self._step_start = time.perf_counter()
        # The training loop's own work since the last step (batches, metrics, digests).
        self._loop = self._step_start - self._step_end if self._step_end is not None else 0.0
        self._step = step

    def end(self) -> dict[str, float]:
        """The step's seconds by part (PARTS, host_copy, loop and the whole step)."""
        end = self._step_end = time.perf_counter()
        total = end - self._step_start
        with self._lock:
            out = {p: self.seconds[p] for p in PARTS[1:]}
            out["host_copy"] = self.seconds["host_copy"]
            settled = self.seconds["compute"]
            if self.recording:
                self.events.append({"name": f"step {self._step}", "cat": "step", "ph": "X",
                                    "ts": self._us(self._step_start), "dur": total * 1e6,
                                    "pid": self.pid, "tid": TRACKS.index("host")})
        out["compute"] = max(total - sum(out[p] for p in PARTS[1:]), settled)
        out["step"], out["loop"] = total, self._loop
        return out

    def write(self, run_dir: Path) -> Path | None:
        """Writes the recorded spans to run_dir/trace/<island>-<rank>.json (None: nothing recorded)."""
        if self._watch is not None:
            self._watch.put(None)
            self._watch = None
        with self._lock:
            events = list(self.events)
        if not events:
            return None
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid,
                 "args": {"name": f"island {self.island} (rank {self.rank})"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.pid, "args": {"sort_index": self.pid}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": i, "args": {"name": t}}
                 for i, t in enumerate(TRACKS)]
        # Which job wrote the file: merge keeps the files whose steps ran while the newest
        # file's did (the islands of one job step together), not an earlier job's.
        other = {"island": self.island, "rank": self.rank, "window": list(self.window or ()),
                 "span_us": list(_span({"traceEvents": events}))}
        path = Path(run_dir) / "trace" / f"{self.island}-{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole or not at all: a kill mid-write used to leave a cut file that merge choked on.
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}))
        os.replace(tmp, path)
        return path


def _ready(out) -> None:
    """Waits for a program's outputs; one already donated to a later program is done."""
    try:
        jax.block_until_ready(out)
    except RuntimeError as e:
        if "deleted" not in str(e):  # a donated array; any other error is the program's
            raise


# ---------------------------------------------------------------------------
# Merging every island's trace, and the picture.


# Clocks of the islands' hosts may disagree by this much; an earlier job in the same run
# directory ended longer ago than that before the next one's window (it starts, compiles and
# trains up to step A first).
SKEW_US = 1e6


def merge(run_dir: Path, echo=None) -> tuple[Path, list[dict]]:
    """The newest job's island trace files under run_dir/trace, as one run_dir/trace.json.
    A file whose traced steps ended before the newest file's began (with SKEW_US of slack), or
    that traced another window, is an earlier job's: left out, and named to `echo`."""
    files = sorted((Path(run_dir) / "trace").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{run_dir}/trace holds no trace: train with --config.profile_steps=A:B")
    traces = {f: _read(f) for f in files}
    spans = {f: _span(t) for f, t in traces.items()}
    newest = max(files, key=lambda f: (spans[f][1], f.stat().st_mtime))
    window = traces[newest].get("otherData", {}).get("window")
    keep = [f for f in files if spans[f][1] + SKEW_US >= spans[newest][0]
            and traces[f].get("otherData", {}).get("window", window) == window]
    for f in sorted(set(files) - set(keep)):
        if echo is not None:
            echo(f"{f}: left out, an earlier job's trace (its steps ran before {newest.name}'s)")
    events = [e for f in keep for e in traces[f]["traceEvents"]]
    path = Path(run_dir) / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path, events


def _read(path: Path) -> dict:
    try:
        trace = json.loads(path.read_text())
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            raise ValueError("no traceEvents list")
        return trace
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HetjaxError(f"{path}: not a readable island trace ({e}); a kill while it was written can "
                          f"cut one short: delete it (that island's steps are then missing) or profile "
                          f"again") from None


def _span(trace: dict) -> tuple[float, float]:
    """The wall-clock microseconds of a file's traced steps (computed for files written
    before they carried them)."""
    other = trace.get("otherData", {}).get("span_us")
    if other:
        return tuple(other)
    timed = [e for e in trace["traceEvents"] if "ts" in e]
    steps = [e for e in timed if e.get("cat") == "step"] or timed
    if not steps:
        return (-math.inf, math.inf)  # nothing timed: it cannot be told apart, so it is kept
    return min(e["ts"] for e in steps), max(e["ts"] + e.get("dur", 0) for e in steps)


def draw(events: list[dict], path: Path, title: str = "") -> Path:
    """The merged trace as a picture: a row per island and track, time in ms."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    flights, opened = [], {}
    for e in events:
        if e.get("ph") == "b":
            opened[(e["pid"], e["id"])] = e
        elif e.get("ph") == "e" and (e["pid"], e["id"]) in opened:
            b = opened.pop((e["pid"], e["id"]))
            flights.append(dict(b, dur=e["ts"] - b["ts"]))
    t0 = min(e["ts"] for e in spans + flights)
    rows = [(pid, tid) for pid in sorted(names) for tid in range(len(TRACKS))
            if any(e["pid"] == pid and e.get("tid") == tid for e in spans + flights)]
    fig, ax = plt.subplots(figsize=(14, 0.55 * len(rows) + 1.4))
    for y, (pid, tid) in enumerate(rows):
        mine = [e for e in spans + flights if e["pid"] == pid and e.get("tid") == tid]
        if TRACKS[tid] == "messages":  # overlapping: stack them thinly
            lanes: list[float] = []
            for e in sorted(mine, key=lambda e: e["ts"]):
                lane = next((i for i, end in enumerate(lanes) if end <= e["ts"]), len(lanes))
                lanes[lane:lane + 1] = [e["ts"] + e["dur"]]
                ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (y - 0.4 + 0.2 * (lane % 4), 0.18),
                               facecolors=COLORS["message"], edgecolor="#666666", linewidth=0.3)
            continue
        for e in sorted(mine, key=lambda e: -e["dur"]):  # steps behind their parts
            ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (y - 0.4, 0.8),
                           facecolors=COLORS.get(e["cat"], "#999999"), edgecolor="white", linewidth=0.3)
            if e["cat"] == "compute" and TRACKS[tid] == "device" and e["dur"] > 0:
                ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, y, e["name"].split()[0], ha="center",
                        va="center", fontsize=6, color="white", clip_on=True)
    ax.set_yticks(range(len(rows)), [f"{names[p].split(' (')[0]} {TRACKS[t]}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in COLORS]
    ax.legend(handles, list(COLORS), ncol=len(COLORS), loc="upper center", bbox_to_anchor=(0.5, -0.25 if
              len(rows) > 4 else -0.45), fontsize=8, frameon=False)
    ax.set_title(title or "islands timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    from hetjax import cli
    p = cli.ArgumentParser(prog="python -m hetjax.hetero.timeline", description=__doc__.split("\n\n")[0],
                           example="python -m hetjax.hetero.timeline runs/tiny_hetero")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--png", type=Path, default=None, help="the picture's path (default RUN_DIR/timeline.png)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    try:
        path, events = merge(args.run_dir, echo=print)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except HetjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        cli.need("matplotlib", "plot", "the timeline's picture")
    except cli.ConfigError as e:
        print(f"{path}: {len(events)} events (open in https://ui.perfetto.dev); no picture: {e}")
        return 0
    png = draw(events, args.png or args.run_dir / "timeline.png", args.title or str(args.run_dir))
    print(f"{path}: {len(events)} events (open in https://ui.perfetto.dev); picture: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
