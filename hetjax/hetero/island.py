"""One island of a job: its mesh, its part of the model and the optimizer, and how
any island's arrays are laid out, so that an island can plan a transfer to a peer
whose devices it cannot see.

Pipeline placement: island k holds the contiguous layers [start, stop) of the
stacked blocks (with config.pipeline.virtual_stages = V > 1: the V chunks v*n + k of
n*V equal ones, one after the other, so that a micro-batch goes round the islands V
times), plus the embedding if it is the first island and the final norm
and the head if it is the last (a tied embedding sits on both and its gradients
are added across them). The leaves an island does not use are one-element
placeholders, so every island's parameter tree has the model's structure (the
stage functions of hetjax.pipeline.stages merge it with the model's graphdef)
and no island spends memory or optimizer work on weights it never touches.
Placeholders have one element, replicated: orbax refuses to save empty arrays.

Data placement: every island holds the whole model (in its own pipeline layout
when its mesh has pipeline > 1, split evenly) and rows [first, first + n) of
each global batch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hetjax import checkpoint_init, memory, optim, program, repro, sharding
from hetjax import state as state_lib
from hetjax.config import Config
from hetjax.errors import ConfigError
from hetjax.hetero.config import IslandConfig
from hetjax.mesh import MESH_AXES
from hetjax.hetero import placement
from hetjax.hetero import timeline as timeline_lib
from hetjax.profiler import parse_window
from hetjax.mesh import resolve_shape
from hetjax.pipeline.config import virtual_stages
from hetjax.pipeline.spmd import Plan
from hetjax.pipeline.stages import chunk_of, permute_layers, to_stages
from hetjax.transfer.plan import Layout
from hetjax.models.llama import BLOCKS, EMBED, HEAD

ACTIVATION = ("batch", "length", "embed")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """An island's mesh without devices: enough to describe its arrays' layouts."""

    spec: IslandConfig
    shape: tuple[int, ...]  # mesh axis sizes, in MESH_AXES order
    processes: tuple[int, ...]  # the process of each mesh position (row-major)

    @classmethod
    def of(cls, spec: IslandConfig, virtual: bool) -> "Geometry":
        devices = spec.devices
        sizes = resolve_shape(spec.mesh, devices)
        # Devices are laid out in (process, local id) order: position i is on process
        # i // devices_per_process, which a peer can compute from the config alone.
        processes = (0,) * devices if virtual else tuple(i // spec.devices_per_process for i in range(devices))
        return cls(spec, tuple(sizes[a] for a in MESH_AXES), processes)

    def layout(self, spec: PartitionSpec) -> Layout:
        entries = tuple(tuple(e) if isinstance(e, (tuple, list)) else e for e in spec)
        return Layout(self.shape, MESH_AXES, self.processes, entries)

    def abstract_mesh(self):
        return jax.sharding.AbstractMesh(self.shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def geometry(cfg, k: int) -> Geometry:
    """Island k's Geometry, from the config alone."""
    return Geometry.of(cfg.hetero.islands[k], cfg.hetero.virtual)


def put(value, mesh: Mesh) -> jax.Array:
    """A small host value as an array replicated over `mesh`; every process of the
    island holds the same value (jax.device_put of a local array cannot span processes)."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, PartitionSpec()),
                                        lambda index: host[index])


def make_mesh(geometry: Geometry, devices) -> Mesh:
    """The island's Mesh over `devices`, in the (process, id) order Geometry assumes."""
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.asarray(devices).reshape(geometry.shape), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))
    got = tuple(int(d.process_index) for d in mesh.devices.flat)
    assert len(set(got)) == len(set(geometry.processes)), (got, geometry.processes)
    return mesh


def island_config(cfg, k: int):
    """The job's config as island k sees it: its own mesh and platform; no gradient
    clipping inside the optimizer, because the norm is the whole job's (hetero.update)."""
    spec = cfg.hetero.islands[k]
    out = dataclasses.replace(cfg, mesh=spec.mesh, optim=dataclasses.replace(cfg.optim, grad_clip_norm=0.0),
                              compile=dataclasses.replace(cfg.compile, platform=spec.platform))
    if cfg.hetero.placement == "data":
        out = dataclasses.replace(out, batch_size=placement.batch_shares(cfg)[k][1])
    return out


# ---------------------------------------------------------------------------
# Which parameters an island holds (pipeline placement).


