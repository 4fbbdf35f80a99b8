"""An islands job's checkpoints: one orbax manager per island, and the steps that
count (those every island holds); and the model's train state on the host
(model_state: pipeline placement's parts, parameters and optimizer state, put back
together in the model's layout, or data placement's first island's copy), which
save_state writes as a one-mesh checkpoint that a one-mesh run resumes from and any
layout reads (config.init_from): islands hold their layers in their own order
(interleaved chunks, hetjax.hetero.island.chunks_of), so their checkpoints are not read
as the model's directly, nor with another layer placement (check_placement).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from hetjax import checkpoint, checkpoint_fit, checkpoint_readable, optim
from hetjax.data.pipeline import check_saved_state
from hetjax import state as state_lib
from hetjax.config import to_dict
from hetjax.errors import ConfigError
from hetjax.hetero import island as island_lib
from hetjax.hetero.config import HeteroConfig
from hetjax.hetero.placement import island_layers
from hetjax.pipeline.config import virtual_stages
from hetjax.pipeline.stages import permute_layers


STEPS_SENT = 64  # the newest steps a process or island tells its peers: an older step left out is only never agreed on


def steps_row(steps: list[int], width: int = STEPS_SENT) -> np.ndarray:
    """The newest `width` of `steps` as a fixed-size int32 row, padded with -1 (to exchange)."""
    row = np.full(width, -1, np.int32)
    row[:min(width, len(steps))] = steps[-width:]
    return row


def held_by_all(steps: list[int], rows) -> list[int]:
    """The steps of `steps` that every exchanged row (steps_row) holds too."""
    common = set(steps)
    for row in rows:
        common &= {int(s) for s in row if s >= 0}
    return sorted(common)


def manager(cfg, name: str) -> checkpoint.Manager:
    """Island `name`'s manager: it keeps its last config.checkpoint.keep steps, and also
    every step from the newest one all islands hold (Checkpoints.save raises that)."""
    directory = checkpoint.default_dir(cfg) / name
    checkpoint_readable.check_shared(directory, cfg.hetero.timeout_s)  # among the island's own processes
    return checkpoint.Manager(directory, cfg.checkpoint, keep_from=0,
                              peer_timeout_s=cfg.hetero.timeout_s)


class Checkpoints:
    """One orbax manager per island (run_dir/checkpoints/<island>). A step counts only
    when every island has it: restore picks the newest step all islands can read.

    Islands save asynchronously, each at its own pace, so one island's last `keep`
    steps can all be newer than everything a lagging peer has committed. So with each
    save the islands exchange the steps they have committed, and none deletes the newest
    step that all of them hold, nor any newer one: an island never loses the step to
    resume from. The exchange started at one save is read at the next (read at once it
    could wait a whole step for a peer), and what it reports was committed before the
    save that sent it, so the step kept trails by two saves: an island keeps at least its
    last three checkpoints whatever `keep` says, and more while a peer's saves lag."""

    def __init__(self, job):
        self.job = job
        self.directory = checkpoint.default_dir(job.cfg)
        self._agreed = None  # the exchange of committed steps started at the last save

    def should_save(self, step: int) -> bool:
        return self.job.workers[0].manager.should_save(step)

    def save(self, step: int, states, data_state: dict, config: dict) -> None:
        self.job.read_identical()  # never a checkpoint of islands that have drifted apart
        self._protect()  # before the saves: orbax picks the steps to delete as it takes each one over
        self._agreed = self.job.start_agree_steps(self._committed(), False, f"checkpoint/committed{step}")
        if step >= self.job.cfg.steps or self.job.stop_requested:  # no later save reads it
            self._protect()
        # One island after the other: orbax numbers a process's save operations in one
        # global counter, and two saves started at once from two threads (virtual
        # islands) mix up each other's temporary directories. The saves stay asynchronous.
        for w, state in zip(self.job.workers, states):
            w.manager.save(step, state, data_state, config)

    def _committed(self) -> list[int]:
        """The steps every local island has committed, as every process of the island sees
        them: processes look at the disk at different moments, and each island must tell
        its peers one answer."""
        steps = sorted(set.intersection(*(set(w.manager.committed()) for w in self.job.workers)))
        if jax.process_count() == 1:
            return steps
        from jax.experimental import multihost_utils
        return held_by_all(steps, np.asarray(multihost_utils.process_allgather(steps_row(steps))))

    def _protect(self) -> None:
        """Reads the last exchange of committed steps: every island keeps the newest step
        that all of them hold, and the steps after it."""
        if self._agreed is None:
            return
        common, _ = self._agreed()
        self._agreed = None
        if common:
            for w in self.job.workers:
                w.manager.keep_from(common[-1])

    def wait(self) -> None:
        for w in self.job.workers:
            w.manager.wait()

    def steps(self) -> list[int]:
        return sorted(set.intersection(*(set(w.manager.steps()) for w in self.job.workers)))

    def close(self) -> None:
        for w in self.job.workers:
            w.manager.close()

    def restore_latest(self, abstract_states: list, shardings: list, log=print) -> checkpoint.Restored | None:
        """The newest step every island (also the ones in other processes) holds and can
        read, as a Restored whose state is the local islands' states (laid out by
        `shardings`, one per local island); None if there is none."""
        job = self.job
        unusable = []  # steps set aside because some island could not read them
        while True:
            held = {w.name: w.manager.steps() for w in job.workers}
            common, everyone = job.agree_steps(sorted(self.steps()), any(held.values()))
            if not common:
                # A job killed in its first save: some islands had saved that step, others not.
                # That one step per island is set aside (nothing deleted) and the job starts anew.
                first_save = -job.agreed_min(-max(map(len, held.values())), "checkpoint/count") == 1
                if everyone and first_save and not unusable:
                    for w in job.workers:
                        for first in w.manager.steps():
                            w.manager.move_aside(first, log, why="unfinished (the job's first save, which not "
                                                                 "every island finished)")
                    return None
                if everyone:
                    raise checkpoint.CheckpointError(
                        f"the islands hold checkpoints but no step in common ({held} here); a job "
                        f"resumes all islands at one step, and starting again from step 0 would "
                        f"overwrite them: keep them, and restore a common step or move them away")
                if unusable:  # as Manager.restore_latest: never a quiet start from step 0
                    raise checkpoint.CheckpointError(
                        f"none of the islands' checkpoints could be read (steps {unusable}, each moved to "
                        f"{checkpoint.CORRUPT_DIR}/, nothing deleted, and the warnings above say why): move one "
                        f"back once its cause is mended, or start again to train from step 0")
                return None
            step = common[-1]
            for w in job.workers:  # a newer step that not every island holds was never finished
                for newer in [s for s in w.manager.steps() if s > step]:
                    w.manager.move_aside(newer, log, why="unfinished (not every island saved it)")
            # as saved; None: no process of the island's world can use it (one that alone
            # cannot read it stops the job, and the next start sets the step aside)
            restored, stop = [], None
            for w, a, s in zip(job.workers, abstract_states, shardings, strict=True):
                try:
                    restored.append(w.manager.restore_together(step, a, s, log))
                except checkpoint.CheckpointError as e:  # out of memory, or this process alone failed
                    stop = e
                    restored.append(None)
            # -1 stops every island (each with the cause where it is known), 0 sets the step aside
            verdict = job.agreed_min(-1 if stop else int(all(r is not None for r in restored)), f"restore{step}")
            if verdict < 0:
                raise stop or checkpoint.CheckpointError(
                    f"another island stopped while reading checkpoint step {step} (its log says why); "
                    f"nothing was moved")
            if verdict:
                for w in job.workers:  # every island holds it
                    w.manager.keep_from(step)
                return checkpoint.Restored(step, [r.state for r in restored], restored[0].data_state,
                                           restored[0].meta, restored[0].config)
            unusable.append(step)
            for w in job.workers:  # someone could not read it: set it aside everywhere
                if step in w.manager.steps():
                    w.manager.move_aside(step, log, why="unusable")


