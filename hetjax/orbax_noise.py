"""orbax's repeats of one failure, kept off the console: hetjax reports it once, in one line.

orbax runs each save's or restore's writes or reads as asyncio tasks in an event loop of
its own, and closes that loop as soon as one of them fails. What it leaves behind
reports the same failure about a hundred times over, at any later moment:
  - each of its writing threads logs the error with a traceback (absl ERROR records);
  - the other reads, abandoned pending in the closed loop, each raise the damage again
    when collected ("Exception ignored in: <coroutine _read_array_index_and_device_put>",
    orbax's except-clause catches the GeneratorExit of closing), and their futures log
    "exception was never retrieved";
  - tensorstore operations still in flight then try to wake the closed loop, each one
    printing "RuntimeError: Event loop is closed".
A failed restore's abandoned tasks are closed on the spot (`close_abandoned_tasks`). While
a Manager saves, orbax's error records and the closed-loop wake-ups go to
`<checkpoint dir>.errors.log` (Reports), which the one-line error names; a Manager
closed keeps receiving them for LATE_S more seconds, for the reports that come late. A
report no file took (the disk is full, the directory unwritable) goes to the console.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
import traceback
from pathlib import Path

LATE_S = 60.0  # how long a closed Manager's reports still take orbax's late reports
_open: list["Reports"] = []  # the saving Managers' reports, and those stopped less than LATE_S ago


def _quiet_read_only(record: logging.LogRecord) -> bool:
    # orbax warns on every read-only open that the directory is read only: hetjax asked for it.
    return not str(record.msg).startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_quiet_read_only)


class Reports(logging.Handler):
    """Keeps the first error orbax's background threads log about `directory`, and writes
    every error orbax reports meanwhile, traceback and all, to `path` instead of the console."""

    def __init__(self, directory: Path):
        super().__init__(logging.ERROR)
        self.directory, self._first, self.live, self.stopped = str(directory), None, False, 0.0
        self.path = directory.parent / f"{directory.name}.errors.log"
        self.setFormatter(logging.Formatter("%(asctime)s [%(threadName)s] %(message)s"))

    def emit(self, record) -> None:
        self.keep(record)

    def keep(self, record) -> bool:
        """Notes `record`'s cause and writes it to `path`; False if it could not be written."""
        with self.lock:
            if self._first is None:
                text = record.getMessage()
                if " raised an exception: " in text or self.directory in text:
                    self._first = text.split(" raised an exception: ", 1)[-1]
            return self.write(self.format(record))

    def write(self, text: str) -> bool:
        """Appends `text` to the reports' file; False if it could not (a full disk)."""
        global _unkept
        try:
            with open(self.path, "a") as f:
                f.write(text + "\n")
        except OSError:
            return False
        with _spilling:
            _unkept = 0  # written again: a later failure's first report is shown again
        return True

    def first(self) -> str | None:
        """The first cause orbax logged since the last clear(), or None."""
        return self._first

    def clear(self) -> None:
        self._first = None

    def start(self) -> None:
        """Sends orbax's error reports here (too) from now on."""
        install()
        self.live = True
        _open.append(self)

    def stop(self) -> None:
        """Stops taking reports, but for those that come within LATE_S seconds."""
        self.live, self.stopped = False, time.monotonic()


def _takers() -> list[Reports]:
    now = time.monotonic()
    _open[:] = [r for r in _open if r.live or now - r.stopped < LATE_S]
    return list(_open)


def _to_reports(record: logging.LogRecord) -> bool:
    """A filter on the absl logger, which orbax logs through: its errors go to the
    reports; to the console too when no report could keep them."""
    if record.levelno < logging.ERROR or "orbax" not in record.pathname:
        return True
    takers = _takers()
    if not takers:  # no saving Manager: orbax's errors are the console's, as ever
        return True
    kept = [reports.keep(record) for reports in takers]
    return not any(kept) and _spill(takers)


