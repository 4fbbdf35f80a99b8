"""A medium model over the two islands of tiny_hetero (a "CUDA" and a "ROCm" island of
2 devices each, pipeline placement): big enough that compute outweighs the traffic
between islands as it does on GPUs (one island's step takes about 0.4 s on 2 CPU cores),
small enough to benchmark on a laptop.

    python -m bench.hetero_vs_homogeneous --config configs/medium_hetero.py
    python -m bench.hetero_vs_homogeneous --config configs/medium_hetero.py --data
"""

import dataclasses

from hetjax.config import ModelConfig, PipelineConfig
from hetjax.configs import tiny_hetero


def get_config():
    cfg = tiny_hetero.get_config()
    model = ModelConfig(vocab_size=256, num_layers=4, embed_dim=256, mlp_dim=768, num_heads=8,
                        num_kv_heads=4, head_dim=32, rope_theta=10_000.0)
    # 8 micro-batches: 1F1B over 2 stages idles (S-1)/(M+S-1) of a step, 1/9 here, 1/5 with 4.
    return dataclasses.replace(cfg, name="medium_hetero", model=model, seq_len=128, steps=100,
                               pipeline=PipelineConfig(schedule="1f1b", microbatches=8),
                               log_every=10, eval_every=50, run_dir="runs/medium_hetero")
