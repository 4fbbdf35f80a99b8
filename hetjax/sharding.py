"""Logical axis names -> mesh axes -> NamedSharding, for parameters and activations.

Models name logical axes only (`embed`, `mlp`, `heads`, ...). A rules table in the
config maps each to mesh axes; changing a sharding experiment means editing the
rules, never the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import threading

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.errors import ConfigError
from hetjax.mesh import MESH_AXES

DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """The rules table and the replication guard (config.sharding)."""

    # Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
    # A mesh axis already used by an earlier dimension of the same array is skipped.
    rules: tuple = DEFAULT_RULES
    # Refuse layouts that leave more than this share of parameter bytes unsplit by
    # any non-`data` mesh axis (only checked when such axes have size > 1).
    max_replicated_fraction: float = 0.1
    # When a batch split over `data` sums its gradients (hetjax.step.make_grad_fn).
    # "per_layer": where XLA puts it, as each layer's gradient is made inside the backward
    # loop, so that it can overlap the next layer's compute where collectives run
    # asynchronously (GPUs). "once": each data shard sums its own and the shards meet once
    # a step, for processes whose collectives block (CPU's gloo) or cross slow links.
    grad_sync: str = "per_layer"


GRAD_SYNCS = ("per_layer", "once")


def mesh_axes(target) -> tuple[str, ...]:
    """A rule's target (None, one mesh axis or several) as a tuple of mesh axes."""
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def without_axis(rules, axis: str) -> tuple:
    """The rules with mesh axis `axis` taken out of every target: the rules of a function
    vmapped over `axis`'s shards (spmd_axis_name), which puts `axis` back itself."""
    out = []
    for name, target in rules:
        kept = tuple(a for a in mesh_axes(target) if a != axis)
        out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
    return tuple(out)


def beside_batch_on_data(rules) -> list:
    """The rules other than `batch`'s that map onto mesh axis `data`."""
    return [rule for rule in rules if rule[0] != "batch" and "data" in mesh_axes(rule[1])]


def _check_grad_sync_once(rules) -> None:
    batch = dict(rules).get("batch")
    if mesh_axes(batch)[:1] != ("data",):
        raise ConfigError(
            f"config.sharding.grad_sync='once' sums the gradients of the batch's shards over `data`, but "
            f"config.sharding.rules maps 'batch' to {batch!r}; map it to `data` first, "
            f"e.g. ('batch', ('data', 'fsdp')), or set config.sharding.grad_sync='per_layer'")
    if others := beside_batch_on_data(rules):
        raise ConfigError(
            f"config.sharding.grad_sync='once' needs `data` to split the batch only (its parameters "
            f"replicated over `data`), but config.sharding.rules maps {others[0]!r} "
            f"onto `data`; take `data` out of that rule or set config.sharding.grad_sync='per_layer'")


def shards(target, sizes) -> int:
    """How many ways a rule's target splits a dimension; `sizes`: mesh axis -> size (a
    Mesh's .shape)."""
    return math.prod(sizes[a] for a in mesh_axes(target))


