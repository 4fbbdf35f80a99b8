"""Islands as one more layout of a config (`python -m hetjax.repro check --layouts
"...; islands=2; islands=2,virtual_stages=2"`): the same job split into N virtual
islands, pipeline placement, each island holding one run of layers or V interleaved
chunks."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from hetjax.errors import ConfigError
from hetjax.pipeline.config import PIPELINE_SCHEDULES, VIRTUAL_SCHEDULES

_CONFIG = '''"""{n} virtual islands over {base!r} (written by hetjax.hetero.layouts)."""

import dataclasses

from hetjax.config import load
from hetjax.hetero.config import HeteroConfig, IslandConfig
from hetjax.mesh import MeshConfig


def get_config():
    cfg = load({base!r})
    islands = tuple(IslandConfig(name=f"island{{k}}", devices_per_process={per}, mesh=MeshConfig(fsdp=-1))
                    for k in range({n}))
    schedule = cfg.pipeline.schedule if cfg.pipeline.schedule in {schedules} else "1f1b_fused"
    return dataclasses.replace(
        cfg, mesh=MeshConfig(fsdp=-1), hetero=HeteroConfig(islands=islands, placement="pipeline"),
        pipeline=dataclasses.replace(cfg.pipeline, schedule=schedule, stage_layers=(){virtual}))
'''


@dataclasses.dataclass(frozen=True)
class IslandsLayout:
    overrides: dict
    devices: int
    config: str


def islands_layout(cfg, n: int, config: str, devices: int = 8, virtual: int = 1) -> IslandsLayout:
    """`config` (a config file) as n virtual islands sharing `devices` CPU devices evenly,
    each holding contiguous layers, or with virtual = V > 1 its V interleaved chunks
    (config.pipeline.virtual_stages). The wrapping config file goes to a temporary folder."""
    if virtual < 1 or (virtual > 1 and cfg.model.num_layers % (n * virtual)):
        raise ConfigError(f"--layouts: islands={n},virtual_stages={virtual}: config.model.num_layers="
                          f"{cfg.model.num_layers} must split into {n} x {virtual} equal chunks (V >= 1)")
    if n < 2 or devices % n:
        raise ConfigError(f"--layouts: islands={n}: use at least 2 islands that divide the {devices} devices")
    if cfg.model.num_layers < n:
        raise ConfigError(f"--layouts: islands={n}: config.model.num_layers={cfg.model.num_layers} is fewer "
                          f"than the islands (each holds at least one layer)")
    from hetjax.config import find_config_file
    base = str(find_config_file(config).resolve())
    path = Path(tempfile.mkdtemp(prefix="hetjax-islands-")) / f"islands{n}.py"
    path.write_text(_CONFIG.format(n=n, base=base, per=devices // n,
                                   schedules=PIPELINE_SCHEDULES if virtual == 1 else VIRTUAL_SCHEDULES,
                                   virtual="" if virtual == 1 else f", virtual_stages={virtual}"))
    return IslandsLayout({}, devices, str(path))
