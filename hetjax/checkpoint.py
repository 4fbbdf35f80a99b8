"""Checkpoints: orbax CheckpointManager with async saves, exact resume, resharding restore.

A checkpoint of step s (= optimizer steps taken) is one orbax step directory
`<dir>/<s>/` with these items:

  params     the parameters (orbax PyTree, zarr over OCDBT, one shard per device)
  opt_state  the optimizer state
  data       the data iterator's state, a small JSON dict (the synthetic stream's is
             {"step": s}; a grain iterator's get_state() fits the same slot)
  config     the resolved config that ran
  meta       step, the parameter fingerprint, a checksum of every array and JSON item

Saves are asynchronous: `save` only dispatches the copy of the arrays to host memory
(and their checksums), then orbax writes in a background thread and commits by an
atomic rename, so a process killed mid-save leaves a temporary directory never read.
Restoring targets ShapeDtypeStructs that carry the *current* mesh's shardings, so a
checkpoint written on one layout loads onto another, each device reading its own shard.
Every array and JSON item read is checksummed again against the save's checksums,
which catches damaged files that still decode; a checkpoint that fails to read or
verify is moved aside (never deleted) and the previous one is used.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as keep_policy

from hetjax import checkpoint_copy, checkpoint_readable, orbax_noise, save_failures
from hetjax.checkpoint_fit import check_optimizer, check_shapes, saved_dtypes, shapes, verify, verify_json
from hetjax.compile import aot
from hetjax.checkpoint_config import CORRUPT_DIR, CheckpointConfig, default_dir  # noqa: F401 - used by callers
from hetjax.errors import CheckpointError, ConfigError, CorruptCheckpoint  # noqa: F401 - raised here, caught by callers
from hetjax.models.llama import BLOCKS
from hetjax.state import TrainState
from hetjax.repro.digest import json_checksum, params_checksum



# ---------------------------------------------------------------------------
# The manager.


@dataclasses.dataclass
class Restored:
    step: int
    state: TrainState
    data_state: dict
    meta: dict
    config: dict | None = None  # the config it was written with, as saved beside it


class _LaterJsonHandler(ocp.JsonCheckpointHandler):
    """A JSON item that may be given as a function, called in orbax's writing thread:
    the checkpoint's checksums are finished there, off the training loop's thread, and
    still committed with the step (one atomic rename). Reads as a plain JSON item."""

    async def _save_fn(self, x, directory):
        await super()._save_fn(x() if callable(x) else x, directory)


@ocp.args.register_with_handler(_LaterJsonHandler, for_save=True)
@dataclasses.dataclass
class _LaterJsonSave(ocp.args.JsonSave):
    """JsonSave whose item may be a function of no arguments (see _LaterJsonHandler)."""


@ocp.args.register_with_handler(_LaterJsonHandler, for_restore=True)
@dataclasses.dataclass
class _LaterJsonRestore(ocp.args.JsonRestore):
    pass


# orbax's save blocks for far longer than the copy off the devices (it starts a dozen
# threads and waits for each: 30 ms a save on 2 busy cores), so it runs on this thread, on
# host copies of the state. One per process: orbax numbers a process's saves in one global
# counter, and two saves started at once (virtual islands) mix up their directories.
# While a save may be in flight the loop calls into orbax only for all_steps(), which
# orbax guards with a lock.
_ORBAX = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetjax-checkpoint")


def barriers_without_collectives() -> None:
    """Makes orbax's barriers between processes those of jax.distributed's client; call
    it once a process has joined its world.

    By default they are collectives (sync_global_devices), issued from the checkpoint's
    writer thread while the main thread runs the next step's collectives: on gloo the
    processes then pair them up differently and both wait for good (seen here: a 2-process
    job hung at its first save). The client's barriers are RPCs, which nothing can pair."""
    from absl import flags  # orbax, imported above, defines the flag
    if not flags.FLAGS.is_parsed():  # hetjax parses no absl flags; their defaults stand
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def _json_restore(item: str):
    return _LaterJsonRestore() if item == "meta" else ocp.args.JsonRestore()


