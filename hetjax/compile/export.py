"""Ahead-of-time export of the train and eval steps with `jax.export`, and loading them back.

One CPU machine lowers the steps for platforms it does not have (cuda, rocm, cpu,
or several at once) on a mesh of virtual devices with the configured shardings.
Each artifact is the serialized StableHLO of a step plus a manifest: jax version,
platforms, mesh, every input and output (path, shape, dtype, sharding) and a hash
of the config. `load` refuses an artifact built for another platform, mesh, jax
version or config, before anything runs.

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

FORMAT = 1
MANIFEST = "manifest.json"
STEPS = ("train_step", "eval_step")


def config_hash(cfg) -> str:
    return hashlib.sha256(json.dumps(config_lib.to_dict(cfg), sort_keys=True).encode()).hexdigest()


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
    platforms = tuple(profiles.check_platform(p, "--platforms") for p in platforms)
    prog = program.build(cfg, mesh)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # an export cut short leaves no manifest, so no artifact
    manifest = {"format": FORMAT, "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
                "platforms": list(platforms), "mesh": _mesh_record(mesh), "config_name": cfg.name,
                "config_hash": config_hash(cfg), "config": config_lib.to_dict(cfg), "functions": {}}
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
    return manifest


def check(manifest: dict, cfg, mesh, platform: str | None = None) -> None:
    """Raises ArtifactMismatch unless the artifact fits this jax, platform, mesh and config."""
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
    if manifest["config_hash"] != config_hash(cfg):
        theirs, ours = _dotted(manifest["config"]), _dotted(json.loads(json.dumps(config_lib.to_dict(cfg))))
        diff = [k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
        raise ArtifactMismatch(
            f"artifact exported from a different config (config {manifest['config_name']!r}; fields "
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
        blob = (out / record["file"]).read_bytes()
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
