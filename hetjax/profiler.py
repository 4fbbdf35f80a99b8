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

import contextlib
from pathlib import Path

import jax


def parse_window(text: str) -> tuple[int, int] | None:
    """config.profile_steps "A:B" -> (A, B), steps A..B-1; "" -> None (config validates it)."""
    if not text:
        return None
    a, _, b = text.partition(":")
    return int(a), int(b)


class Profiler:
    """Starts jax.profiler before step A and stops it after step B-1 (or at close)."""

    def __init__(self, window: str, directory: Path, log=print):
        self.window = parse_window(window)
        self.directory, self.log, self.active = Path(directory), log, False

    def before(self, step: int) -> bool:
        """Before step `step` is dispatched; True when the trace started now."""
        if self.window and step == self.window[0]:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True
            return True
        return False

    def after(self, step: int, result=None) -> bool:
        """After step `step` was dispatched; `result` is waited for before the trace stops.
        True when it stopped now."""
        if self.active and step == self.window[1] - 1:
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
            self.log(f"profile of steps {self.window[0]}..{self.window[1] - 1} in {self.directory}")
