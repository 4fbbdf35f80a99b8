"""Whether a checkpoint fits this config before it is used: its parameters' shapes and its
optimizer state's parts (a mismatch is the config's, a ConfigError that moves nothing),
its arrays' checksums (a mismatch is damage, CorruptCheckpoint), its step against
config.steps, and the kind of job a checkpoint directory belongs to."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from hetjax.checkpoint_config import default_dir, island_folders, step_folders
from hetjax.errors import ConfigError, CorruptCheckpoint
from hetjax.repro.digest import json_checksum, leaf_checksums, path_name


def padded_split(config: dict | None) -> tuple[int, ...] | None:
    """The stage_layers of a config (a checkpoint's saved one, or config.to_dict's) whose
    uneven pipeline split stacks the layers with padding rows (hetjax/pipeline/stages.py);
    None when the stacked rows are the model's layers in order."""
    if not config:
        return None
    split = tuple(config.get("pipeline", {}).get("stage_layers", ()))
    if config.get("mesh", {}).get("pipeline", 1) != 1 and len(set(split)) > 1:
        return split
    return None


def layer_rows(split: tuple[int, ...]) -> np.ndarray:
    """The stacked row that holds each model layer under padded_split's `split`."""
    from hetjax.pipeline.stages import StageLayout
    source = StageLayout(split).source()
    rows = np.empty(sum(split), int)
    rows[source[source >= 0]] = np.flatnonzero(source >= 0)
    return rows


def check_split(saved_config: dict | None, split: tuple[int, ...] | None, where: str, fix: str) -> None:
    """Refuses stacked layers padded by another uneven split than this run's (`split`, None
    for the model's order): (3, 1) and (1, 3) pad to the same shapes, and one would load into
    the other scrambled, with no error."""
    saved = padded_split(saved_config)
    if saved != split:
        raise ConfigError(
            f"{where} holds its layers as " + (f"the uneven pipeline split stage_layers={saved} lays them "
                                              f"out, with padding rows" if saved else "the model orders them")
            + ", and this run needs them " + (f"as stage_layers={split} lays them out" if split else
                                             "in the model's order") + f"; {fix}")


# The model fields that change the function its weights compute but not their shapes.
FUNCTION_FIELDS = ("norm_eps", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_max_length")


def model_differences(saved_config: dict | None, model) -> list[str]:
    """`--config.model.X=V` for each FUNCTION_FIELDS value the checkpoint's model was written
    with that `model` (a ModelConfig) does not have; the scaling's details only where either
    side scales."""
    saved = (saved_config or {}).get("model", {})
    scaling = saved.get("rope_scaling_factor", 1.0) > 1 or model.rope_scaling_factor > 1
    return [f"--config.model.{k}={saved[k]} (this run: {getattr(model, k)})" for k in FUNCTION_FIELDS
            if k in saved and saved[k] != getattr(model, k) and (scaling or not k.startswith("rope_") or
                                                                  k == "rope_theta")]


def check_shapes(saved_tree, abstract, where: str, saved_config: dict | None = None) -> None:
    """Raises ConfigError naming the first parameter whose saved shape differs."""
    saved, wanted = shapes(saved_tree), shapes(abstract)
    hint = ""
    if saved_config and "model" in saved_config:
        hint = f" The checkpoint was written with model config {saved_config['model']}."
    for name in sorted(set(saved) | set(wanted)):
        if name not in saved:
            raise ConfigError(f"{where} has no parameter {name!r}, which config.model asks for "
                              f"(e.g. config.model.tie_embeddings or qkv_bias differ).{hint}")
        if name not in wanted:
            raise ConfigError(f"{where} has a parameter {name!r} that config.model does not have "
                              f"(e.g. config.model.tie_embeddings or qkv_bias differ).{hint}")
        if saved[name] != wanted[name]:
            raise ConfigError(f"{where}: parameter {name!r} has shape {saved[name]} there but "
                              f"{wanted[name]} in this config; set config.model to match the "
                              f"checkpoint.{hint}")


def shapes(tree) -> dict[str, tuple]:
    """Array name -> shape, of arrays, abstract ones, or orbax's saved metadata."""
    return {name: tuple(x.shape) for name, x in _arrays(tree).items()}


def _arrays(tree) -> dict:
    """Array name -> its array, abstract array or orbax metadata."""
    tree = getattr(tree, "tree", tree)  # orbax's TreeMetadata
    return {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape"))[0] if hasattr(x, "shape")}


def saved_dtypes(abstract, saved_tree):
    """`abstract` (ShapeDtypeStructs) with each array's dtype as orbax's metadata says it
    was saved: read so, its checksums can be checked before any cast."""
    saved = {name: x.dtype for name, x in _arrays(saved_tree).items()}
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, saved.get(path_name(p), x.dtype), sharding=x.sharding), abstract)


