"""Llama-3-8B over a real mixed job: one node of 8 x H100 (CUDA) and one of 8 x MI300X
(ROCm), pipeline placement. Each island shards its layers over fsdp (8 devices); the
MI300X island is given more layers because its speed weight is higher (set
config.hetero.auto_split=True to measure both islands and split by that instead).

    python -m launch.local --config configs/llama8b_hetero.py --backend direct   # one machine
    sbatch launch/slurm/hetjob.sbatch                  # an H100 node and an MI300X node
    kubectl apply -f launch/k8s/service.yaml -f launch/k8s/jobset.yaml   # or a JobSet
"""

import dataclasses

from hetjax.config import HeteroConfig, IslandConfig, LinkConfig, MeshConfig, PipelineConfig
from hetjax.configs import llama8b


def get_config():
    cfg = llama8b.get_config()
    islands = (
        IslandConfig(name="h100", platform="cuda", num_processes=1, devices_per_process=8,
                     mesh=MeshConfig(fsdp=8), speed=1.0),
        IslandConfig(name="mi300x", platform="rocm", num_processes=1, devices_per_process=8,
                     mesh=MeshConfig(fsdp=8), speed=1.13),
    )
    link = LinkConfig(backend="direct", timeout_s=300.0)
    return dataclasses.replace(
        cfg, name="llama8b_hetero",
        hetero=HeteroConfig(islands=islands, placement="pipeline", link=link, virtual=False,
                            timeout_s=600.0),
        pipeline=PipelineConfig(schedule="1f1b", microbatches=16),
        run_dir="runs/llama8b_hetero")
