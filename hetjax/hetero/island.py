"""One island of a job: its mesh, its part of the model and the optimizer, and how
any island's arrays are laid out, so that an island can plan a transfer to a peer
whose devices it cannot see.

Pipeline placement: island k holds the contiguous layers [start, stop) of the
stacked blocks, plus the embedding if it is the first island and the final norm
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
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hetjax import checkpoint, memory, optim, pipeline, sharding, step
from hetjax import state as state_lib
from hetjax.config import MESH_AXES, ConfigError, IslandConfig
from hetjax.hetero import placement
from hetjax.hetero import timeline as timeline_lib
from hetjax.profiler import parse_window
from hetjax.mesh import resolve_shape
from hetjax.pipeline.stages import BLOCKS, to_stages
from hetjax.transfer.plan import Layout

ACTIVATION = ("batch", "length", "embed")
EMBED, HEAD = "embed_VD", ("final_norm", "unembed_DV")


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


def part(params, k: int, n: int, layers: tuple[int, int], tied: bool):
    """Island k's part of model-layout params: its layers, and one-element
    placeholders for the non-block leaves it does not use (orbax saves no empty arrays)."""
    start, stop = layers

    def other(path, x):
        return x if uses(top_name(path), k, n, tied) else jnp.zeros((1,) * x.ndim, x.dtype)

    return jax.tree_util.tree_map_with_path(
        lambda p, x: x[start:stop] if top_name(p) == BLOCKS else other(p, x), params)


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


@dataclasses.dataclass
class Island:
    """Island `index` of the job: config, geometry, mesh, rules and abstract state."""

    cfg: object  # the job's config
    index: int
    geometry: Geometry
    mesh: Mesh
    icfg: object  # island_config(cfg, index)
    rules: tuple
    tx: object
    graphdef: object
    abstract: state_lib.TrainState
    shardings: state_lib.TrainState
    batch_shardings: dict
    layers: tuple[int, int] | None = None  # pipeline placement
    rows: tuple[int, int] | None = None  # data placement
    plan: object = None  # the island's own pipeline (data placement, mesh.pipeline > 1)
    memory: object = None  # hetjax.memory's estimate for the island's part
    timeline: timeline_lib.Timeline | None = None  # where its programs' dispatch time goes

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
        where = (f"layers {self.layers[0]}..{self.layers[1] - 1}" if self.layers is not None
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
        return self.program(jax.jit(fn, **jit_kwargs).lower(*abstract_args).compile(), name or fn.__name__)

    def put(self, value) -> jax.Array:
        return put(value, self.mesh)

    def like(self, shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding or self.replicated())

    def abstract_batch(self) -> dict:
        return step.abstract_batch(self.icfg.batch_size, self.cfg.seq_len, self.batch_shardings)

    def activation_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, sharding.spec_for(ACTIVATION, self.rules))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def create_state(self) -> state_lib.TrainState:
        """The island's part of the same initial weights a one-island run starts from."""
        return jax.jit(self._init, out_shardings=self.shardings)()

    def init_from(self, path: str) -> state_lib.TrainState:
        """The island's part of saved weights (config.init_from: a one-island run's
        checkpoint or an imported Hugging Face model), with a fresh optimizer."""
        _, whole = state_lib.abstract_state(self.cfg.model, self.cfg.seed, self.tx)
        shardings = state_lib.state_shardings(whole.params, self.mesh, self.rules)
        params = checkpoint.load_params(path, whole.params, shardings)
        params = jax.jit(self._part, out_shardings=self.shardings.params)(params)
        return checkpoint.fresh_state(params, self.tx, self.shardings)

    def _part(self, params):
        if self.layers is not None:
            return part(params, self.index, self.count, self.layers, self.cfg.model.tie_embeddings)
        if self.plan is not None:
            return to_stages(params, self.plan.layout)
        return params

    def _init(self):
        _, params = nnx.split(state_lib.make_model(self.cfg.model, self.cfg.seed))
        params = self._part(params)
        return state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                    opt_state=self.tx.init(params))