def validate_sharding(s: ShardingConfig, model_axes) -> None:
    """Raises ConfigError unless the rules name every logical axis of the model
    (`model_axes`, e.g. ModelConfig.dims()) plus batch and length, once, onto mesh axes."""
    if not 0.0 <= s.max_replicated_fraction <= 1.0:
        raise ConfigError(
            f"config.sharding.max_replicated_fraction={s.max_replicated_fraction}: "
            f"must lie in [0, 1]")
    if s.grad_sync not in GRAD_SYNCS:
        raise ConfigError(f"config.sharding.grad_sync={s.grad_sync!r}: use one of {GRAD_SYNCS}")
    names = set()
    for i, rule in enumerate(s.rules):
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(
                f"config.sharding.rules[{i}]={rule!r}: each rule is (logical_axis, mesh_axes), "
                f"e.g. ('mlp', 'tensor') or ('batch', ('data', 'fsdp')) or ('length', None)")
        target = rule[1]
        if not (target is None or isinstance(target, str)
                or (isinstance(target, tuple) and all(isinstance(a, str) for a in target))):
            raise ConfigError(
                f"config.sharding.rules[{i}]={rule!r}: the target must be None, a mesh axis or a tuple of "
                f"mesh axes, e.g. ('mlp', 'tensor') or ('batch', ('data', 'fsdp')) or ('length', None)")
        targets = mesh_axes(target)
        for axis in targets:
            if axis not in MESH_AXES:
                raise ConfigError(
                    f"config.sharding.rules[{i}]={rule!r}: {axis!r} is not a mesh axis; "
                    f"mesh axes are {MESH_AXES}")
        if len(set(targets)) != len(targets):
            twice = next(a for a in targets if targets.count(a) > 1)
            raise ConfigError(f"config.sharding.rules[{i}]={rule!r}: mesh axis {twice!r} is named twice; "
                              f"name each mesh axis once")
        if rule[0] in names:
            raise ConfigError(f"config.sharding.rules: logical axis {rule[0]!r} appears twice")
        names.add(rule[0])
    required = set(model_axes) | {"batch", "length"}
    for name in sorted(names - required):
        close = difflib.get_close_matches(name, required, n=2, cutoff=0.5)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"known: {sorted(required)}"
        raise ConfigError(f"config.sharding.rules: unknown logical axis {name!r}; {hint}")
    if s.grad_sync == "once":
        _check_grad_sync_once(s.rules)
    missing = sorted(required - names)
    if missing:
        raise ConfigError(
            f"config.sharding.rules has no rule for logical axes {missing}; add e.g. "
            f"({missing[0]!r}, None) to replicate")


_active = threading.local()


def spec_for(logical_axes, rules) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry `logical_axes`.

    A mesh axis shards at most one dimension: if an earlier dimension already took
    it, a later one skips it (so `embed -> fsdp` leaves activations, whose `batch`
    took fsdp first, unsplit along embed).
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ConfigError(
                f"logical axis {name!r} has no rule in config.sharding.rules; add "
                f"({name!r}, None) to replicate it, or map it to mesh axes")
        target = table[name]
        axes = mesh_axes(target)
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


@contextlib.contextmanager
def logical_rules(mesh: Mesh, rules):
    """Makes `constrain` active while tracing model code for this mesh and rules."""
    previous = getattr(_active, "value", None)
    _active.value = (mesh, tuple(rules))
    try:
        yield
    finally:
        _active.value = previous


def constrain(x: jax.Array, logical_axes) -> jax.Array:
    """with_sharding_constraint by logical names; a no-op outside `logical_rules`."""
    active = getattr(_active, "value", None)
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(logical_axes, rules)))


def logical_axes(variable: nnx.Variable) -> tuple:
    axes = variable.get_metadata().get("out_sharding")
    assert axes is not None, f"parameter without logical axis names: {variable}"
    return tuple(axes)


