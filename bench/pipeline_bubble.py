"""Pipelined step time against its ideal, measured side by side in one run.

    python -m bench.pipeline_bubble [--stages 2] [--microbatches 8] [--schedule 1f1b] [--virtual-stages 2]

The baseline is the unpipelined step of the same model and batch on the same
number of devices (fsdp = S), so each device does 1/S of the work, as each stage
does: the faster of two such steps, with per-layer full rematerialisation and without
it, both measured here. (The pipeline recomputes the forward of every stage but the
last in its backward, the last stage's backward being its only forward, so its FLOPs
lie between the two; on XLA:CPU the step without remat is the slower one, as it
copies its scanned layers' stacked residuals.) A perfect pipeline takes that time
divided by (1 - predicted bubble). Measures every
schedule (and the interleaved ones with --virtual-stages chunks per stage), printing
each one's predicted and measured bubble and ideal / measured (1.0 = no overhead
beyond the schedule's bubble); the last line is the default schedule's unpipelined /
pipelined step time (one minus its measured bubble). It also times the baseline in
accumulated micro-batches as small per device as a stage's (remat=full, M/S of them):
what running the layers at a pipeline's micro-batch size costs by itself.

Before it, the cost of a split backward (config.pipeline.split_backward, the islands'
zero-bubble-style schedule): one stage's forward that keeps what its two parts read, its
input-gradient part (B) and its weight-gradient part (W), hetjax.pipeline.split's, against
the forward that keeps its residuals and the one backward that reads them (the islands'
unsplit pair), and against jax.vjp's split, in which each part recomputes the stage and the
weight part backpropagates through every layer again. A split that costs more than the
bubble it could fill cannot pay.
"""

from __future__ import annotations

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
from hetjax.pipeline.config import VIRTUAL_SCHEDULES, virtual_stages  # noqa: E402
from hetjax.mesh import make_mesh  # noqa: E402
from hetjax import cli


def build(cfg, devices):
    mesh = make_mesh(cfg.mesh, devices)
    prog = program.build(cfg, mesh)
    train_step, state = prog.jit_train_step(), prog.init_state()
    batch = data.build(cfg).batch(0, prog.batch_shardings)
    state, metrics = train_step(state, batch)  # compile
    jax.block_until_ready(metrics)
    return train_step, state, batch, prog.plan