def check_placement(cfg, saved: dict | None, where: str) -> None:
    """Raises ConfigError when the config that wrote an islands checkpoint (`saved`, its
    config item) placed the layers otherwise than `cfg`: the islands' parts can have the
    same shapes and hold other layers (virtual_stages 1 and 2 both give island 0 of 2
    two of 4 layers), which neither the shapes nor the checksums would notice. (How many
    layers each island holds, which its speeds or island_layers decide, its callers compare
    with the saved stack itself.)"""
    if not saved or "hetero" not in saved:
        return
    h, theirs = cfg.hetero, saved["hetero"]
    was = theirs.get("placement", "pipeline")
    if was != h.placement:  # data placement's islands each hold the whole model, pipeline's a part
        raise ConfigError(f"{where} was written with config.hetero.placement={was!r} but this config has "
                          f"{h.placement!r}: its islands hold other parts of the model; set it back to {was!r}")
    if h.placement != "pipeline":
        return
    for field, was, now in (
            ("config.hetero.islands (their number)", len(theirs.get("islands", ())), len(h.islands)),
            # Each island's part is kept under its name: islands put in another order would each
            # restore layers they no longer hold (middle islands' parts have the same shapes).
            ("config.hetero.islands (their order)", [i.get("name") for i in theirs.get("islands", ())],
             [i.name for i in h.islands]),
            # 0 (automatic) is 1 on islands (hetjax.pipeline.config.virtual_stages)
            ("config.pipeline.virtual_stages", saved.get("pipeline", {}).get("virtual_stages", 1) or 1,
             virtual_stages(cfg, len(h.islands)))):
        if was != now:
            raise ConfigError(
                f"{where} was written with {field}={was!r} but this config has {now!r}: its islands hold "
                f"other layers than this config places there; set {field} back to {was!r}")