_unkept = 0  # orbax reports in a row that no file could keep
# orbax's threads report at once: counted without a lock, two could each count itself first
# and both reach the console (seen in CI, 2026-11-29).
_spilling = threading.Lock()


def _spill(takers: list[Reports]) -> bool:
    """Whether a report no file kept goes to the console: the first of a run of them does
    (it holds the cause); then one line says the rest are lost, not ~100 more tracebacks."""
    global _unkept
    with _spilling:
        _unkept += 1
        count = _unkept
    if count == 2:
        where = ", ".join(str(r.path) for r in takers)
        print(f"hetjax: orbax's further reports of this failure are not kept ({where} cannot be written)",
              file=sys.stderr)
    return count == 1


def _wakes_a_closed_loop(unraisable) -> bool:
    """A tensorstore operation, finished after orbax closed its loop, trying to wake it."""
    tb = traceback.extract_tb(unraisable.exc_traceback)
    return (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
            and any(frame.name == "call_soon_threadsafe" for frame in tb))


def _unraisable(hook):
    def divert(unraisable) -> None:
        if not _wakes_a_closed_loop(unraisable):
            return hook(unraisable)
        takers = _takers()  # none (only read-only Managers): dropped, it says nothing new
        text = "".join(traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                                  unraisable.exc_traceback))
        written = [r.write(f"unraisable, an operation finished after orbax closed its event loop:\n{text}")
                   for r in takers]
        if takers and not any(written) and _spill(takers):
            hook(unraisable)
    divert.hetjax_divert = True
    return divert


def install() -> None:
    """Adds the absl filter and the unraisable hook's divert, each unless in place (a
    test runner may put its own hook back at any time)."""
    absl = logging.getLogger("absl")
    if _to_reports not in absl.filters:
        absl.addFilter(_to_reports)
    if not getattr(sys.unraisablehook, "hetjax_divert", False):
        sys.unraisablehook = _unraisable(sys.unraisablehook)


def close_abandoned_tasks(error: BaseException) -> None:
    """After a failed orbax restore (`error`): cancels the tensorstore reads it left in
    flight and closes the tasks it left pending in its closed event loop, so that none
    reports the failure again later; the failure itself is reported once, by the caller."""
    install()  # a read that ends anyway before its cancel still wakes the closed loop
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None  # the repeats raised while closing them
    try:
        traceback.clear_frames(error.__traceback__)
        error.__traceback__ = error.__cause__ = error.__context__ = None
        for obj in gc.get_objects():
            # type(), not isinstance(): the latter asks proxies for __class__ (torch's
            # deprecated aliases warn when asked).
            if issubclass(type(obj), asyncio.Future):
                try:
                    _settle(obj)
                except Exception:  # asyncio's insides changed: only the quiet is lost, never the error
                    pass
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _settle(future: asyncio.Future) -> None:
    """Makes `future`, if orbax left it on its closed loop, report nothing more."""
    if not future.get_loop().is_closed():
        return
    if future.done():
        if not future.cancelled():
            future.exception()  # retrieved: no "exception was never retrieved" when collected
        return
    # Pending on a closed loop: it can never run again. What it waits for (a tensorstore
    # read, linked by its callbacks; CPython keeps them in _callbacks) is cancelled: its
    # wake-up comes now, not at some later moment.
    for entry in getattr(future, "_callbacks", None) or ():
        operation = getattr(entry[0] if isinstance(entry, tuple) else entry, "__self__", None)
        if type(operation).__module__.startswith("tensorstore"):
            operation.cancel()
    coro = future.get_coro() if isinstance(future, asyncio.Task) else None
    if "orbax" not in getattr(getattr(coro, "cr_code", None), "co_filename", ""):
        return  # not one of orbax's tasks: left alone
    future._log_destroy_pending = False  # noqa: SLF001 - asyncio has no public switch
    try:
        coro.close()
    except BaseException:  # orbax's reads raise the damage again when closed
        pass
