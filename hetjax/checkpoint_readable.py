"""Whether every process of a job could read a checkpoint.

Each process of a multi-process job reads its own shards of a checkpoint, so one of them
can fail (a damaged or missing file) while the others succeed. The others then wait in
orbax's barrier at the end of the read and the one that failed cannot join them, so the
processes cannot agree there; if each went its own way, the job would hang in
mismatched collectives, and every restart would do the same. So:

- a process that failed asks the others through jax.distributed's key-value store
  whether they failed too (`all_failed`). If all did, all set the step aside together
  and try the one before.
- If not within the job's peer timeout, the others read it: the process leaves a note
  (`mark`) and stops the job with an error naming the step. The next start finds the
  note before reading (`marked`), and every process sets the step aside, as for damage.
"""

from __future__ import annotations

from pathlib import Path

import jax

NOTE_PREFIX = "unreadable-by-process-"  # + index + ".txt", in the step's own directory


def all_failed(directory: Path, step: int, timeout_s: float) -> bool:
    """Called by each process that failed to read `step`: True once every process of the
    world said so; False if some did not within `timeout_s` (they read it)."""
    if jax.process_count() == 1:
        return True
    from jax._src import distributed  # the world's client: no public handle to its store
    client = distributed.global_state.client
    key = f"hetjax/unreadable/{directory}/{step}"
    client.key_value_set(f"{key}/{jax.process_index()}", "1")
    try:
        for p in range(jax.process_count()):
            client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000))
    except Exception:  # noqa: BLE001 - the store's timeout: process p is still in orbax's barrier
        return False
    return True


def mark(directory: Path, step: int, error: Exception) -> Path:
    """Leaves a note in step's directory that this process could not read it."""
    note = directory / str(step) / f"{NOTE_PREFIX}{jax.process_index()}.txt"
    note.write_text(f"{error}\n")
    return note


def marked(directory: Path, step: int) -> list[Path]:
    """The notes a previous start left in step's directory (read by every process alike)."""
    return sorted((directory / str(step)).glob(f"{NOTE_PREFIX}*.txt"))