def top_name(path) -> str:
    """The top-level parameter name of a key path (blocks, embed_VD, ...)."""
    key = path[0]
    return str(getattr(key, "key", getattr(key, "name", key)))


def uses(name: str, k: int, n: int, tied: bool) -> bool:
    """Does island k of n (pipeline placement) use the non-block parameter `name`?"""
    if name == EMBED:
        return k == 0 or (tied and k == n - 1)
    if name in HEAD:
        return k == n - 1
    raise AssertionError(f"unknown top-level parameter {name!r}")


def holders(name: str, n: int, tied: bool) -> list[int]:
    return [k for k in range(n) if uses(name, k, n, tied)]


def chunks_of(cfg, k: int, layers: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """The model layers island k holds, as [start, stop) ranges in its storage order:
    `layers` (its share) when V = config.pipeline.virtual_stages is 1, else its V
    chunks v*n + k (virtual stage v*n + k) of n*V equal ones."""
    n = len(cfg.hetero.islands)
    V = virtual_stages(cfg, n)
    if V == 1:
        return (tuple(layers),)
    size = cfg.model.num_layers // (n * V)
    return tuple(((v * n + k) * size, (v * n + k + 1) * size) for v in range(V))


def held_layers(cfg, split) -> list[tuple[tuple[int, int], ...]]:
    """Every island's held layers (chunks_of), given the layers per island `split`
    (hetjax.hetero.placement.island_layers): island k's share is the k-th run of them."""
    bounds = np.concatenate([[0], np.cumsum(split)])
    return [chunks_of(cfg, k, (int(bounds[k]), int(bounds[k + 1]))) for k in range(len(split))]


def layer_index(chunks: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The model layers held, one per stored layer: stages.permute_layers with it takes
    an island's layers out of model-layout blocks; with its argsort, concatenated
    islands' layers back to the model's order."""
    return np.concatenate([np.arange(a, b) for a, b in chunks])


def part(params, k: int, n: int, chunks: tuple[tuple[int, int], ...], tied: bool):
    """Island k's part of model-layout params: its layers (`chunks`, see chunks_of), and
    one-element placeholders for the non-block leaves it does not use (orbax saves no
    empty arrays)."""
    # One run of layers is a slice, not a gather.
    held = permute_layers(params, slice(*chunks[0]) if len(chunks) == 1 else layer_index(chunks))

    def other(path, x):
        return x if uses(top_name(path), k, n, tied) else jnp.zeros((1,) * x.ndim, x.dtype)

    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if top_name(p) == BLOCKS else other(p, x), held)


def counts(name: str, k: int, n: int, tied: bool) -> bool:
    """Does island k count the top-level parameter `name` in job-wide sums (the gradient
    norm, the parameter fingerprint)? Its blocks always; a shared leaf on its first holder."""
    return name == BLOCKS or holders(name, n, tied)[0] == k


def owned(params, k: int, n: int, tied: bool):
    """A mask tree: True where island k counts the leaf (see counts)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: counts(top_name(p), k, n, tied), params)


def shared(params, n: int, tied: bool) -> list[str]:
    """The top-level names of leaves that several islands hold (a tied embedding)."""
    names = {top_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]} - {BLOCKS}
    return sorted(name for name in names if len(holders(name, n, tied)) > 1)


# ---------------------------------------------------------------------------
# An island's whole setup.