def state_shardings(tree, mesh: Mesh, rules):
    """NamedSharding for every Variable in `tree` by its logical axes; any other
    leaf (a step counter, Adam's count) is replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def leaf(x):
        if isinstance(x, nnx.Variable):
            return x.replace(NamedSharding(mesh, spec_for(logical_axes(x), rules)))
        return replicated
    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    path: str
    shape: tuple
    logical: tuple
    spec: PartitionSpec
    bytes: int
    bytes_per_device: int
    split: bool  # divided by some mesh axis of size > 1 (`data` too: ZeRO-3 over data splits it)


def param_layouts(state, mesh: Mesh, rules) -> list[ParamLayout]:
    """One record per parameter: where its dims go and how many bytes each device holds."""
    layouts = []
    for path, v in nnx.to_flat_state(state):
        value = v.get_value()
        name = "/".join(map(str, path))
        logical = logical_axes(v)
        spec = spec_for(logical, rules)
        nbytes = math.prod(value.shape) * np.dtype(value.dtype).itemsize
        divisor, split = 1, False
        for dim, axis_name, axes in zip(value.shape, logical, spec):
            axes, parts = mesh_axes(axes), shards(axes, mesh.shape)
            if dim % parts:
                raise ConfigError(
                    f"parameter {name} {tuple(value.shape)}: its {axis_name!r} dimension of size "
                    f"{dim} cannot be split {parts} ways over mesh axes {axes}; change config.mesh "
                    f"or the rule for {axis_name!r} in config.sharding.rules")
            divisor *= parts
            split |= any(mesh.shape[a] > 1 for a in axes)
        layouts.append(ParamLayout(name, tuple(value.shape), logical, spec, nbytes,
                                   nbytes // divisor, split))
    return layouts


def check_replication(layouts: list[ParamLayout], mesh: Mesh, max_fraction: float) -> float:
    """Refuses a layout that leaves too many parameter bytes unsplit.

    Only meaningful when the mesh has a non-`data` axis larger than 1: pure data
    parallelism replicates every parameter on purpose.
    """
    if all(n == 1 for a, n in mesh.shape.items() if a != "data"):
        return 0.0
    total = sum(l.bytes for l in layouts)
    unsplit = [l for l in layouts if not l.split]
    fraction = sum(l.bytes for l in unsplit) / total
    if fraction > max_fraction:
        worst = ", ".join(l.path for l in sorted(unsplit, key=lambda l: -l.bytes)[:3])
        raise ConfigError(
            f"{fraction:.0%} of parameter bytes would be replicated on every device (largest: "
            f"{worst}), above config.sharding.max_replicated_fraction={max_fraction}; map their "
            f"logical axes to mesh axes in config.sharding.rules, or raise the limit")
    return fraction


def check_divisible(dims: dict[str, tuple[str, int]], rules, mesh, where: str = "config.mesh") -> None:
    """Every model dimension must split evenly over the mesh axes its rule names.

    `dims` maps logical axis -> (config field, size), e.g. ModelConfig.dims(); `mesh` a
    Mesh or its axis sizes, which the config's `where` sets (an island's: its own mesh).
    """
    table, shape = dict(rules), getattr(mesh, "shape", mesh)
    for logical, (field, size) in dims.items():
        axes = mesh_axes(table.get(logical))
        parts = shards(axes, shape)
        if size % parts:
            sizes = ", ".join(f"{where}.{a}={shape[a]}" for a in axes)
            raise ConfigError(
                f"config.{field}={size} does not split over {sizes} (config.sharding.rules maps "
                f"{logical!r} to {axes}); make the mesh axes divide {size}, or map {logical!r} "
                f"to other mesh axes")


def check_microbatch_rows(batch_size: int, microbatches: int, rules, sizes, where: str = "",
                          field: str = "config.pipeline.microbatches") -> None:
    """A micro-batch (batch_size / microbatches rows: a pipeline's, or gradient
    accumulation's with `field`) must split over the mesh axes that `batch` maps to
    (`sizes`: mesh axis -> size, of `where`'s mesh), or every device would compute rows
    of it that others compute too: a ConfigError naming the rows, the axes and the fix,
    before anything compiles."""
    axes = mesh_axes(dict(rules).get("batch"))
    unit, rows = shards(axes, sizes), batch_size // microbatches
    if rows % unit:
        over = " x ".join(axes)
        raise ConfigError(
            f"a micro-batch of config.batch_size/{field} = {batch_size}/{microbatches} = "
            f"{rows} rows does not split over {where}{over} = {unit} devices (config.sharding.rules maps "
            f"'batch' to {axes}); raise config.batch_size or lower {field}")


def check_batch_divisible(batch_size: int, seq_len: int, rules, mesh: Mesh) -> None:
    """The global batch must split evenly over the mesh axes that `batch` maps to, and
    seq_len over those of `length` (the step's input shardings need it): a ConfigError
    naming the sizes, the axes and the nearest valid values, not a JAX IndivisibleError
    once compiling has started. (Micro-batches: check_microbatch_rows.)"""
    table = dict(rules)
    for logical, field, size in (("batch", "batch_size", batch_size), ("length", "seq_len", seq_len)):
        axes = mesh_axes(table.get(logical))
        unit = shards(axes, mesh.shape)
        if size % unit == 0:
            continue
        below, above = size // unit * unit, (size // unit + 1) * unit
        nearest = f"{below} or {above}" if below else f"{above}"
        over = " x ".join(f"config.mesh.{a}={mesh.shape[a]}" for a in axes)
        raise ConfigError(
            f"config.{field}={size} does not split evenly over {over} (config.sharding.rules maps "
            f"{logical!r} to {axes}): it must be a multiple of {unit}; nearest valid values: {nearest}")