def export_command(checkpoints="RUN_DIR/checkpoints") -> str:
    """The command that puts an islands job's checkpoints together as a one-mesh one."""
    return f"python -m hetjax.hetero.checkpoints --config ISLANDS_CONFIG --checkpoints={checkpoints} --out=DIR"


def by_islands(saved_config: dict | None) -> dict | None:
    """The hetero settings of the islands job that wrote a checkpoint, or None for a one-mesh job's."""
    h = (saved_config or {}).get("hetero") or {}
    return h if h.get("islands") else None


def check_optimizer(saved_tree, abstract, where: str, saved_config: dict | None = None) -> None:
    """Raises ConfigError when the saved optimizer state has other parts than this config's
    optimizer makes (config.optim changed, e.g. clipping turned on or off): orbax would
    fail to read it, and a sound checkpoint must not pass for a damaged one."""
    saved, wanted = shapes(saved_tree), shapes(abstract)
    if saved == wanted:
        return
    first = sorted(set(saved) ^ set(wanted)) or sorted(k for k in saved if saved[k] != wanted[k])
    if by_islands(saved_config):  # an island's: clipping is the job's
        raise ConfigError(
            f"{where} was written by an island of an islands job, whose optimizer state leaves gradient clipping "
            f"to the job: to resume it on one mesh, export it first ({export_command()}, then "
            f"--config.checkpoint.dir=DIR)")
    was = f" It was written with config.optim {saved_config['optim']}." if saved_config and "optim" in saved_config else ""
    raise ConfigError(
        f"{where}: its optimizer state ({len(saved)} arrays) is not the one this config's optimizer makes "
        f"({len(wanted)} arrays; first difference: {first[0]!r}), so config.optim changed since it was "
        f"written (e.g. grad_clip_norm turned on or off).{was} Set config.optim as it was to resume, or start "
        f"a new run from its weights with --config.init_from and a new config.run_dir.")


def verify(expected: dict[str, str], tree, where: str) -> None:
    """Recomputes the checksums of `tree` and compares them with those saved."""
    if not expected:
        return
    actual = leaf_checksums(tree)
    bad = sorted(k for k in expected if actual.get(k) != expected[k])
    if bad or set(actual) != set(expected):
        raise CorruptCheckpoint(
            f"{where} is damaged: {len(bad)} array(s) differ from the checksums written at save "
            f"time (first: {bad[:3]})")


def verify_json(small, items, where: str) -> None:
    """Checks JSON `items` of a checkpoint (data, config) against the checksums its meta
    holds (checkpoints written before they were kept pass): a damaged data state would
    otherwise resume on other batches, or fail every start the same way."""
    expected = small.meta.get("json_checksums", {})
    bad = [k for k in items if k in expected and json_checksum(small.get(k)) != expected[k]]
    if bad:
        raise CorruptCheckpoint(f"{where} is damaged: its {', '.join(bad)} item(s) differ from the checksums "
                                f"written at save time")


def check_whole_model(saved_config: dict | None, where: str) -> None:
    """Refuses one island's part of an islands job's pipeline (its layers only) where a
    whole model is read (init_from, export)."""
    if (h := by_islands(saved_config)) and h.get("placement", "pipeline") == "pipeline":
        raise ConfigError(
            f"{where} is one island's part of an islands job (its share of the layers): put the islands' "
            f"checkpoints together first, with {export_command()}, and give DIR")


def check_resumable(checkpoints) -> None:
    """Refuses a checkpoint directory of weights only (hetjax.convert's import, an export)
    given as the run's own, before anything compiles or moves: resumed, each step lacks
    the optimizer state and data iterator, and would be set aside as damaged."""
    read = False
    for step in reversed(checkpoints.steps()):  # newest first: a run's own answers at its first readable step
        items = checkpoints.items(step)  # None: unreadable, left to the restore to set aside
        if items is not None and "opt_state" in items:
            return
        read = read or items is not None
    if read:
        raise ConfigError(
            f"config.checkpoint.dir={checkpoints.directory} holds weights only (no optimizer state or data "
            f"iterator: an import or export), not a run's checkpoints to resume; start from it with "
            f"--config.init_from={checkpoints.directory}, and leave config.checkpoint.dir to the run's own")