def saved_layers(cfg, name: str) -> int:
    """The layers island `name` holds in its newest readable checkpoint; 0 when it has none.
    auto_split keeps a resumed job's split by it: measured anew at each start, the split
    could differ, and the job's own checkpoints would be refused."""
    directory = checkpoint.default_dir(cfg) / name
    if not directory.is_dir():
        return 0
    manager = checkpoint.Manager(directory, read_only=True)
    try:
        for step in reversed(manager.steps()):
            try:
                return manager.stacked_layers(step) or 0
            except checkpoint.CorruptCheckpoint:  # restore_latest sets it aside; the one before counts
                continue
        return 0
    finally:
        manager.close()


def check_saved_placement(cfg, names, held: dict | None = None, data_fingerprint: str | None = None) -> None:
    """check_placement for every readable checkpoint of the islands `names` in the job's
    checkpoint directory; that the newest is not past config.steps and (given
    `data_fingerprint`) saved the iterator of the same data; and (pipeline placement) that
    island name holds as many layers there as `held[name]` says it will now: the split
    follows the speeds (or auto_split's measurement, taken anew at each start), and a step
    saved under another split would otherwise fail only once every island had compiled,
    blaming config.model. Run before the islands are built. (Unreadable ones are left to restore_latest, which sets them aside.)"""
    saved_layers = {}
    for name in names:
        directory = checkpoint.default_dir(cfg) / name
        if not directory.is_dir():
            continue
        manager = checkpoint.Manager(directory, read_only=True)
        try:
            for step in manager.steps():
                try:
                    saved = manager.read_json(step, "config").get("config")
                    rows = manager.stacked_layers(step)
                except checkpoint.CorruptCheckpoint:
                    continue
                check_placement(cfg, saved, manager.where(step))
                saved_layers[name] = (rows, manager.where(step))
            if steps := manager.steps():
                checkpoint_fit.check_not_past(cfg, steps[-1], directory)
                state = manager.read_json_or_none(steps[-1], "data")
                if data_fingerprint is not None and state is not None:
                    check_saved_state(state, data_fingerprint)
        finally:
            manager.close()
    differ = {n: r for n, (r, _) in saved_layers.items() if held and r is not None and r != held[n]}
    if differ:
        # The whole split only where every island's checkpoint is seen (one process sees its own).
        whole = len(saved_layers) == len(names) == len(held) == len(cfg.hetero.islands)
        split = tuple(saved_layers[n][0] for n in names) if whole else None
        was = f"; it was written with the split {split}, which --config.hetero.island_layers={split} restores" \
            if split else ""
        name = next(iter(differ))
        raise ConfigError(
            f"{saved_layers[name][1]} holds {differ[name]} layers of island {name!r}, which this start places "
            f"{held[name]} layers on (the split follows config.hetero.islands' speeds, or auto_split's measurement "
            f"at each start){was}; set config.hetero.island_layers so"
            f"{' with config.hetero.auto_split=False' if cfg.hetero.auto_split else ''}, or give a new config.run_dir")


