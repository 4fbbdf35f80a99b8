"""config.profile_steps=A:B: a jax.profiler trace of steps A..B-1, which TensorBoard's
profile plugin and Perfetto open. Jobs over islands also draw their own timeline of
those steps (hetjax.hetero.timeline)."""

from __future__ import annotations

from pathlib import Path

import jax


class Profiler:
    """Starts jax.profiler before step A and stops it after step B-1 (or at close)."""

    def __init__(self, window: str, directory: Path, log=print):
        a, _, b = window.partition(":")
        self.window = (int(a), int(b)) if window else None
        self.directory, self.log, self.active = Path(directory), log, False

    def before(self, step: int) -> None:
        if self.window and step == self.window[0]:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, result=None) -> None:
        """After step `step` was dispatched; `result` is waited for before the trace stops."""
        if self.active and step == self.window[1] - 1:
            jax.block_until_ready(result)
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.log(f"profile of steps {self.window[0]}..{self.window[1] - 1} in {self.directory}")