@dataclasses.dataclass(frozen=True)
class Island:
    """Island `index` of the job, fully built: config, geometry, mesh, rules, optimizer
    and its part's abstract state and shardings (see build)."""

    cfg: Config  # the job's config
    index: int
    geometry: Geometry
    mesh: Mesh
    icfg: Config  # island_config(cfg, index)
    rules: tuple
    tx: optax.GradientTransformation
    graphdef: nnx.GraphDef
    abstract: state_lib.TrainState  # of ShapeDtypeStructs: the island's part
    shardings: state_lib.TrainState  # of NamedShardings
    batch_shardings: dict[str, NamedSharding]
    memory: memory.Estimate  # what the island's part needs per device
    timeline: timeline_lib.Timeline  # where its programs' dispatch time goes
    # Pipeline placement: the model layers held, in storage order (chunks_of); () for data
    # placement. (A speed-proportional share is what it holds only when virtual_stages is 1.)
    chunks: tuple[tuple[int, int], ...] = ()
    rows: tuple[int, int] | None = None  # data placement
    plan: Plan | None = None  # the island's own pipeline (data placement, mesh.pipeline > 1)

    @property
    def name(self) -> str:
        return self.geometry.spec.name

    @property
    def count(self) -> int:
        return len(self.cfg.hetero.islands)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def describe(self) -> str:
        where = ("layers " + ", ".join(f"{a}..{b - 1}" for a, b in self.chunks) if self.chunks
                 else f"rows {self.rows[0]}..{sum(self.rows) - 1} of each batch")
        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
        spec = self.geometry.spec
        return (f"island {self.name} ({spec.platform}, {spec.num_processes} x {spec.devices_per_process} "
                f"{self.mesh.devices.flat[0].device_kind}): mesh {mesh}; {where}; needs "
                f"{self.memory.describe()}")

    def program(self, fn, name: str):
        """fn (a jitted program) as this island calls it, its dispatch timed as `name`. On
        CPU, an island of several processes runs each program to completion before the
        next: the CPU runtime may run independent programs concurrently, and two processes
        starting their gloo collectives in different orders would mismatch (GPUs order
        them on a stream)."""
        if self.geometry.spec.num_processes > 1 and self.mesh.devices.flat[0].platform == "cpu":
            fn = lambda *args, f=fn: jax.block_until_ready(f(*args))  # noqa: E731
        return self.timeline.program(name, fn)

    def compile(self, fn, *abstract_args, name: str = "", **jit_kwargs):
        """fn jitted, lowered for abstract arguments and compiled now, before the job's first
        exchange (a peer never waits mid-step on this island's compiler), as program() calls it."""
        return self.program(self.compiled(fn, *abstract_args, **jit_kwargs), name or fn.__name__)

    @staticmethod
    def compiled(fn, *abstract_args, **jit_kwargs) -> jax.stages.Compiled:
        """compile()'s executable itself, for a caller that needs its output shapes first."""
        return jax.jit(fn, **jit_kwargs).lower(*abstract_args).compile()

    def put(self, value) -> jax.Array:
        return put(value, self.mesh)

    def like(self, shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or self.replicated())

    def abstract_batch(self) -> dict:
        return program.abstract_batch(self.icfg.batch_size, self.cfg.seq_len, self.batch_shardings)

    def activation_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, sharding.spec_for(ACTIVATION, self.rules))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def create_state(self) -> state_lib.TrainState:
        """The island's part of the same initial weights a one-island run starts from."""
        return jax.jit(lambda: _init_part(self.cfg, self.tx, self.index, self.chunks or None, self.plan),
                       out_shardings=self.shardings)()

    def init_from(self, path: str) -> state_lib.TrainState:
        """The island's part of saved weights (config.init_from: a one-island run's
        checkpoint or an imported Hugging Face model), with a fresh optimizer."""
        _, whole = state_lib.abstract_state(self.cfg.model, self.cfg.seed, self.tx)
        shardings = state_lib.state_shardings(whole.params, self.mesh, self.rules)
        params = checkpoint_init.load_params(path, whole.params, shardings, model=self.cfg.model)
        params = jax.jit(lambda p: _part_of(self.cfg, self.index, self.chunks or None, self.plan, p),
                         out_shardings=self.shardings.params)(params)
        return checkpoint_init.fresh_state(params, self.tx, self.shardings)


    def fingerprint(self, params):
        """hetjax.repro's fingerprint of (a subset of) this island's parameters, its layers
        numbered as the model's (pipeline placement)."""
        if len(self.chunks) == 1:
            return repro.param_fingerprint(params, layer_offset=self.chunks[0][0])
        total = repro.ParamFingerprint({})
        for v, (start, stop) in enumerate(self.chunks):
            # Chunk v's layers; the other leaves are counted once, with chunk 0.
            chunk = [(p, x) for p, x in nnx.to_flat_state(chunk_of(params, v, stop - start))
                     if v == 0 or p[0] == BLOCKS]
            total = total + repro.param_fingerprint(nnx.from_flat_state(chunk), layer_offset=start)
        return total


def _part_of(cfg, k: int, chunks, plan: Plan | None, params):
    """Island k's part of model-layout params, in its layout (chunks: pipeline placement's)."""
    if chunks is not None:
        return part(params, k, len(cfg.hetero.islands), chunks, cfg.model.tie_embeddings)
    if plan is not None:
        return to_stages(params, plan.layout)
    return params