def _param_name(path) -> str | None:
    """The parameter a leaf of a train state belongs to (its params, or an optimizer slot
    that mirrors them); None for the others (Adam's step count)."""
    for key in path:
        name = getattr(key, "key", getattr(key, "name", None))
        if name == island_lib.BLOCKS or name == island_lib.EMBED or name in island_lib.HEAD:
            return name
    return None


def model_state(cfg, directory, step: int | None = None, log=print):
    """(step, the model-layout train state as host numpy arrays, the data state) of an
    islands job's checkpoint `step` (default: the newest every island holds) in `directory`
    (its run_dir/checkpoints), read verified onto the CPU: pipeline placement's parts put
    back together, or data placement's first island (each holds the whole model)."""
    h, n, tied = cfg.hetero, len(cfg.hetero.islands), cfg.model.tie_embeddings
    if h.placement == "pipeline" and h.auto_split:
        raise ConfigError("config.hetero.auto_split=True: the islands' layer split is measured when the job "
                          "starts, so this config cannot say which island holds which layers; give the job's "
                          "split as config.hetero.island_layers")
    if h.placement == "data" and h.islands[0].mesh.pipeline != 1:
        raise ConfigError(f"config.hetero.islands[0].mesh.pipeline={h.islands[0].mesh.pipeline}: the first island "
                          f"keeps its layers in its own pipeline's order, which is not put back together here; "
                          f"start a one-mesh run from its parameters with config.init_from instead")
    _, whole = state_lib.abstract_state(cfg.model, cfg.seed, optim.make_optimizer(cfg.optim, cfg.steps))
    itx = optim.make_optimizer(island_lib.island_config(cfg, 0).optim, cfg.steps)
    chunks = island_lib.held_layers(cfg, island_layers(cfg)) if h.placement == "pipeline" else None
    managers = [checkpoint.Manager(Path(directory) / spec.name, read_only=True) for spec in h.islands]
    try:
        common = sorted(set.intersection(*(set(m.steps()) for m in managers)))
        if step is None and not common or step is not None and step not in common:
            raise checkpoint.CheckpointError(f"{directory}: no checkpoint step {step if step is not None else ''} "
                                             f"that every island holds (they hold {common})")
        step = common[-1] if step is None else step
        if chunks is None:  # data placement: the islands agree bit for bit (check_identical)
            manager = managers[0]
            check_placement(cfg, manager.read_json(step, "config").get("config"), manager.where(step))
            joined, data_state = _read_on_cpu(manager, step, whole.params, itx)
            log(f"read island {h.islands[0].name}'s copy of the model from {manager.where(step)}")
            return step, _one_mesh(joined, whole, step), data_state
        parts = []
        for k, manager in enumerate(managers):
            check_placement(cfg, manager.read_json(step, "config").get("config"), manager.where(step))
            if (rows := manager.stacked_layers(step)) != (here := sum(b - a for a, b in chunks[k])):
                raise ConfigError(
                    f"{manager.where(step)} holds {rows} layers of island {h.islands[k].name!r}, and this config "
                    f"places {here} there; give the config that wrote it (its speeds, or its "
                    f"--config.hetero.island_layers)")
            params = jax.eval_shape(lambda p, k=k: island_lib.part(p, k, n, chunks[k], tied), whole.params)
            part, saved_data = _read_on_cpu(manager, step, params, itx)
            parts.append(part)
            if k == 0:  # every island saves the same data state
                data_state = saved_data
            log(f"read island {h.islands[k].name}'s part of {manager.where(step)}")
    finally:
        for manager in managers:
            manager.close()

    def join(path, *held):
        name = _param_name(path)
        if name == island_lib.BLOCKS:  # each island's layers, one island after the other
            return np.concatenate(held)
        # A shared leaf (every holder keeps the same copy), or one every island has (Adam's count).
        return held[0] if name is None else held[island_lib.holders(name, n, tied)[0]]
    joined = permute_layers(jax.tree_util.tree_map_with_path(join, *parts),  # back to the model's order
                            np.argsort(np.concatenate([island_lib.layer_index(c) for c in chunks])))
    return step, _one_mesh(joined, whole, step), data_state


