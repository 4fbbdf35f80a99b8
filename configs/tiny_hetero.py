"""The tiny model over two virtual islands, labelled as a CUDA and a ROCm island,
each holding one layer (pipeline placement): the default demo of hetjax's islands.

Run the same job as real processes (one jax.distributed world per island, `host`
transfers over loopback) with `python -m launch.local --config configs/tiny_hetero.py`.
"""

import dataclasses

from hetjax.config import HeteroConfig, IslandConfig, MeshConfig, PipelineConfig
from hetjax.configs import tiny


def get_config():
    cfg = tiny.get_config()
    islands = (
        IslandConfig(name="cuda", platform="cuda", num_processes=1, devices_per_process=2,
                     mesh=MeshConfig(fsdp=2), speed=1.0),
        IslandConfig(name="rocm", platform="rocm", num_processes=1, devices_per_process=2,
                     mesh=MeshConfig(fsdp=2), speed=1.0),
    )
    return dataclasses.replace(
        cfg, name="tiny_hetero", hetero=HeteroConfig(islands=islands, placement="pipeline"),
        pipeline=PipelineConfig(schedule="1f1b", microbatches=4), run_dir="runs/tiny_hetero")