def check_not_past(cfg, step: int, directory) -> None:
    """Refuses to resume at `step` beyond config.steps: the final save would label step
    `step`'s state as config.steps."""
    if step > cfg.steps:
        raise ConfigError(f"config.steps={cfg.steps}: {directory} already holds step {step}; raise "
                          f"config.steps to train on (config.optim.decay_steps at the run's own steps keeps its "
                          f"learning-rate schedule), or give a new config.run_dir")


def _held_steps(directory: Path) -> list[int]:
    """The checkpoint steps a directory holds, its islands' folders' included."""
    if not directory.is_dir():
        return []
    folders = [directory / name for name in island_folders(directory)]
    return sorted({s for d in [directory, *folders] for s in step_folders(d)})


def check_resume(cfg, log=print) -> list[int]:
    """The checkpoint steps this start resumes from (its checkpoint directory's), checked
    before anything is built against the run's config.json as its last start wrote it:
    a start that looks for its checkpoints elsewhere than that run's config.checkpoint.dir,
    where steps are and here none, is refused (it would start from step 0 and rewrite the
    run's metrics); a resume whose learning-rate schedule changes with config.steps is told so."""
    written, ours = Path(cfg.run_dir) / "config.json", default_dir(cfg)
    held = _held_steps(ours)
    try:
        saved = json.loads(written.read_text())
        saved_dir, optim = saved["checkpoint"].get("dir", ""), saved["optim"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a first start, or no run's config
        return held
    theirs = Path(saved_dir or Path(cfg.run_dir) / "checkpoints")
    if not held and theirs.absolute() != ours.absolute() and (old := _held_steps(theirs)):
        raise ConfigError(
            f"{written} says this run's checkpoints are in {theirs} (steps up to {old[-1]}), but this start "
            f"looks in {ours} (config.checkpoint.dir={cfg.checkpoint.dir!r}), which holds none: it would start "
            f"from step 0 and rewrite the run's metrics; give --config.checkpoint.dir={theirs} to resume, or a "
            f"new config.run_dir")
    was, now = optim.get("decay_steps") or saved.get("steps"), cfg.optim.decay_steps or cfg.steps
    if held and not cfg.optim.decay_steps and isinstance(was, int) and was != now:
        log(f"warning: resuming at step {held[-1]} with config.steps={cfg.steps}: the learning rate's cosine "
            f"now ends at step {now} where this run's ended at {was}, so the rate jumps at the resume; "
            f"--config.optim.decay_steps={was} keeps the run's schedule")
    return held


def check_layout_kind(cfg) -> None:
    """Refuses a job whose checkpoint directory holds another kind of job's checkpoints: a
    one-mesh job's steps where islands would look in one folder per island, or the other
    way round. Neither finds the other's, so the job would start from step 0 and rewrite
    the run's metrics. Only the directory is read: before anything is built."""
    d = default_dir(cfg)
    if not d.is_dir():
        return
    steps = step_folders(d)
    folders = island_folders(d)
    ours = [i.name for i in cfg.hetero.islands]
    if not ours and folders:
        raise ConfigError(
            f"{d} holds an islands job's checkpoints ({', '.join(folders)}), and this config has no "
            f"islands: it would start from step 0 and rewrite the run's metrics. To go on as one mesh, put "
            f"them together first ({export_command(d)}), then train with --config.checkpoint.dir=DIR; or give a new "
            f"config.run_dir")
    if ours and steps:
        raise ConfigError(
            f"{d} holds a one-mesh job's checkpoints (steps {steps}), and this config runs islands: they "
            f"would start from step 0 and rewrite the run's metrics. Start the islands from its weights in "
            f"a new run (--config.init_from={d / str(steps[-1])} --config.run_dir=NEW), or give a new "
            f"config.run_dir")
    if ours and (others := [f for f in folders if f not in ours]):
        raise ConfigError(
            f"{d} holds checkpoints of islands {others}, which config.hetero.islands does not name "
            f"({ours}): this job would not resume them. Name the islands as the job that wrote them did, "
            f"or give a new config.run_dir")
