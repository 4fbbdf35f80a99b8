"""config.profile_steps=A:B: a jax.profiler trace of steps A..B-1, which TensorBoard's
profile plugin and Perfetto open. Jobs over islands also draw their own timeline of
those steps (hetjax.hetero.timeline).

Each process writes its own trace into its run directory's profile/ (every process has a
run directory of its own: an island's process its islands/ one, a one-mesh job's process
i > 0 run_dir/processes/i): plugins/profile/<time>/<host>.xplane.pb for
TensorBoard's profile plugin (`tensorboard --logdir RUN_DIR/profile`) and
perfetto_trace.json.gz beside it for https://ui.perfetto.dev. Each traced step is a
StepTraceAnnotation named "train", which the profile plugin's step view reads."""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import math
import re
from pathlib import Path

import jax


def parse_window(text: str) -> tuple[int, int] | None:
    """config.profile_steps "A:B" -> (A, B), steps A..B-1; "" -> None (config validates it)."""
    if not text:
        return None
    a, _, b = text.partition(":")
    return int(a), int(b)


class Profiler:
    """Starts jax.profiler before step A (or the first step of a run resumed inside the
    window) and stops it after step B-1, or at close, saying which steps it traced; a run
    resumed past the window says so at its first step."""

    def __init__(self, window: str, directory: Path, log=print):
        self.window = parse_window(window)
        self.directory, self.log, self.active = Path(directory), log, False
        self.traced: list[int] = []  # the steps dispatched while tracing
        self.first: int | None = None  # the run's first step: the first `before` sees

    def before(self, step: int) -> bool:
        """Before step `step` is dispatched; True when the trace started now."""
        if self.first is None:
            self.first = step
            # Validation refuses a window before config.data.start_step; a resumed run starts
            # at its checkpoint, which only the loop knows, and would otherwise trace in silence.
            if self.window and step >= self.window[1]:
                self.log(f"no profile: config.profile_steps={self.window[0]}:{self.window[1]} ends before "
                         f"step {step}, this run's first step (it resumed past the window), so nothing is traced")
        if self.window and not self.traced and not self.active and self.window[0] <= step < self.window[1]:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True
            return True
        return False

    def after(self, step: int, result=None) -> bool:
        """After step `step` was dispatched; `result` is waited for before the trace stops.
        True when it stopped now."""
        if not self.active:
            return False
        self.traced.append(step)
        if step == self.window[1] - 1:
            jax.block_until_ready(result)
            self.close()
            return True
        return False

    def step(self, step: int):
        """A context around step `step`'s dispatch: its StepTraceAnnotation while tracing."""
        if self.active:
            return jax.profiler.StepTraceAnnotation("train", step_num=step)
        return contextlib.nullcontext()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            steps = f"steps {self.traced[0]}..{self.traced[-1]}" if self.traced else "no step"
            self.log(f"profile of {steps} (config.profile_steps={self.window[0]}:{self.window[1]}) "
                     f"in {self.directory}")


# Kernel names by what they do, as CUDA's and ROCm's libraries and XLA name them.
KERNEL_KINDS = (
    ("attention", re.compile(r"fmha|flash|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|wgmma|hipblaslt|dot", re.I)),
    ("collective", re.compile(r"nccl|rccl|all-?reduce|all-?gather|reduce-?scatter|collective", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kernel_kind(name: str) -> str:
    """'attention', 'matmul', 'collective', 'copy' or 'other' (fusions, mostly elementwise)."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def kernel_summary(trace_dir: str | Path, top: int = 12) -> list[str]:
    """Lines describing the device time in the newest perfetto trace under `trace_dir`:
    busy time per device (the union of its kernels' intervals) against the traced span,
    the time per kind of kernel, and the `top` kernels by total time with their launch
    counts. [] without one."""
    files = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        return []
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    devices = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name" and
               str(e.get("args", {}).get("name", "")).startswith("/device:")}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in devices and e.get("dur")]
    if not kernels:
        return []
    lines = []
    for pid, name in sorted(devices.items()):
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels if e["pid"] == pid)
        if not mine:
            continue
        busy, end = 0.0, -math.inf
        for a, b in mine:  # streams overlap: count each instant once
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        span = end - mine[0][0]
        lines.append(f"{name}: kernels busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms traced "
                     f"({busy / span:.1%}), {len(mine)} kernels")
    total = sum(e["dur"] for e in kernels)
    kinds, names, launches = collections.Counter(), collections.Counter(), collections.Counter()
    for e in kernels:
        kinds[kernel_kind(e["name"])] += e["dur"]
        names[e["name"]] += e["dur"]
        launches[e["name"]] += 1
    lines.append("kernel time by kind: " + ", ".join(f"{k} {t / total:.1%}" for k, t in kinds.most_common()))
    for n, t in names.most_common(top):
        lines.append(f"  {t / 1e3:9.2f} ms  {t / total:6.1%}  x{launches[n]:<5d} [{kernel_kind(n)}] {n[:100]}")
    return lines
