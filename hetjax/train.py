"""Trains a model: `python -m hetjax.train --config configs/tiny.py [--config.KEY=VALUE ...]`.

Restarted with the same run directory, it resumes from the newest good checkpoint
(model, optimizer and data iterator); SIGTERM saves one and exits with 143. With
`--compile_only`, it lowers and compiles the step on the configured mesh with
abstract inputs and prints the compiler's memory and FLOP figures instead.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from hetjax import checkpoint
from hetjax import config as config_lib
from hetjax import data, memory, metrics, pipeline, repro, sharding
from hetjax.compile import aot, backend
from hetjax.mesh import describe, make_mesh


class TrainingDiverged(RuntimeError):
    pass


PREEMPTED = 143  # exit status after SIGTERM: 128 + 15, as if the signal had killed us


def main(argv: list[str] | None = None) -> int:
    args = config_lib.parse_command_line(sys.argv[1:] if argv is None else argv)
    cfg = config_lib.load(args.config, args.overrides)
    config_lib.validate(cfg)
    print(backend.start(cfg), flush=True)  # XLA flags and env before jax touches a device
    dataset = data.build(cfg)  # bad data is reported before anything is compiled
    if cfg.init_from:
        checkpoint.find_checkpoint_dir(cfg.init_from)  # a wrong path fails before compiling

    # Everything below up to create_state is abstract: no parameter is allocated.
    mesh = make_mesh(cfg.mesh)
    prog = aot.program(cfg, mesh)  # checks that the model splits over the mesh
    plan, tx, graphdef, abstract_state = prog.plan, prog.tx, prog.graphdef, prog.state
    layouts, state_shardings, batch_shardings = prog.layouts, prog.state_shardings, prog.batch_shardings
    replicated = sharding.check_replication(layouts, mesh, cfg.sharding.max_replicated_fraction)
    num_params = sum(math.prod(l.shape) for l in layouts)
    estimate = memory.estimate(cfg, layouts, mesh)
    print(f"{cfg.name}: {num_params:,} parameters on mesh {describe(mesh)} "
          f"({mesh.devices.flat[0].device_kind}); {replicated:.1%} of parameter bytes replicated; "
          f"needs {estimate.describe()}", flush=True)
    if plan is not None:
        print(plan.describe(), flush=True)
    if not args.compile_only:
        memory.check_fits(cfg, estimate, mesh)

    t0 = time.perf_counter()
    train_step = pipeline.compile_train_step(cfg, graphdef, tx, abstract_state, state_shardings, mesh, plan)
    print(f"compiled the train step in {time.perf_counter() - t0:.1f}s", flush=True)
    flops_per_step = metrics.model_flops_per_token(cfg, num_params) * cfg.batch_size * cfg.seq_len
    if args.compile_only:
        report = aot.analysis(train_step)
        for key, value in report.items():
            unit = f"{value / memory.GiB:.3f} GiB" if key.endswith("bytes") else f"{value:.4g}"
            print(f"  {key:>22}: {unit} per device")
        print(f"  {'model_flops':>22}: {flops_per_step:.4g} per step (6N + attention)")
        return 0

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_lib.save(cfg, run_dir / "config.json")
    ckpt = checkpoint.Manager(checkpoint.default_dir(cfg), cfg.checkpoint)
    # Resume the run's own checkpoint if it has one (same run_dir, no flag); else
    # start from config.init_from's weights; else initialise.
    restored = ckpt.restore_latest(abstract_state, state_shardings)
    if restored is not None:
        state, start = restored.state, restored.step
        print(f"resumed from step {start} of {ckpt.directory} "
              f"(parameter fingerprint {restored.meta['params_fingerprint']})", flush=True)
    elif cfg.init_from:
        params = checkpoint.load_params(cfg.init_from, abstract_state.params, state_shardings.params)
        state, start = checkpoint.fresh_state(params, tx, state_shardings), cfg.data.start_step
    else:
        state, start = pipeline.create_state(cfg, tx, state_shardings, plan), cfg.data.start_step
    eval_step = pipeline.compile_eval_step(cfg, graphdef, abstract_state.params, state_shardings.params,
                                           mesh, plan)
    batches = dataset.iterator(batch_shardings, start)
    if restored is not None:
        batches.set_state(restored.data_state)  # refuses a state saved for other data
        assert batches.get_state()["step"] == start, (batches.get_state(), start)
    peak, peak_source = metrics.peak_flops(cfg, list(mesh.devices.flat))
    floor = "" if dataset.floor is None else f"; its best possible loss is {dataset.floor:.4f}"
    print(f"MFU against {peak / 1e12:.3g} TFLOP/s ({peak_source}); data: {dataset.description}"
          f"{floor}", flush=True)

    metrics.truncate(run_dir, start)
    writer = metrics.Writer(run_dir, cfg.steps, cfg.tensorboard)
    recorder = repro.Recorder(run_dir, cfg, mesh, plan, start)  # fingerprints.jsonl (hetjax/repro)
    last_finite, clock = -1, time.perf_counter()

    def report(s, step_metrics):
        nonlocal last_finite, clock
        values = jax.device_get(step_metrics)
        now = time.perf_counter()
        step_time, clock = now - clock, now
        if not np.isfinite(values["loss"]):
            raise TrainingDiverged(
                f"loss is {values['loss']} at step {s}; the last finite loss was at step "
                f"{last_finite}, so training diverged in steps {last_finite + 1}..{s}. "
                f"Lower config.optim.learning_rate or config.optim.grad_clip_norm")
        last_finite = s
        values.update(step_time=step_time, tokens_per_sec=values["tokens"] / step_time,
                      mfu=flops_per_step / step_time / peak)
        if dataset.floor is not None:
            values["above_floor"] = values["loss"] - dataset.floor
        writer.write(s, values, echo=s % cfg.log_every == 0 or s == cfg.steps - 1)
        recorder.step(s, values)

    def evaluate(s):
        nonlocal clock
        sums = [eval_step(state.params, dataset.eval_batch(i, batch_shardings))
                for i in range(cfg.eval_batches)]
        sums = jax.device_get(sums)
        loss = sum(x["loss_sum"] for x in sums) / max(sum(x["tokens"] for x in sums), 1.0)
        writer.write(s, {"eval_loss": loss}, echo=True)
        clock = time.perf_counter()  # eval time is not step time

    def flush():
        # Report the step whose metrics are still on the device.
        nonlocal previous
        if previous is not None:
            report(*previous)
            previous = None

    def save(s):
        flush()  # every step before a checkpoint is in metrics.jsonl
        ckpt.save(s, state, batches.get_state(), config_lib.to_dict(cfg))

    preempted = []
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: preempted.append(True))
    try:
        previous = None
        recorder.params(start, state.params)
        for s in range(start, cfg.steps):
            state, step_metrics = train_step(state, recorder.batch(s, next(batches)))
            recorder.params(s + 1, state.params)
            # Read the previous step's metrics only now, so the device is never idle
            # waiting for the host.
            flush()
            previous = (s, step_metrics)
            if cfg.eval_every and (s + 1) % cfg.eval_every == 0:
                flush()
                evaluate(s)
            if preempted or ckpt.should_save(s + 1):
                save(s + 1)
            if preempted:
                ckpt.wait()
                print(f"preempted (SIGTERM): saved step {s + 1} in {ckpt.directory}", flush=True)
                return PREEMPTED
        flush()
        if cfg.eval_every and cfg.steps % cfg.eval_every and start < cfg.steps:
            evaluate(cfg.steps - 1)
        if cfg.steps not in ckpt.steps():
            save(cfg.steps)
    finally:
        batches.close()
        signal.signal(signal.SIGTERM, previous_handler)
        writer.close()
        recorder.close()
        ckpt.close()
    print(f"done: {cfg.steps} steps; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
    return 0


def cli() -> int:
    try:
        return main()
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingDiverged, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
