"""Pipelined step time against its ideal, measured side by side in one run.

    python -m bench.pipeline_bubble [--stages 2] [--microbatches 8] [--schedule 1f1b]

The baseline is the unpipelined step of the same model and batch on the same
number of devices (fsdp = S), so each device does 1/S of the work, as each stage
does. A perfect pipeline takes that time divided by (1 - predicted bubble). The
baseline uses per-layer full rematerialisation because the pipeline recomputes
each stage's forward in its backward: both run the same FLOPs. Prints
ideal / measured last (1.0 = no overhead beyond the schedule's bubble).
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:
    # One thread per virtual CPU device: otherwise an idle stage lends its cores to
    # the busy one and the bubble cannot be seen.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                               " --xla_cpu_multi_thread_eigen=false").strip()

import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from hetjax import data, pipeline, program  # noqa: E402
from hetjax.config import Config, MeshConfig, ModelConfig, OptimConfig, PipelineConfig, validate  # noqa: E402
from hetjax.mesh import make_mesh  # noqa: E402


def build(cfg, devices):
    mesh = make_mesh(cfg.mesh, devices)
    prog = program.build(cfg, mesh)
    train_step, state = prog.jit_train_step(), prog.init_state()
    batch = data.build(cfg).batch(0, prog.batch_shardings)
    state, metrics = train_step(state, batch)  # compile
    jax.block_until_ready(metrics)
    return train_step, state, batch, prog.plan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=pipeline.KINDS)
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    S, M = args.stages, args.microbatches
    model = ModelConfig(vocab_size=256, num_layers=4 * S, embed_dim=128, mlp_dim=384, num_heads=4,
                        num_kv_heads=2, head_dim=32, rope_theta=10_000.0)
    base = Config(model=dataclasses.replace(model, remat="full"), mesh=MeshConfig(fsdp=S),
                  optim=OptimConfig(warmup_steps=1), batch_size=args.rows * M, seq_len=128, steps=100)
    piped = dataclasses.replace(base, model=model, mesh=MeshConfig(pipeline=S, fsdp=1),
                                pipeline=PipelineConfig(args.schedule, M))
    for cfg in (base, piped):
        validate(cfg)
    devices = jax.devices()[:S]
    runs = {"baseline": build(base, devices), "pipelined": build(piped, devices)}
    plan = runs["pipelined"][3]
    print(plan.describe())
    times = {k: [] for k in runs}
    for _ in range(args.repeats):  # alternate: the machine is shared and noisy
        for name, (fn, state, batch, _) in runs.items():
            t0 = time.perf_counter()
            state, metrics = fn(state, batch)
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - t0)
            runs[name] = (fn, state, batch, None)
    t_base, t_pipe = (statistics.median(times[k]) for k in ("baseline", "pipelined"))
    bubble = plan.schedule.bubble_fraction(1.0, 3.0)  # backward = recompute + gradient
    ideal = t_base / (1.0 - bubble)
    print(f"baseline (fsdp={S}, remat=full): {t_base * 1e3:.1f} ms/step; pipelined "
          f"({args.schedule}, S={S}, M={M}): {t_pipe * 1e3:.1f} ms/step")
    print(f"bubble: predicted {bubble:.1%}, measured {1.0 - t_base / t_pipe:.1%}; ideal pipelined "
          f"step {ideal * 1e3:.1f} ms")
    print(f"ideal / measured: {ideal / t_pipe:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
