"""The tiny model over two islands on two XLA backends of one machine: its GPU (CUDA)
holds the first layer and embedding, its CPU the second layer and the loss (pipeline
placement). Two compilers and two runtimes train one model: the closest stand-in for a
CUDA + ROCm job that a single-GPU machine offers.

    python -m launch.local --config configs/gpu_cpu_hetero.py [--backend host|direct]

Both islands run the deterministic profile. For losses within the platforms tolerance of
the one-island run on CPU, export JAX_DEFAULT_MATMUL_PRECISION=highest first (a GPU would
otherwise multiply fp32 in TF32); bench/gpu_checks.sh does both:

    python -m hetjax.train --config configs/gpu_cpu_hetero.py --config.hetero.islands='()' \\
        --config.mesh.pipeline=2 --config.sharding.max_replicated_fraction=1 \\
        --config.compile.platform=cpu   # with JAX_PLATFORMS=cpu and 2 virtual CPU devices
"""

import dataclasses

from hetjax.config import HeteroConfig, IslandConfig, MeshConfig, PipelineConfig
from hetjax.configs import tiny


def get_config():
    cfg = tiny.get_config()
    islands = (
        IslandConfig(name="gpu", platform="cuda", devices_per_process=1, mesh=MeshConfig(fsdp=1)),
        IslandConfig(name="cpu", platform="cpu", devices_per_process=1, mesh=MeshConfig(fsdp=1)),
    )
    return dataclasses.replace(
        cfg, name="gpu_cpu_hetero", steps=40, log_every=5, eval_every=0,
        compile=dataclasses.replace(cfg.compile, deterministic=True),
        hetero=HeteroConfig(islands=islands, placement="pipeline"),
        pipeline=PipelineConfig(schedule="1f1b", microbatches=4), run_dir="runs/gpu_cpu_hetero")
