"""Trains a model: `python -m hetjax.train --config configs/tiny.py [--config.KEY=VALUE ...]`.

With config.hetero.islands the job spans islands (hetjax/hetero); the loop below is
the same for one mesh and for islands. Restarted with the same run directory, it resumes from the newest good checkpoint
(model, optimizer and data iterator); SIGTERM or Ctrl-C saves one and exits with 143
or 130 (hetjax/stop.py; a second Ctrl-C exits at once). With
`--compile_only`, it lowers and compiles the step on the configured mesh with
abstract inputs and prints the compiler's memory and FLOP figures instead.
"""

from __future__ import annotations

import sys
import time

import jax

from hetjax import checkpoint_fit, checkpoint_init
from hetjax import cli as cli_lib  # `cli` below is the console script's entry point
from hetjax import config as config_lib
from hetjax import data, metrics, repro, stop as stop_lib
from hetjax.hetero import job as hetero_job, runtime
from hetjax import job as job_lib
from hetjax.job import Job, MeshJob
from hetjax.profiler import Profiler


PREEMPTED = stop_lib.PREEMPTED  # exit status after SIGTERM (130 after Ctrl-C)


def main(argv: list[str] | None = None) -> int:
    runtime.follow_launcher()  # started by launch.local: end with it
    args = cli_lib.parse_command_line(sys.argv[1:] if argv is None else argv, doc=__doc__)
    cfg = config_lib.load(args.config, args.overrides)
    config_lib.validate(cfg)
    if args.compile_only and cfg.hetero.islands:
        raise config_lib.ConfigError(
            "--compile_only lowers one mesh's train step; islands compile their own stage programs "
            "when the job starts (not ahead of time yet): drop --compile_only, or compile one island "
            "alone with that island's mesh as config.mesh and no config.hetero.islands")
    if cfg.hetero.islands:
        line, settings = hetero_job.start(cfg)  # each island's profile; joins its jax.distributed world
    else:
        # XLA flags and env before jax touches a device; joins the processes of a one-mesh
        # job started as several (srun -n N, launch.local --processes N) into one world.
        line, settings = job_lib.start(cfg)
    print(line, flush=True)
    dataset = data.build(cfg)  # bad data is reported before anything is compiled
    checkpoint_fit.check_layout_kind(cfg)  # another kind of job's checkpoints: refused before compiling
    # checkpoints left elsewhere are refused, a learning-rate schedule that changes is told
    resumes = checkpoint_fit.check_resume(cfg)
    if cfg.init_from and not resumes:  # a resume reads its own checkpoints, not init_from's
        checkpoint_init.find_checkpoint_dir(cfg.init_from)  # a wrong path fails before compiling

    def log(text):
        print(text, flush=True)

    if args.compile_only:
        print("\n".join(MeshJob(cfg, dataset, compile_only=True, log=log).compile_report()), flush=True)
        return 0
    signals = stop_lib.StopSignals().install()  # a Ctrl-C while compiling stops after the first step
    job = None
    try:  # until the loop's own `finally` takes over: the job and the signal handlers go on failure
        job: Job = (hetero_job.IslandsJob(cfg, dataset, settings, log) if cfg.hetero.islands
                    else MeshJob(cfg, dataset, log=log))
        signals.attach(job)
        state, start, batches, ckpt = job.state, job.start, job.batches, job.checkpoints
        checkpoint_fit.check_not_past(cfg, start, ckpt.directory)  # one mesh checked it before compiling
        flops_per_step, peak = job.flops_per_step(), job.peak
        floor = "" if dataset.floor is None else f"; its best possible loss is {dataset.floor:.4f}"
        print(f"MFU against {peak / 1e12:.3g} TFLOP/s ({job.peak_source}); data: {dataset.description}"
              f"{floor}", flush=True)

        run_dir = job.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        config_lib.save(cfg, run_dir / "config.json")
        metrics.truncate(run_dir, start)
        writer = metrics.Writer(run_dir, cfg.steps, cfg.tensorboard, metrics.start_wandb(
            cfg.wandb, run_dir, config_lib.to_dict(cfg), job.writes_fingerprints), start)
        recorder = repro.Recorder(run_dir, cfg, job.mesh, None, start, write=job.writes_fingerprints)
        profiler = Profiler(cfg.profile_steps, run_dir / "profile", log)
    except BaseException:
        if job is not None:
            job.close()
        signals.close()
        raise
    last_finite, clock = start - 1, metrics.StepClock()
    # MaxText's count (causal attention halved, matmul weights only) beside the PaLM one.
    maxtext_flops = metrics.maxtext_flops_per_token(cfg) * cfg.batch_size * cfg.seq_len
    data_waits: dict[int, float] = {}  # step -> seconds the loop waited for its batch

    def report(s, step_metrics):
        nonlocal last_finite
        values = jax.device_get(step_metrics)
        step_time = clock.seconds(s)
        metrics.check_finite(values, s, last_finite)
        last_finite = s
        # tokens_per_sec counts every position of the batch, as the MFUs' FLOPs do;
        # loss_tokens_per_sec only those the loss reads (`tokens`: the loss mask's sum).
        values.update(step_time=step_time, tokens_per_sec=cfg.batch_size * cfg.seq_len / step_time,
                      loss_tokens_per_sec=values["tokens"] / step_time,
                      mfu=flops_per_step / step_time / peak, mfu_maxtext=maxtext_flops / step_time / peak,
                      data_wait_time=data_waits.pop(s))
        peak_memory = metrics.peak_memory_gib(jax.local_devices())  # None on CPU: not reported
        if peak_memory is not None:
            values["peak_memory_gib"] = peak_memory
        if dataset.floor is not None:
            values["above_floor"] = values["loss"] - dataset.floor
        if s == start:  # this process's first step carries its warm-up (hetjax.plot leaves it out)
            values["run_start"] = 1.0
        writer.write(s, values, echo=s % cfg.log_every == 0 or s == cfg.steps - 1)
        recorder.step(s, values, job.batch_digest(s))  # fingerprints.jsonl (hetjax/repro)

    def evaluate(s):
        sums = jax.device_get([job.eval_sums(state, i) for i in range(cfg.eval_batches)])
        loss = sum(x["loss_sum"] for x in sums) / max(sum(x["tokens"] for x in sums), 1.0)
        writer.write(s, {"eval_loss": loss}, echo=True)
        clock.resume(s + 1)  # eval time is not step time

    def flush():
        # Report the step whose metrics are still on the device.
        nonlocal previous
        if previous is not None:  # taken first: a report that raised (a NaN) is not asked again
            pending, previous = previous, None
            report(*pending)

    def save(s):
        flush()  # every step before a checkpoint is in metrics.jsonl
        ckpt.save(s, state, batches.get_state(), config_lib.to_dict(cfg))
        clock.resume(s)  # the save's blocking part is not step s's time

    try:
        previous = None
        if recorder.due(start):
            recorder.write_params(start, job.param_fingerprint(state))
            clock.resume(start)  # the fingerprint (and its compile) is not step time
        for s in range(start, cfg.steps):
            waited = time.perf_counter()
            batch = next(batches)
            data_waits[s] = time.perf_counter() - waited
            job.digest_batch(s, batch)
            if profiler.before(s):
                clock.resume(s)  # starting the trace is not step time
            with profiler.step(s):  # the profile plugin's step marker, while tracing
                state, step_metrics = job.train_step(state, batch)
            clock.dispatched(s, step_metrics)  # the same clock for every kind of job
            if profiler.after(s, step_metrics):
                clock.resume(s + 1)
            if recorder.due(s + 1):
                recorder.write_params(s + 1, job.param_fingerprint(state))  # waits for step s
                clock.resume(s + 1)  # the fingerprint is not step time
            # Read the previous step's metrics only now, so the device is never idle
            # waiting for the host.
            flush()
            previous = (s, step_metrics)
            job.check_identical(state, s + 1)  # islands that must agree bit for bit, every N steps
            # With islands: agreed by all, so all save the same step. A stop during the last
            # step finishes the run instead (its final eval too), as a resume would do nothing.
            stop = job.stop_requested and s + 1 < cfg.steps
            if stop:  # saved, and written, before an eval due now: a preemption's grace may not cover both
                save(s + 1)
                ckpt.wait()
            # The final eval too goes before the last step's save: a run killed once that
            # checkpoint is written resumes at config.steps, with nothing left to do.
            if cfg.eval_every and ((s + 1) % cfg.eval_every == 0 or s + 1 == cfg.steps):
                flush()
                evaluate(s)
            if not stop and ckpt.should_save(s + 1):
                save(s + 1)
            if stop:
                ckpt.wait()
                status, line = signals.exit_line(s + 1, ckpt.directory)
                print(line, flush=True)
                return status
        flush()
        if cfg.steps not in ckpt.steps():
            save(cfg.steps)
    finally:
        failed = sys.exc_info()[0] is not None  # the error on its way out
        if failed and previous is not None:  # the last step that finished keeps its row
            try:
                flush()
            except Exception:  # noqa: BLE001 - a broken device, or a diverged step: the first error stands
                pass
        # signals last: a second Ctrl-C while closing still exits at once.
        stop_lib.close_all(profiler.close, clock.close, batches.close, lambda: writer.close(failed=failed),
                           recorder.close, ckpt.close, job.close, signals.close)
    print(f"done: {cfg.steps} steps; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
    return 0


def cli() -> int:
    try:
        return cli_lib.run_main(main)  # ConfigError: exit 2; any other HetjaxError: exit 1
    except KeyboardInterrupt:  # Ctrl-C before the job could save anything
        print("interrupted (Ctrl-C) before training started; nothing was saved", file=sys.stderr)
        return stop_lib.INTERRUPTED


if __name__ == "__main__":
    sys.exit(cli())