def _read_on_cpu(manager, step: int, params, itx) -> tuple[dict, dict | None]:
    """({"params", "opt_state"} of an island's checkpoint `step` as host numpy arrays, its
    data state); `params` is the abstract tree the island holds, `itx` its optimizer."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])  # a whole model fits no one device
    items = {"params": params, "opt_state": jax.eval_shape(itx.init, params)}
    small, arrays = manager.read(step, {i: (a, jax.tree.map(lambda _: cpu, a)) for i, a in items.items()},
                                 json_items=("data",))
    return {i: jax.tree.map(np.asarray, arrays[i]) for i in items}, small.get("data")


def _one_mesh(joined: dict, whole, step: int):
    """The one-mesh TrainState of model-layout params and an island's optimizer state. The
    islands' optimizer leaves gradient clipping to hetero.update, not to adam: the same
    leaves, in the one-mesh optimizer's structure."""
    leaves, like = jax.tree.leaves(joined["opt_state"]), jax.tree.leaves(whole.opt_state)
    assert [x.shape for x in leaves] == [x.shape for x in like], "optimizer states differ beyond clipping"
    opt_state = jax.tree.unflatten(jax.tree.structure(whole.opt_state), leaves)
    return state_lib.TrainState(step=np.asarray(step, np.int32), params=joined["params"], opt_state=opt_state)


def model_params(cfg, directory, step: int | None = None, log=print):
    """(step, the model-layout parameters: host arrays in the model's nnx.State structure);
    see model_state."""
    step, state, _ = model_state(cfg, directory, step, log)
    return step, state.params


def one_mesh_config(cfg):
    """The config of the islands job's model on one mesh: what a converted checkpoint
    records as the config that wrote it."""
    return dataclasses.replace(cfg, hetero=HeteroConfig(),
                               pipeline=dataclasses.replace(cfg.pipeline, virtual_stages=1))


def save_state(cfg, state, data_state, directory, step: int) -> None:
    """Writes a model-layout train state (model_state) as a one-mesh checkpoint `step` in
    `directory`: a one-mesh run resumes from it (as its checkpoint.dir), and
    config.init_from reads its parameters into any layout."""
    state = jax.device_put(state, jax.devices("cpu")[0])
    # keep_all: the directory may hold steps written before (or a run's checkpoints/), and
    # writing one more must not delete any of them under config.checkpoint.keep.
    manager = checkpoint.Manager(directory, dataclasses.replace(cfg.checkpoint, async_save=False), keep_all=True)
    try:
        manager.save(step, state, data_state or {}, to_dict(one_mesh_config(cfg)))
        manager.wait()
    finally:
        manager.close()


def main(argv=None) -> int:
    """`python -m hetjax.hetero.checkpoints --config CONFIG --checkpoints=RUN_DIR/checkpoints
    --out=DIR [--step=N]`: an islands job's checkpoint (pipeline placement, interleaved or
    not, or data placement) as a one-mesh checkpoint in DIR, optimizer state included:
    `--config.init_from=DIR/N` reads it into any layout, and a one-mesh run with
    `--config.checkpoint.dir=DIR` resumes it.
    The config must place the layers as the one that wrote it (check_placement).

    example:
      python -m hetjax.hetero.checkpoints --config configs/tiny_hetero.py
          --checkpoints=runs/tiny_hetero/checkpoints --out=runs/tiny_hetero/model"""
    import sys

    from hetjax import cli
    from hetjax.config import load, validate

    def run():
        line = cli.parse_command_line(sys.argv[1:] if argv is None else argv, flags=(),
                                      options={"checkpoints": "", "out": "", "step": ""}, doc=main.__doc__)
        cfg = load(line.config, line.overrides)
        validate(cfg)
        opts = line.options
        if not opts["checkpoints"] or not opts["out"]:
            raise ConfigError("--checkpoints and --out are required: the islands job's RUN_DIR/checkpoints "
                              "and a new folder for the one-mesh checkpoint")
        if opts["step"] and not opts["step"].isdigit():
            raise ConfigError(f"--step={opts['step']!r}: give a checkpoint step, a whole number (e.g. "
                              f"--step=2), or leave --step out for the newest step every island holds")
        step, state, data_state = model_state(cfg, opts["checkpoints"], int(opts["step"]) if opts["step"] else None)
        save_state(cfg, state, data_state, opts["out"], step)
        print(f"wrote {Path(opts['out']).absolute() / str(step)} (model layout, optimizer state "
              f"included; --config.init_from reads it, a one-mesh run resumes from it)")
        return 0
    return cli.run_main(run, errors=(checkpoint.CheckpointError,))


if __name__ == "__main__":
    raise SystemExit(main())