def _init_part(cfg, tx, k: int, chunks, plan) -> state_lib.TrainState:
    _, params = nnx.split(state_lib.make_model(cfg.model, cfg.seed))
    params = _part_of(cfg, k, chunks, plan, params)
    return state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def build(cfg, k: int, devices, chunks: tuple[tuple[int, int], ...] = ()) -> Island:
    """Island k on `devices` (its mesh); `chunks`: the layers it holds for pipeline
    placement (held_layers).
    Checks that its part splits over its mesh (ConfigError naming the field) and fits
    its devices (DoesNotFit), before anything is allocated."""
    spec = cfg.hetero.islands[k]
    geo = geometry(cfg, k)
    if len(devices) != math.prod(geo.shape):
        raise ConfigError(f"config.hetero.islands[{k}] ({spec.name}) needs {math.prod(geo.shape)} "
                          f"devices but has {len(devices)}")
    mesh = make_mesh(geo, devices)
    icfg = island_config(cfg, k)
    rows = plan = None
    held = sum(b - a for a, b in chunks)
    if chunks:
        rules = cfg.sharding.rules
        dims = {**cfg.model.dims(), "layers": ("hetero.island_layers", held)}
        sharding.check_divisible(dims, rules, mesh, f"config.hetero.islands[{k}].mesh")
        tx = optim.make_optimizer(icfg.optim, cfg.steps)
        graphdef, _ = state_lib.abstract_state(cfg.model, cfg.seed, tx)
        abstract = jax.eval_shape(lambda: _init_part(cfg, tx, k, chunks, None))
        batch_sh = program.batch_shardings(mesh, rules)
        replicated = NamedSharding(mesh, PartitionSpec())
        # Placeholders (and their Adam moments) are replicated scalars.
        shardings = jax.tree.map(lambda x, s: replicated if _placeholder(x) else s,
                                 abstract, state_lib.state_shardings(abstract, mesh, rules))
    else:
        rows = placement.batch_shares(cfg)[k]
        prog = program.build(icfg, mesh)  # the one-mesh program, on the island's share of rows
        if prog.plan is not None and prog.plan.layout.reordered:
            raise ConfigError(
                f"config.hetero.islands[{k}].mesh.pipeline={mesh.shape['pipeline']} with uneven "
                f"config.pipeline.stage_layers or virtual_stages > 1: islands exchange gradients in the "
                f"model's layout, so split the layers evenly inside an island, one chunk per stage")
        rules, tx, graphdef, plan = prog.rules, prog.tx, prog.graphdef, prog.plan
        abstract, shardings, batch_sh = prog.state, prog.state_shardings, prog.batch_shardings
    # The island's part must fit its devices: say what it needs before allocating.
    real = [(p, v) for p, v in nnx.to_flat_state(abstract.params) if not _placeholder(v.get_value())]
    layouts = sharding.param_layouts(nnx.from_flat_state(real), mesh, rules)
    part_cfg = icfg if not chunks else dataclasses.replace(
        icfg, model=dataclasses.replace(cfg.model, num_layers=held))
    estimate = memory.estimate(part_cfg, layouts, mesh)
    try:
        memory.check_fits(part_cfg, estimate, mesh)
    except memory.DoesNotFit as e:
        raise memory.DoesNotFit(f"island {spec.name} (config.hetero.islands[{k}]): {e}") from None
    timeline = timeline_lib.Timeline(spec.name, k, 0 if cfg.hetero.virtual else jax.process_index(),
                                     parse_window(cfg.profile_steps))
    return Island(cfg, k, geo, mesh, icfg, rules, tx, graphdef, abstract, shardings, batch_sh, estimate,
                  timeline, chunks=chunks, rows=rows, plan=plan)


def _placeholder(x) -> bool:
    return x.ndim > 0 and all(d == 1 for d in x.shape)


def remote_layouts(cfg, k: int, tree_specs) -> object:
    """Layouts of island k's arrays, given a tree of their PartitionSpecs."""
    return jax.tree.map(geometry(cfg, k).layout, tree_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def specs(shardings):
    """PartitionSpecs of a tree of NamedShardings (what a peer needs of our layout)."""
    return jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