def _handlers() -> dict:
    # Named up front so that a fresh process can read metadata before any restore.
    return {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
            **{k: ocp.JsonCheckpointHandler() for k in ("data", "config")}, "meta": _LaterJsonHandler()}


@dataclasses.dataclass
class KeepFrom(keep_policy.PreservationPolicy):
    """Preserves every step from `step` on. An islands job raises it to the newest step
    that every island has committed (hetjax.hetero.checkpoints): an island whose saves
    run ahead must not delete, by keeping its last N, the one step a lagging peer
    also holds, or no step would be common and the job could not resume."""

    step: int

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        return [c.step >= self.step for c in checkpoints]


class Manager:
    """Saves every `cfg.every` steps (and when told to), keeps the last `cfg.keep`
    plus every `cfg.keep_every`-th (and, given `keep_from`, every step from that one
    on: see keep_from()), and restores the latest checkpoint that verifies."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig = CheckpointConfig(),
                 read_only: bool = False, keep_from: int | None = None, keep_all: bool = False,
                 peer_timeout_s: float = 120.0):
        """keep_all: delete no step (a directory that a tool writes into, not a run's own).
        peer_timeout_s: how long a process that cannot read a step waits to hear whether
        the job's other processes could (hetjax/checkpoint_readable.py)."""
        self.directory = Path(directory).absolute()
        self.cfg, self.peer_timeout_s = cfg, peer_timeout_s
        policies = [keep_policy.PreserveAll() if keep_all else keep_policy.LatestN(n=cfg.keep)]
        if cfg.keep_every:
            policies.append(keep_policy.EveryNSteps(cfg.keep_every))
        # orbax reads it in our orbax thread, as it takes a save over (once the previous one
        # finished): keep_from() may raise it any time, and a raised value is a safe one
        self._keep_from = None if keep_from is None else KeepFrom(keep_from)
        if self._keep_from is not None:
            policies.append(self._keep_from)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=None if read_only else keep_policy.AnyPreservationPolicy(policies),
            enable_async_checkpointing=cfg.async_save,
            enable_background_delete=cfg.async_save,  # old steps are deleted off the loop's thread too
            read_only=read_only, create=not read_only,
            # orbax warns on each read-only open that it turns saving off: it is off already
            **({"save_interval_steps": 0} if read_only else {}),
        )
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"cannot use checkpoint directory {self.directory}: {e}; set config.checkpoint.dir "
                f"(or config.run_dir) to a writable directory") from e
        self._pending: int | None = None
        self._reported = False  # a save failure was raised to the caller already
        self._causes = orbax_noise.Reports(self.directory)
        orbax_noise.install()  # before any read fails: wake-ups of orbax's closed loop are diverted
        if not read_only:  # orbax's errors go to a file, its first cause to our error (see save_failures)
            self._causes.start()
        self._handed: concurrent.futures.Future | None = None  # the last save given to it

    def steps(self) -> list[int]:
        """Committed steps, and the one being saved."""
        steps = set(self._manager.all_steps())
        return sorted(steps | {self._pending} if self._pending is not None else steps)

    def committed(self) -> list[int]:
        """The steps whose save is committed (renamed into place), not one in flight."""
        return [s for s in self._manager.all_steps() if (self.directory / str(s)).is_dir()]

    def keep_from(self, step: int) -> None:
        """Keeps every step from `step` on (it only ever rises), from every save whose old
        steps orbax has not picked for deletion yet: saves already handed over included."""
        assert self._keep_from is not None, "a Manager made without keep_from"
        self._keep_from.step = max(self._keep_from.step, step)

    def should_save(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0 and step not in self.steps()

    def save(self, step: int, state: TrainState, data_state: dict, config: dict) -> None:
        """Starts an asynchronous save of `state` as checkpoint `step`; returns once the
        copy to host memory is dispatched (the state may be donated at once). Raises
        CheckpointError if the previous save failed (or this one, when not asynchronous)."""
        self._raise_pending_errors()
        # The copy to host memory and the checksums' hashing, dispatched and not waited for:
        # all the loop spends on a save (hetjax/checkpoint_copy.py).
        host, checksums = checkpoint_copy.start({"params": state.params, "opt_state": state.opt_state})
        previous, self._pending = self._pending, step
        self._handed = _ORBAX.submit(self._orbax_save, step, previous, host, checksums,
                                     dict(data_state), config, time.time())
        if not self.cfg.async_save:
            self.wait()

    def _orbax_save(self, step: int, previous: int | None, host, checksums, data_state, config, started) -> None:
        cwd = os.getcwd()
        def meta() -> dict:  # called in orbax's writing thread, once the hashes are done
            sums = checksums()
            params_hashes = {k.removeprefix("params/"): v for k, v in sums.items() if k.startswith("params/")}
            # cwd: what the config's relative paths (init_from) were relative to, for its readers
            return {"step": step, "params_checksum": params_checksum(host["params"], params_hashes),
                    "checksums": sums, "time": started, "cwd": cwd,
                    "json_checksums": {"data": json_checksum(data_state), "config": json_checksum(config)}}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(host["params"]), opt_state=ocp.args.StandardSave(host["opt_state"]),
            data=ocp.args.JsonSave(data_state), config=ocp.args.JsonSave(config), meta=_LaterJsonSave(meta))
        try:  # the previous save finished first: its failure is that step's
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            raise self._save_error(previous if previous is not None else step, e) from e
        try:
            self._manager.save(step, args=args, force=True)
        except Exception as e:
            raise self._save_error(step, e) from e

    def wait(self) -> None:
        """Blocks until the last save is committed; raises CheckpointError if it failed."""
        self._take_handed()
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            raise self._failed(e) from e
        # Looked up directly: orbax's reload() stats every step directory and fails when its
        # background delete removes an old one meanwhile. orbax renames a step into place last.
        if self._pending is not None and not (self.directory / str(self._pending)).is_dir():
            raise self._failed(RuntimeError("the step directory was not committed"))
        self._pending = None
        self._causes.clear()  # all committed: what orbax logged before is no cause of a later failure

    def _take_handed(self) -> None:
        """Waits for the save handed to our orbax thread; raises what it raised."""
        handed, self._handed = self._handed, None
        if handed is not None:
            try:
                handed.result()
            except CheckpointError:
                self._pending, self._reported = None, True
                raise

    def _raise_pending_errors(self):
        """Raises the failure of the save in flight, if it has failed by now. Waits for the
        previous hand-over to orbax (long done, unless saves come faster than it) so that
        its failure is not lost behind the next one."""
        self._take_handed()
        if self._pending is not None:
            try:
                self._manager.check_for_errors()
            except Exception as e:
                raise self._failed(e) from e

    def _failed(self, error: BaseException) -> CheckpointError:
        """The pending save's failure, to raise now (so close() does not raise it again)."""
        step, self._pending, self._reported = self._pending, None, True
        return self._save_error(step, error)

    def _save_error(self, step, error) -> CheckpointError:
        return save_failures.error(self.directory, step, error, self._causes)

    def close(self) -> None:
        """Waits for the last save and releases orbax; after a save failure was already
        raised, the same failure is not raised again (it would hide the first report)."""
        already = self._reported
        try:
            self.wait()
        except CheckpointError:
            if not already:
                raise
        finally:
            try:
                self._manager.close()  # raises a failed save's error once more
            except Exception as e:
                if not self._reported:
                    raise self._save_error(self._pending, e) from e
            finally:
                self._causes.stop()

    # -- restoring ---------------------------------------------------------

    def restore_latest(self, abstract_state: TrainState, shardings: TrainState,
                       log=print, check=None) -> Restored | None:
        """The newest checkpoint that reads and verifies, laid out by `shardings`;
        None if there is none. Damaged ones are reported and moved to `corrupt/`.
        check(saved config, where): a ConfigError for a checkpoint this run cannot use,
        raised before any of its arrays is read."""
        steps = self.steps()
        for step in reversed(steps):
            if (restored := self.restore_together(step, abstract_state, shardings, log, check)) is not None:
                return restored
            self.move_aside(step, log)
        if steps:  # a run that silently began again from step 0 would look like a resumed one
            raise CheckpointError(
                f"none of the {len(steps)} checkpoints in {self.directory} could be read (steps {steps}; each "
                f"was moved to {self.directory.parent / CORRUPT_DIR}, nothing deleted, and the warnings above "
                f"say why): move one back once its cause is mended, or start again to train from step 0")
        return None

    def restore_together(self, step: int, abstract_state: TrainState, shardings: TrainState,
                         log=print, check=None) -> Restored | None:
        """restore(step) as one of the job's processes: None when no process can use the
        step (every one failed to read it, or the last start left a note that one could not),
        for every process to set it aside; a CheckpointError that stops the job when this
        process alone failed (hetjax/checkpoint_readable.py)."""
        if notes := checkpoint_readable.marked(self.directory, step):  # left by the last start
            log(f"warning: {self.where(step)} could not be read by every process of the last start "
                f"({', '.join(n.name for n in notes)})")
            return None
        try:
            return self.restore(step, abstract_state, shardings, check)
        except CorruptCheckpoint as e:
            log(f"warning: {e}")
            if not checkpoint_readable.all_failed(self.directory, step, self.peer_timeout_s):
                note = checkpoint_readable.mark(self.directory, step, e)
                raise CheckpointError(
                    f"process {jax.process_index()} cannot read {self.where(step)}, which the other "
                    f"processes read, so the job cannot go on together and stops. Start it again: "
                    f"every process then sets this step aside (as {note} says) and resumes from the "
                    f"one before") from None
            return None

    def restore(self, step: int, abstract_state: TrainState, shardings: TrainState, check=None) -> Restored:
        small, arrays = self.read(step, {"params": (abstract_state.params, shardings.params),
                                         "opt_state": (abstract_state.opt_state, shardings.opt_state)},
                                  json_items=("data", "config"), check=check)
        meta = small.meta
        state = TrainState(step=jax.device_put(jnp.asarray(meta["step"], jnp.int32), shardings.step),
                           params=arrays.params, opt_state=arrays.opt_state)
        return Restored(int(meta["step"]), state, small.data, meta, small.config)

    def read_json(self, step: int, *items: str):
        """The JSON items (meta, data, config) of checkpoint `step`, by name."""
        try:
            return self._manager.restore(step, args=ocp.args.Composite(
                **{k: _json_restore(k) for k in items}))
        except Exception as e:
            raise CorruptCheckpoint(f"{self.where(step)} is unreadable ({type(e).__name__}: {e})") from e

    def read(self, step: int, arrays: dict, json_items: tuple[str, ...] = (), check=None):
        """(JSON items, array items) of checkpoint `step`: meta and `json_items`, and
        each array item of `arrays` (name -> (abstract tree, shardings)) laid out by
        its shardings, after check(its saved config, where) (json_items need "config")
        and checking the parameter shapes; the arrays read are checksummed again against
        those written at save time."""
        where = self.where(step)
        small = self.read_json(step, "meta", *json_items)
        verify_json(small, json_items, where)
        saved = self._fits(step, small.get("config"), {k: a for k, (a, _) in arrays.items()}, check)
        wanted = {k: aot.abstract(a, s) for k, (a, s) in arrays.items()}
        try:  # as saved (a bf16 import, a run whose param_dtype changed): its checksums are of those bits
            loaded = self._manager.restore(step, args=ocp.args.Composite(
                **{k: ocp.args.StandardRestore(saved_dtypes(wanted[k], saved[k])) for k in arrays}))
        except Exception as e:
            message = f"{where} is unreadable ({type(e).__name__}: {e})"
            exhausted = isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)
            orbax_noise.close_abandoned_tasks(e)
            del e
            if exhausted:  # not damage: the checkpoint stays where it is
                raise CheckpointError(f"reading {where} ran out of memory ({message}); nothing was moved: "
                                      f"restore onto more devices, or free memory, and start again") from None
            raise CorruptCheckpoint(message) from None
        expected = {k: v for k, v in small.meta.get("checksums", {}).items() if k.split("/")[0] in arrays}
        verify(expected, {k: loaded[k] for k in arrays}, where)
        cast = {k: jax.tree.map(lambda x, w: x if x.dtype == w.dtype else x.astype(w.dtype), loaded[k], wanted[k])
                for k in arrays}
        return small, ocp.args.Composite(**cast)

    def check_usable(self, step: int, arrays: dict, check=None) -> None:
        """read()'s checks that need no array, before anything compiles: check(saved config,
        where) and the saved shapes of `arrays` (name -> abstract tree). A ConfigError for a
        checkpoint this run cannot use; a damaged one passes (read() sets it aside)."""
        try:
            config = self.read_json(step, "config").get("config")
            self._fits(step, config, arrays, check)
        except CorruptCheckpoint:
            pass

    def read_json_or_none(self, step: int, item: str):
        """JSON item `item` of checkpoint `step`, None when it is unreadable (damage that
        read() will find and report)."""
        try:
            return self.read_json(step, item).get(item)
        except CorruptCheckpoint:
            return None

    def _fits(self, step: int, config: dict | None, arrays: dict, check=None) -> dict:
        """The saved metadata of `arrays` (name -> abstract tree), checked against them."""
        where = self.where(step)
        if check is not None:
            check(config, where)
        saved = {k: self._item_metadata(step, k, where) for k in arrays}
        check_shapes(saved["params"], arrays["params"], where, config)
        if "opt_state" in arrays:
            check_optimizer(saved["opt_state"], arrays["opt_state"], where, config)
        return saved

    def stacked_layers(self, step: int) -> int | None:
        """How many layers checkpoint `step` stacks (padding rows included), from its
        metadata only; None when it has no stacked layers."""
        saved = shapes(self._item_metadata(step, "params", self.where(step)))
        return next((int(shape[0]) for name, shape in saved.items() if name.split("/")[0] == BLOCKS), None)

    def where(self, step: int) -> str:
        return f"checkpoint step {step} in {self.directory}"

    def _item_metadata(self, step, item, where):
        try:
            return self._manager.item_metadata(step)[item]
        except Exception as e:
            raise CorruptCheckpoint(f"{where}: cannot read the metadata of {item!r} ({e})") from e

    def items(self, step: int) -> set[str] | None:
        """The items checkpoint `step` holds (params, opt_state, data, ...); None if unreadable."""
        try:
            return set(self._manager.item_metadata(step).keys())
        except Exception:  # noqa: BLE001 - damage, reported where the step is read
            return None

    def move_aside(self, step: int, log, why: str = "damaged") -> None:
        """Moves checkpoint `step` out of the way (into corrupt/, never deleted). Every
        process calls it; process 0 moves once all are done looking at the step (its notes
        too), and all see the change before going on. A step with a process's note that it
        could not read it (checkpoint_readable) is named partly unreadable, whatever `why`."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"hetjax checkpoint {step} to move aside")
        if jax.process_index() == 0:
            if checkpoint_readable.marked(self.directory, step):
                why = "partly unreadable"
            src = self.directory / str(step)
            dst = self.directory.parent / CORRUPT_DIR / f"{self.directory.name}-{step}-{int(time.time())}"
            dst.parent.mkdir(parents=True, exist_ok=True)
            src.rename(dst)
            log(f"warning: moved the {why} checkpoint to {dst} (nothing was deleted)")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"hetjax checkpoint {step} moved aside")
        self._manager.reload()


def params_checksum_of(meta: dict) -> str:
    """A checkpoint's parameter checksum as saved; checkpoints written before the key was
    renamed (0.1.0's first round) keep it as `params_fingerprint`."""
    return meta.get("params_checksum") or meta.get("params_fingerprint") or "not recorded"
