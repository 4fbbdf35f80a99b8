"""Ahead-of-time export of the train and eval steps with `jax.export`, and loading them back.

One CPU machine lowers the steps for platforms it does not have (cuda, rocm, cpu,
or several at once) on a mesh of virtual devices with the configured shardings.
Each artifact is the serialized StableHLO of a step plus a manifest: jax version,
platforms, mesh, every input and output (path, shape, dtype, sharding), the config
and a hash of what of it the program depends on (`program_fields`). `load` refuses an
artifact built for another platform, mesh, jax version or program, before anything runs.

The exported functions take the state as a flat list of arrays: the pytree
structure (TrainState of nnx.State) is rebuilt on load from the config, which the
manifest's config hash and leaf paths pin down, so no custom pytree needs
serializing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax
import jaxlib
from jax import export as jax_export

from hetjax import config as config_lib
from hetjax import program, step
from hetjax.compile import aot, profiles
from hetjax.errors import ArtifactMismatch  # noqa: F401 - raised here, caught by callers
from hetjax.pipeline import config as pipeline_config

FORMAT = 1
MANIFEST = "manifest.json"
STEPS = ("train_step", "eval_step")


# What the exported steps are a function of, as dotted config keys. Everything else may
# change between export and load: run_dir, logging, data, checkpoints, W&B, and the seed
# (the state is initialised outside the artifact). config.mesh is left out for the mesh
# it resolves to, which the manifest records and `check` compares: fsdp=-1 and fsdp=4 on
# 4 devices are one program. config.compile sets the flags XLA compiles the loaded
# StableHLO with on the machine that loads it; it does not change the StableHLO, nor
# does sharding.max_replicated_fraction (a check, not a layout).
PROGRAM_FIELDS = ("model", "optim", "sharding.rules", "sharding.grad_sync", "pipeline", "batch_size", "seq_len")


def program_fields(config: dict) -> dict:
    """The dotted config keys and values (as JSON has them) the exported program depends on."""
    flat = _dotted(json.loads(json.dumps(config)))
    kept = {k: v for k, v in flat.items() if any(k == f or k.startswith(f + ".") for f in PROGRAM_FIELDS)}
    # decay_steps=0: the learning rate's cosine ends at config.steps; the schedule's end either way
    kept["optim.decay_steps"] = flat.get("optim.decay_steps") or flat.get("steps")
    kept.setdefault("sharding.grad_sync", "per_layer")  # what manifests made before it ran
    return kept


def config_hash(cfg, mesh) -> str:
    key = {"config": program_fields(_as_run(cfg, mesh)), "mesh": _mesh_record(mesh)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _as_run(cfg, mesh) -> dict:
    """The config as a dict, with what it leaves automatic (virtual_stages=0) as it runs on mesh."""
    return config_lib.to_dict(pipeline_config.resolve(cfg, mesh.shape["pipeline"]))


def _mesh_record(mesh) -> dict:
    return {"axis_names": list(mesh.axis_names), "shape": dict(mesh.shape), "devices": mesh.size}


def _flat_functions(prog: program.Program):
    """(name -> (jitted flat function, abstract args, input paths, output paths))."""
    mesh = prog.mesh
    state_flat, state_def = jax.tree_util.tree_flatten_with_path(prog.state)
    state_paths = [jax.tree_util.keystr(k) for k, _ in state_flat]
    state_leaves = [leaf for _, leaf in state_flat]
    state_sh = state_def.flatten_up_to(prog.state_shardings)
    params_leaves, params_def = jax.tree.flatten(prog.state.params)
    params_sh = params_def.flatten_up_to(prog.state_shardings.params)
    batch = prog.abstract_batch()
    train, evaluate = prog.train_step_fn(), prog.eval_step_fn()

    def train_flat(leaves, batch):
        new_state, metrics = train(state_def.unflatten(leaves), batch)
        return jax.tree.leaves(new_state), metrics

    def eval_flat(leaves, batch):
        return evaluate(params_def.unflatten(leaves), batch)

    params_paths = [p for p in state_paths if p.startswith(".params")]
    return {
        "train_step": (program.jit_train_step(train_flat, state_sh, prog.batch_shardings, mesh),
                       (aot.abstract(state_leaves, state_sh), batch), state_paths),
        "eval_step": (program.jit_eval_step(eval_flat, params_sh, prog.batch_shardings, mesh),
                      (aot.abstract(params_leaves, params_sh), batch), params_paths),
    }


def _io_records(exported, in_paths, mesh) -> tuple[list, list]:
    batch_paths = [f"batch[{k!r}]" for k in sorted(step.BATCH_KEYS)]  # dicts flatten sorted
    n_out = len(exported.out_avals)
    out_paths = [jax.tree_util.keystr(k) for k, _ in
                 jax.tree_util.tree_flatten_with_path(exported.out_tree.unflatten([0] * n_out))[0]]

    def records(paths, avals, shardings):
        return [{"path": p, "shape": list(a.shape), "dtype": str(a.dtype), "spec": str(tuple(s.spec))}
                for p, a, s in zip(paths, avals, shardings, strict=True)]
    inputs = records(in_paths + batch_paths, exported.in_avals, exported.in_shardings_jax(mesh))
    outputs = records(out_paths, exported.out_avals, exported.out_shardings_jax(mesh))
    return inputs, outputs


def export(cfg, mesh, platforms, out_dir) -> dict:
    """Lowers the train and eval steps for `platforms` and writes them with a manifest."""
    platforms = profiles.check_platforms(platforms, "--platforms")
    prog = program.build(cfg, mesh)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # an export cut short leaves no manifest, so no artifact
    manifest = {"format": FORMAT, "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
                "platforms": list(platforms), "mesh": _mesh_record(mesh), "config_name": cfg.name,
                "config_hash": config_hash(cfg, mesh), "config": _as_run(cfg, mesh), "functions": {}}
    for name, (jitted, args, in_paths) in _flat_functions(prog).items():
        exported = jax_export.export(jitted, platforms=platforms)(*args)
        blob = exported.serialize()
        (out / f"{name}.jax").write_bytes(blob)
        inputs, outputs = _io_records(exported, in_paths, mesh)
        manifest["functions"][name] = {"file": f"{name}.jax", "sha256": hashlib.sha256(blob).hexdigest(),
                                       "inputs": inputs, "outputs": outputs}
    partial = out / f"{MANIFEST}.partial"
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(partial, out / MANIFEST)  # whole or not at all
    return manifest


def read_manifest(out_dir) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise ArtifactMismatch(f"{path}: no manifest; export first with python -m hetjax.compile")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ArtifactMismatch(f"{path}: unreadable manifest ({e}); export again with python -m hetjax.compile") from None
    if not isinstance(manifest, dict):
        raise ArtifactMismatch(f"{path}: not a manifest (no JSON object); export again with python -m hetjax.compile")
    if manifest.get("format") != FORMAT:
        raise ArtifactMismatch(f"{path}: manifest format {manifest.get('format')}, this hetjax reads {FORMAT}")
    # A manifest edited or written by hand: named here rather than as a KeyError in `load`.
    missing = [k for k in ("jax_version", "platforms", "mesh", "config", "functions") if k not in manifest]
    if not missing:
        functions = manifest["functions"]
        missing = [f"functions.{name}" for name in STEPS
                   if not isinstance(functions, dict) or not isinstance(functions.get(name), dict)
                   or not {"file", "sha256"} <= functions[name].keys()]
    if missing:
        raise ArtifactMismatch(f"{path}: the manifest has no {', '.join(missing)} entry; "
                               f"export again with python -m hetjax.compile")
    return manifest


def check(manifest: dict, cfg, mesh, platform: str | None = None) -> None:
    """Raises ArtifactMismatch unless the artifact fits this jax, platform, mesh and the
    config's `program_fields`."""
    platform = platform or jax.export.default_export_platform()  # cuda or rocm, where default_backend() says gpu
    again = "re-export with python -m hetjax.compile for this setup"
    if manifest["jax_version"] != jax.__version__:
        raise ArtifactMismatch(
            f"artifact exported with jax {manifest['jax_version']}, but this is jax {jax.__version__}; {again}")
    if platform not in manifest["platforms"]:
        raise ArtifactMismatch(
            f"artifact exported for platforms {manifest['platforms']}, but this process runs on "
            f"{platform!r}; {again} (e.g. --platforms {platform})")
    if _mesh_record(mesh) != manifest["mesh"]:
        def fmt(m):
            return ",".join(f"{a}={m['shape'][a]}" for a in m["axis_names"])
        raise ArtifactMismatch(
            f"artifact exported for mesh {fmt(manifest['mesh'])}, but config.mesh gives "
            f"{fmt(_mesh_record(mesh))}; {again}")
    # Compared field by field from the manifest's whole config rather than by the stored
    # hash, so that the refusal names the fields and older manifests (whose hash covered
    # the whole config) still load where only logging or paths changed.
    theirs, ours = program_fields(manifest["config"]), program_fields(_as_run(cfg, mesh))
    diff = [k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
    if diff:
        raise ArtifactMismatch(
            f"artifact exported from a different config (config {manifest.get('config_name')!r}; fields "
            f"that differ: {', '.join('config.' + k for k in diff)}); {again}")


def _dotted(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


@dataclasses.dataclass
class Loaded:
    """The exported train and eval steps, called with the usual pytrees."""

    train_step: object  # (TrainState, batch) -> (TrainState, metrics); the state is donated
    eval_step: object  # (params, batch) -> {"loss_sum", "tokens"}
    manifest: dict


def load(out_dir, cfg, mesh, platform: str | None = None) -> Loaded:
    """Reads and checks the artifacts in `out_dir` (see `check`), and returns callables."""
    out = Path(out_dir)
    manifest = read_manifest(out)
    check(manifest, cfg, mesh, platform)
    prog = program.build(cfg, mesh)
    exported = {}
    for name in STEPS:
        record = manifest["functions"][name]
        try:
            blob = (out / record["file"]).read_bytes()
        except OSError as e:
            raise ArtifactMismatch(f"{out / record['file']}: the manifest lists it for {name}, but it cannot be "
                                   f"read ({e.strerror or e}); export again with python -m hetjax.compile") from None
        if hashlib.sha256(blob).hexdigest() != record["sha256"]:
            raise ArtifactMismatch(f"{out / record['file']}: contents do not match the manifest's sha256")
        exported[name] = jax_export.deserialize(bytearray(blob))
    state_def = jax.tree.structure(prog.state)
    params_def = jax.tree.structure(prog.state.params)
    train_call = jax.jit(exported["train_step"].call, donate_argnums=0)
    eval_call = jax.jit(exported["eval_step"].call)

    def train_step(state, batch):
        leaves, metrics = train_call(state_def.flatten_up_to(state), batch)
        return state_def.unflatten(leaves), metrics

    def eval_step(params, batch):
        return eval_call(params_def.flatten_up_to(params), batch)
    return Loaded(train_step, eval_step, manifest)
