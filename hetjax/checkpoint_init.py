"""Starting a run from saved weights (config.init_from): where a checkpoint lies in a run
directory, its parameters read into this run's layout (checked to fit it), and a fresh
optimizer around them."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from hetjax import checkpoint
from hetjax.checkpoint_config import island_folders
from hetjax.checkpoint_fit import check_split, check_whole_model, export_command, model_differences
from hetjax.errors import CheckpointError, ConfigError, CorruptCheckpoint
from hetjax.state import TrainState


def find_checkpoint_dir(path: str | Path) -> tuple[Path, int | None]:
    """(manager directory, step or None for the latest) for a run directory, a
    checkpoint directory, or one step directory inside it."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config.init_from={str(path)!r}: no such file or directory")
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
        if not any(p.name.isdigit() for p in path.iterdir()):
            if islands := island_folders(path):
                raise ConfigError(
                    f"{path} holds an islands job's checkpoints, one folder per island ({', '.join(islands)}): "
                    f"put them together first, with {export_command(path)}, and give DIR")
            # (it was refused only after the compile, as "no readable checkpoint")
            raise ConfigError(f"config.init_from={str(path.parent)!r}: {path} holds no checkpoint step (the run "
                              f"saved none, or its steps were set aside as corrupt); give a run that saved one")
        return path, None
    if (path / "params").is_dir() and path.name.isdigit():
        return path.parent, int(path.name)
    if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
        return path, None
    raise ConfigError(
        f"config.init_from={str(path)!r} holds no checkpoint: give a run directory, its "
        f"checkpoints/ directory, one step directory in it, or the output of `python -m hetjax.convert import`")


def _newest_config(manager, step: int | None) -> tuple[int, dict | None] | None:
    """(step, saved config) of the checkpoint load_params reads first: `step`, or the newest
    whose config reads; None if there is none."""
    for s in reversed(manager.steps() if step is None else [step]):
        try:
            return s, manager.read_json(s, "config").get("config")
        except CorruptCheckpoint:
            continue  # load_params reports it and tries an older one
    return None


def saved_config(path: str | Path) -> dict | None:
    """The config saved with the checkpoint load_params would read first (None if none)."""
    directory, step = find_checkpoint_dir(path)
    manager = checkpoint.Manager(directory, read_only=True)
    try:
        found = _newest_config(manager, step)
    finally:
        manager.close()
    return None if found is None else found[1]


def check_params(path: str | Path, abstract_params, log=print, split=None, model=None) -> None:
    """load_params' checks of the checkpoint it would read, from metadata only, so that a
    checkpoint this run cannot use is refused before anything compiles: the split, the
    parameter shapes, and a warning where `model`'s norm or RoPE settings differ."""
    directory, step = find_checkpoint_dir(path)
    manager = checkpoint.Manager(directory, read_only=True)
    try:
        if (found := _newest_config(manager, step)) is not None:
            manager.check_usable(found[0], {"params": abstract_params},
                                 lambda config, where: _check(config, where, split, model, log))
    finally:
        manager.close()


def _check(saved: dict | None, where: str, split, model, log) -> None:
    check_whole_model(saved, f"config.init_from: {where}")
    check_split(saved, split, f"config.init_from: {where}",
                "start from it with that split (config.mesh.pipeline and "
                "config.pipeline.stage_layers), or give a checkpoint in the model's order (python "
                "-m hetjax.convert export, then import, writes one)")
    if model is not None and (differ := model_differences(saved, model)):
        log(f"warning: config.init_from: {where} was written by a model with {', '.join(differ)}: "
            f"these weights now compute another function than the one they were trained for. "
            f"Set those flags to match, unless the change is meant (e.g. a longer context)")


def load_params(path: str | Path, abstract_params, param_shardings, log=print, split=None, model=None):
    """Parameters only, from a checkpoint, laid out by `param_shardings`; verified. `split`:
    the uneven pipeline split whose padded rows `abstract_params` stacks (checkpoint_fit's
    padded_split), None for the model's order; a checkpoint stacked otherwise is refused.
    `model`: the run's ModelConfig, warned about where its norm or RoPE settings differ from
    the checkpoint's (the same weights then compute another function)."""
    directory, step = find_checkpoint_dir(path)
    manager = checkpoint.Manager(directory, read_only=True)
    errors = []
    try:  # closed, so that no orbax thread or logging handler outlives the read
        for s in reversed(manager.steps() if step is None else [step]):
            where = manager.where(s)
            try:
                _check(manager.read_json(s, "config").get("config"), where, split, model, log)
                small, arrays = manager.read(s, {"params": (abstract_params, param_shardings)})
            except CorruptCheckpoint as e:
                log(f"warning: {e}; trying an older one")
                errors.append(str(e))
                continue
            log(f"initialised the parameters from {where} (checksum {checkpoint.params_checksum_of(small.meta)})")
            return arrays.params
    finally:
        manager.close()
    raise CheckpointError(f"config.init_from={str(path)!r}: no readable checkpoint ({errors or 'none found'})")


def fresh_state(params, tx, shardings: TrainState) -> TrainState:
    """Step 0 and a new optimizer state around given parameters (config.init_from)."""
    def init(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    return jax.jit(init, out_shardings=shardings)(params)
