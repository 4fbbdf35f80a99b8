"""Whether every process of a job sees, and could read, the same checkpoints.

`check_shared`: each process writes its shards of every save into one directory and
orbax's commit waits for all of them, so a run_dir that is not shared storage (each node
its own local disk) hung the first save, past every timeout; it is refused at start.

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

import itertools
import socket
import time
import uuid
from pathlib import Path

import jax

from hetjax.errors import ConfigError, HetjaxError

NOTE_PREFIX = "unreadable-by-process-"  # + index + ".txt", in the step's own directory


_checks = itertools.count()  # every process checks its directories in the same order
SEE_S = 10.0  # how long a process looks for process 0's file (a network filesystem's lag)


def check_shared(directory: Path, timeout_s: float) -> None:
    """Raises ConfigError unless every process of this jax.distributed world sees the file
    process 0 writes in `directory` (before anything compiles); a process that does not
    answer within `timeout_s` is named."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the world's client: no public handle to its store
    client, me, n = distributed.global_state.client, jax.process_index(), jax.process_count()
    key, ms = f"hetjax/shared/{next(_checks)}", int(timeout_s * 1000)
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    fix = ("put config.run_dir (or config.checkpoint.dir) on storage that every node mounts at the "
           "same path (NFS, Lustre, a bucket's FUSE mount): each process writes its shards of every "
           "checkpoint there, and a save waits for all of them")
    try:
        if me == 0:
            token = directory / f".hetjax-shared-{uuid.uuid4().hex}"
            token.write_text(socket.gethostname())
            client.key_value_set(f"{key}/token", f"{token.name}\n{directory}")
            try:
                verdicts = [client.blocking_key_value_get(f"{key}/seen/{p}", ms) for p in range(1, n)]
            finally:
                token.unlink(missing_ok=True)
            if blind := [f"process {p} ({v[2:]})" for p, v in enumerate(verdicts, 1) if v.startswith("0")]:
                raise ConfigError(f"checkpoint directory {directory}: {', '.join(blind)} does not see the file process 0 "
                                  f"({socket.gethostname()}) wrote there: it is not one directory shared by every "
                                  f"process; {fix}")
            return
        name, theirs = client.blocking_key_value_get(f"{key}/token", ms).split("\n", 1)
        deadline = time.monotonic() + SEE_S
        while not (seen := (directory / name).exists()) and time.monotonic() < deadline:
            time.sleep(0.2)
        client.key_value_set(f"{key}/seen/{me}", f"{int(seen)}:{socket.gethostname()}")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the store's timeout: a process did not get this far
        raise HetjaxError(f"checking that checkpoint directory {directory} is shared: a process of the job did "
                          f"not answer within {timeout_s:g} s ({e})") from None
    if not seen:
        raise ConfigError(f"checkpoint directory {directory} is not the one process 0 uses ({theirs}) on shared "
                          f"storage: this process ({socket.gethostname()}) does not see the file process 0 wrote "
                          f"there; {fix}")


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