def split_backward_cost(model, rows: int, seq_len: int, device, repeats: int) -> dict[str, float]:
    """Median seconds of one middle stage's programs per micro-batch: the forward; the
    islands' unsplit pair (a forward keeping its residuals, the backward reading them);
    hetjax.pipeline.split's forward, B and W; jax.vjp's input and weight parts (each
    recomputing the stage)."""
    import jax.numpy as jnp
    from flax import nnx

    from hetjax import state as state_lib
    from hetjax.pipeline.split import Split
    from hetjax.pipeline.stages import Residuals, stage_backward_kept, stage_forward, stage_forward_keeping
    graphdef, params = nnx.split(state_lib.make_model(model, 0))
    params = jax.device_put(params, device)
    batch = {"positions": jnp.broadcast_to(jnp.arange(seq_len), (rows, seq_len)),
             "segment_ids": jnp.ones((rows, seq_len), jnp.int32)}
    x = jax.device_put(jax.random.normal(jax.random.key(0), (rows, seq_len, model.embed_dim), model.dtype), device)
    dy = jnp.ones_like(x)

    def f(p, x, b=batch):  # a stage as islands run it (scanned layers)
        return stage_forward(graphdef, p, x, b, first=False, last=False)
    kept, parts, split = Residuals(), Residuals(), Split(f, params, x, batch)

    def split_forward(p, x):
        y, vjp, acts = split.forward(p, x, batch)
        return y, parts.split(vjp, (p, x)), acts
    keep = jax.jit(lambda p, x: stage_forward_keeping(graphdef, p, x, batch, kept, first=False))
    forward, split_fwd = jax.jit(lambda p, x: f(p, x)), jax.jit(split_forward)
    kept_bwd = jax.jit(lambda p, x, k, dy: stage_backward_kept(p, x, k, dy, kept))
    split_b = jax.jit(lambda p, x, k, dy: Split.input_grads(parts.join(k, (p, x)), dy))
    split_w = jax.jit(split.weight_grads)
    _, residuals = keep(params, x)
    _, held, acts = split_fwd(params, x)
    _, dys = split_b(params, x, held, dy)
    programs = {"forward": (forward, (params, x)),
                "keeping forward": (keep, (params, x)), "kept backward": (kept_bwd, (params, x, residuals, dy)),
                "split forward": (split_fwd, (params, x)), "split B": (split_b, (params, x, held, dy)),
                "split W": (split_w, (params, acts, dys)),
                "vjp input": (jax.jit(lambda p, x, dy: jax.vjp(lambda x: f(p, x), x)[1](dy)), (params, x, dy)),
                "vjp weight": (jax.jit(lambda p, x, dy: jax.vjp(lambda p: f(p, x), p)[1](dy)), (params, x, dy))}
    times = {k: [] for k in programs}
    for fn, args in programs.values():
        jax.block_until_ready(fn(*args))  # compile
    for _ in range(repeats):
        for name, (fn, args) in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                                example="python -m bench.pipeline_bubble --schedule 1f1b_fused")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=pipeline.KINDS, help="only this schedule (default: every one)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="chunks per stage of the interleaved variants (1: none)")
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    S, M, V = args.stages, args.microbatches, args.virtual_stages
    model = ModelConfig(vocab_size=256, num_layers=4 * S, embed_dim=128, mlp_dim=384, num_heads=4,
                        num_kv_heads=2, head_dim=32, rope_theta=10_000.0)
    base = Config(model=dataclasses.replace(model, remat="full"), mesh=MeshConfig(fsdp=S),
                  optim=OptimConfig(warmup_steps=1), batch_size=args.rows * M, seq_len=128, steps=100)
    kinds = [args.schedule] if args.schedule else list(pipeline.KINDS)
    wanted = [(k, 1) for k in kinds] + [(k, V) for k in kinds if V > 1 and k in VIRTUAL_SCHEDULES]
    configs = {"baseline": base, "no remat": dataclasses.replace(base, model=model)}
    if M % S == 0 and M > S:  # the baseline's layers at a stage's micro-batch size (rows per device)
        accumulated = dataclasses.replace(base.optim, grad_accum_steps=M // S)
        configs["accumulated"] = dataclasses.replace(base, optim=accumulated)

    def pipelined(pipeline_config):
        return dataclasses.replace(base, model=model, mesh=MeshConfig(pipeline=S, fsdp=1), pipeline=pipeline_config)
    default = PipelineConfig(microbatches=M)  # config.pipeline's defaults at M micro-batches
    default = (default.schedule, virtual_stages(pipelined(default), S))
    if default not in wanted:
        wanted.append(default)
    for kind, v in wanted:
        configs[kind, v] = pipelined(PipelineConfig(kind, M, virtual_stages=v))
    for cfg in configs.values():
        validate(cfg)
    devices = jax.devices()[:S]
    runs = {name: build(cfg, devices) for name, cfg in configs.items()}
    times = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleave: the machine is shared and noisy
        for name, (fn, state, batch, plan) in runs.items():
            t0 = time.perf_counter()
            state, metrics = fn(state, batch)
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - t0)
            runs[name] = (fn, state, batch, plan)
    t_full, t_none = statistics.median(times["baseline"]), statistics.median(times["no remat"])
    t_base = min(t_full, t_none)
    print(f"baseline (fsdp={S}): {t_base * 1e3:.1f} ms/step, the faster of remat=full {t_full * 1e3:.1f} and "
          f"no remat {t_none * 1e3:.1f}; S={S}, M={M}")
    if "accumulated" in times:  # what micro-batches cost without a pipeline
        t_acc = statistics.median(times["accumulated"])
        print(f"the baseline in {M // S} accumulated micro-batches of {args.rows} rows per device, as a stage "
              f"runs them: {t_acc * 1e3:.1f} ms/step, {t_full / t_acc:.3f} of remat=full's speed")
    print(f"{'schedule':<22} {'ms/step':>8} {'bubble: predicted':>18} {'measured':>9} {'ideal/measured':>15}")
    for kind, v in wanted:
        plan, t_pipe = runs[kind, v][3], statistics.median(times[kind, v])
        bubble = plan.schedule.bubble_fraction(1.0, 3.0)  # backward = recompute + gradient
        ideal = t_base / (1.0 - bubble)
        print(f"{plan.schedule.name:<22} {t_pipe * 1e3:8.1f} {bubble:18.1%} {1.0 - t_base / t_pipe:9.1%} "
              f"{ideal / t_pipe:15.3f}")
    cost = split_backward_cost(dataclasses.replace(model, num_layers=model.num_layers // S), args.rows,
                               base.seq_len, devices[0], 3 * args.repeats)
    F, unsplit = cost["forward"], cost["keeping forward"] + cost["kept backward"]
    split = cost["split forward"] + cost["split B"] + cost["split W"]
    naive = cost["forward"] + cost["vjp input"] + cost["vjp weight"]
    fused_bubble = pipeline.make_schedule("1f1b_fused", S, M).bubble_fraction(1.0, 3.0)
    print(f"split backward (one stage, per micro-batch, in forwards): hetjax.pipeline.split's forward "
          f"{cost['split forward'] / F:.2f}, B {cost['split B'] / F:.2f}, W {cost['split W'] / F:.2f}; "
          f"split / unsplit (keeping forward + kept backward, {unsplit / F:.2f}) = {split / unsplit:.3f}; "
          f"jax.vjp's parts, each recomputing: {naive / unsplit:.3f} (1f1b_fused's predicted bubble: "
          f"{fused_bubble:.1%})")
    t_default = statistics.median(times[default])
    print(f"default schedule ({default[0]}, virtual_stages={default[1]}) unpipelined / "
          f"pipelined step time: {t_base / t_default:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