def build(cfg, k: int, devices, layers: tuple[int, int] | None = None) -> Island:
    """Island k on `devices` (its mesh); `layers`: its range for pipeline placement.
    Checks that its part splits over its mesh (ConfigError naming the field)."""
    spec = cfg.hetero.islands[k]
    geo = geometry(cfg, k)
    if len(devices) != math.prod(geo.shape):
        raise ConfigError(f"config.hetero.islands[{k}] ({spec.name}) needs {math.prod(geo.shape)} "
                          f"devices but has {len(devices)}")
    mesh = make_mesh(geo, devices)
    icfg = island_config(cfg, k)
    tx = optim.make_optimizer(icfg.optim, cfg.steps)
    rows = plan = None
    if layers is not None:
        rules = cfg.sharding.rules
        dims = {**cfg.model.dims(), "layers": ("hetero.island_layers", layers[1] - layers[0])}
        sharding.check_divisible(dims, rules, mesh)
        graphdef, _ = state_lib.abstract_state(cfg.model, cfg.seed, tx)
        island = Island(cfg, k, geo, mesh, icfg, rules, tx, graphdef, None, None,
                        step.batch_shardings(mesh, rules), layers=layers)
        abstract = jax.eval_shape(island._init)
    else:
        rows = placement.batch_shares(cfg)[k]
        plan = pipeline.make_plan(icfg, mesh)
        if plan is not None and plan.layout.padded:
            raise ConfigError(
                f"config.hetero.islands[{k}].mesh.pipeline={mesh.shape['pipeline']} with uneven "
                f"config.pipeline.stage_layers: islands exchange gradients in the model's layout, so "
                f"split the layers evenly inside an island")
        rules = pipeline.rules(icfg, plan)
        sharding.check_divisible(pipeline.dims(icfg, plan), rules, mesh)
        graphdef, abstract = pipeline.abstract_state(icfg, tx, plan)
        island = Island(cfg, k, geo, mesh, icfg, rules, tx, graphdef, None, None,
                        step.batch_shardings(mesh, rules), rows=rows, plan=plan)
    island.abstract = abstract
    island.timeline = timeline_lib.Timeline(spec.name, k, 0 if cfg.hetero.virtual else jax.process_index(),
                                            parse_window(cfg.profile_steps))
    shardings = state_lib.state_shardings(abstract, mesh, island.rules)
    if layers is not None:  # placeholders (and their Adam moments) are replicated scalars
        shardings = jax.tree.map(lambda x, s: island.replicated() if _placeholder(x) else s,
                                 abstract, shardings)
    island.shardings = shardings
    # The island's part must fit its devices: say what it needs before allocating.
    real = [(p, v) for p, v in nnx.to_flat_state(abstract.params) if not _placeholder(v.get_value())]
    layouts = sharding.param_layouts(nnx.from_flat_state(real), mesh, island.rules)
    part_cfg = icfg if layers is None else dataclasses.replace(
        icfg, model=dataclasses.replace(cfg.model, num_layers=layers[1] - layers[0]))
    island.memory = memory.estimate(part_cfg, layouts, mesh)
    try:
        memory.check_fits(part_cfg, island.memory, mesh)
    except memory.DoesNotFit as e:
        raise memory.DoesNotFit(f"island {spec.name} (config.hetero.islands[{k}]): {e}") from None
    return island


def _placeholder(x) -> bool:
    return x.ndim > 0 and all(d == 1 for d in x.shape)


def remote_layouts(cfg, k: int, tree_specs) -> object:
    """Layouts of island k's arrays, given a tree of their PartitionSpecs."""
    return jax.tree.map(geometry(cfg, k).layout, tree_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def specs(shardings):
    """PartitionSpecs of a tree of NamedShardings (what a peer needs of our layout)."""
    return jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
