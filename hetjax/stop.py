"""Stopping a training run on a signal.

SIGTERM (a preemption) and the first Ctrl-C (SIGINT) ask the job to stop: the loop
saves a checkpoint at the next step boundary and exits with 143 or 130 after one
line. A second Ctrl-C exits at once, even while the main thread is inside a long C
call (compiling, a collective, a stuck writer): Python runs its signal handlers only
between bytecodes of the main thread and merges signals that arrive meanwhile, so the
second one is counted by a thread that reads the signal wakeup fd, where every
delivery leaves one byte.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

PREEMPTED = 143  # exit status after SIGTERM: 128 + 15, as if the signal had killed us
INTERRUPTED = 130  # after Ctrl-C: 128 + 2
_AT_ONCE = b"interrupted twice (Ctrl-C): exiting at once; the last completed checkpoint is kept\n"


def end_with_parent(signum: int, parent: int | None = None) -> None:
    """Has Linux send this process `signum` when its parent dies, even of a SIGKILL that
    leaves the parent no chance to stop it (PR_SET_PDEATHSIG; nothing elsewhere). `parent`:
    the pid expected as parent; if it died before the call, the signal is sent at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signum)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signum)


def close_all(*closers) -> None:
    """Calls every closer in order, even when one before it raises, then raises the first
    error: a part that fails to close must not leave a later one (a checkpoint still being
    written, the signal handlers) unclosed."""
    first = None
    for close in closers:
        try:
            close()
        except BaseException as e:  # noqa: BLE001 - raised below, once the rest are closed
            first = first or e
    if first is not None:
        raise first


class Agreement:
    """Whether any process of this jax.distributed world asked to stop. Every process must
    stop at the same step (a save is collective), and a signal reaches them at different
    times; so this is a collective, proposed by every process once per step.

    `propose(requested)` before a step queues the collective behind the steps already
    queued (nothing waits), and `result()` after the step reads it. The result waits only
    for the steps before the proposal, which the loop has waited for already when it
    reads their metrics, so the step just dispatched keeps the device busy meanwhile; a
    blocking allgather before every step left the device idle while the host dispatched
    the next one."""

    def __init__(self, mesh):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P
        self._mesh = mesh
        self._flags = NamedSharding(mesh, P(tuple(mesh.axis_names)))  # one flag per device
        self._any = jax.jit(lambda flags: flags.max(), out_shardings=NamedSharding(mesh, P()))
        self._pending = None
        self._value = False

    def propose(self, requested: bool) -> None:
        import jax
        import numpy as np
        if jax.process_count() == 1:  # nobody to agree with
            self._value = requested
            return
        mine = np.full(len(self._mesh.local_devices), requested, np.int32)
        flags = jax.make_array_from_process_local_data(self._flags, mine, (self._mesh.size,))
        self._pending = self._any(flags)

    def passed_on(self, requested: bool) -> bool:
        """For a loop that must put the decision into the step it dispatches next (islands
        send it to their peers): the last proposal's agreement, then proposes `requested`.
        So with several processes a stop takes one step more; with one, it is `requested`."""
        import jax
        if jax.process_count() == 1:
            return requested
        decided = self.result()
        self.propose(requested)
        return decided

    def result(self) -> bool:
        """Whether any process proposed to stop at the last proposal: the same on every process."""
        if self._pending is not None:
            self._value = bool(self._pending.addressable_data(0))  # replicated: our own copy
            self._pending = None
        return self._value


class StopSignals:
    """SIGTERM/SIGINT handlers for one run: `install()`, `attach(job)` once the job
    exists (a signal before that is passed on then), `close()` to restore."""

    def __init__(self):
        self.received: list[int] = []
        self._job = None
        self._previous: dict = {}
        self._previous_fd = -1
        self._write_fd = None
        self._thread: threading.Thread | None = None

    def install(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only; a library caller's thread keeps its own
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self._previous_fd = signal.set_wakeup_fd(self._write_fd)
        self._thread = threading.Thread(target=self._count_interrupts, args=(read_fd,), daemon=True,
                                        name="hetjax-stop-signals")
        self._thread.start()
        return self

    def attach(self, job) -> None:
        self._job = job
        if self.received:
            job.request_stop()

    def _on_signal(self, sig, _frame) -> None:
        self.received.append(sig)
        if self._job is not None:
            self._job.request_stop()  # with islands: agreed by all at a step boundary

    def _count_interrupts(self, read_fd: int) -> None:
        interrupts = 0
        try:
            while data := os.read(read_fd, 64):
                interrupts += data.count(signal.SIGINT)
                if interrupts >= 2:
                    os.write(2, _AT_ONCE)
                    os._exit(INTERRUPTED)
        finally:
            os.close(read_fd)

    @property
    def interrupted(self) -> bool:
        """The stop was asked by Ctrl-C (not SIGTERM, nor another island)."""
        return bool(self.received) and self.received[0] == signal.SIGINT

    def exit_line(self, step: int, directory) -> tuple[int, str]:
        """(exit status, the one line to print) after saving `step` on a stop."""
        why = "interrupted (Ctrl-C)" if self.interrupted else "preempted (SIGTERM)"
        return (INTERRUPTED if self.interrupted else PREEMPTED), f"{why}: saved step {step} in {directory}"

    def close(self) -> None:
        if self._write_fd is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._write_fd)  # the counting thread reads EOF and ends
        self._write_fd = None
        # Before the interpreter exits: a daemon thread still waking up while it finalizes
        # is unwound by force, which has aborted the process ("exception not rethrown").
        self._thread.join(timeout=5)
