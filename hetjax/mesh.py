"""The named device mesh of one island: axes `pipeline`, `data`, `fsdp`, `tensor`.

Axis types are Auto on purpose: models constrain parameters and activations at
logical boundaries (hetjax.sharding.constrain) and XLA's sharding propagation
fills in the rest. Explicit axes (jax.make_mesh's default since 0.10) would make
every indexing op in model code carry an out_sharding, i.e. know the mesh.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from hetjax.errors import ConfigError

MESH_AXES = ("pipeline", "data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the named mesh axes; one of them may be -1 (all remaining devices)."""

    pipeline: int = 1
    data: int = 1
    fsdp: int = -1
    tensor: int = 1


def validate_mesh(mesh: MeshConfig) -> None:
    """Raises ConfigError for sizes no device count can satisfy."""
    sizes = [getattr(mesh, a) for a in MESH_AXES]
    if sum(s == -1 for s in sizes) > 1:
        raise ConfigError(f"config.mesh={mesh}: at most one axis may be -1")
    for axis, size in zip(MESH_AXES, sizes):
        if size == 0 or size < -1:
            raise ConfigError(f"config.mesh.{axis}={size}: use a positive size, or -1 for the remaining devices")


def resolve_shape(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Axis sizes with -1 replaced; raises if they do not multiply to num_devices."""
    sizes = {a: getattr(mesh_cfg, a) for a in MESH_AXES}
    known = math.prod(s for s in sizes.values() if s != -1)
    wild = [a for a, s in sizes.items() if s == -1]
    if wild:
        if num_devices % known:
            raise ConfigError(
                f"config.mesh: the fixed axes multiply to {known}, which does not divide the "
                f"{num_devices} devices, so config.mesh.{wild[0]}=-1 cannot take the rest")
        sizes[wild[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        shape = ",".join(f"{a}={s}" for a, s in sizes.items())
        raise ConfigError(
            f"config.mesh ({shape}) has {math.prod(sizes.values())} devices but {num_devices} are "
            f"available; make the sizes multiply to {num_devices}, or set one axis to -1")
    return sizes


def make_mesh(mesh_cfg: MeshConfig, devices=None) -> Mesh:
    """Builds the island's Mesh over `devices` (default: all of jax.devices())."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_shape(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    if len(devices) == len(jax.devices()):
        # Lets jax order devices for the interconnect (e.g. tensor within a node).
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    else:
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    return " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
