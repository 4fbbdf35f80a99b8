"""One mesh over several processes against the same mesh in one process.

    python -m bench.multiprocess_overhead [--config configs/medium_hetero.py] [--config.KEY=VALUE ...]
                                          [--processes 4] [--steps 20] [--skip 4] [--no-pin]

The model, batch and sequence of --config (default: configs/medium_hetero.py's medium
model) without its islands, on one mesh of --processes devices (config.mesh with -1
axes filled; fsdp over all of them by default). Baseline: one process holding every
device. Then the same mesh as one jax.distributed world of --processes processes, one
share of the devices each (launch.local --processes; gloo collectives on CPU). As
bench/hetero_vs_homogeneous.py does for islands, each process keeps to its own share
of the cores where there are as many cores as processes (launch.local's cpu_shares) and
the one process gets them all; with fewer cores than processes, or --no-pin, they all
share every core. tokens/s as in that bench: tokens over step time of the steps after
the first --skip and before the last. The last line: many processes' tokens/s over one
process's. Processes joined by blocking collectives (gloo) keep most of their speed with
the data-parallel layout and its gradients summed once a step:
`--config.mesh.fsdp=1 --config.mesh.data=-1 --config.sharding.grad_sync=once`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from bench import common
from hetjax import config as config_lib
from hetjax.compile import backend, cli
from hetjax.errors import ConfigError
from hetjax.hetero import scheduler
from hetjax.launch import local

DEFAULT = "configs/medium_hetero.py"


def main(argv: list[str]) -> int:
    counts, switches = {"--processes": (4, 2), "--steps": (20, 4), "--skip": (4, 1)}, ("--no-pin",)
    cmd, opts = common.command_line(argv, DEFAULT, counts, switches, __doc__)
    n = opts["processes"]
    if opts["steps"] <= opts["skip"] + 1:
        raise ConfigError(f"--steps={opts['steps']} leaves no step to time after --skip={opts['skip']}")
    overrides = {"hetero.islands": "()", "mesh.fsdp": "-1", **dict(cmd.overrides),
                 "steps": str(opts["steps"]), "eval_every": "0", "tensorboard": "False",
                 "checkpoint.every": "0", "log_every": str(opts["steps"]), "hetero.timeout_s": "600"}
    cfg = config_lib.load(cmd.config, overrides)
    config_lib.validate(cfg)
    devices = n * (scheduler.mesh_devices_per_process(cfg, n) or 1)  # a -1 axis: one device each
    installed, _ = backend.detect()
    pin = "off" if opts["no_pin"] else "auto"
    cores = sorted(os.sched_getaffinity(0))
    shares = local.cpu_shares([devices // n] * n, cores) if installed == "cpu" and pin == "auto" else None
    work = Path(tempfile.mkdtemp(prefix="multiprocess_bench_"))
    print(f"{cfg.name}'s model on one mesh of {devices} {installed} devices; {opts['steps']} steps, timing "
          f"those after the first {opts['skip']}; logs in {work}", flush=True)
    print(f"cores: one process uses {len(cores)}; " + (
        f"the {n} processes get {' / '.join(','.join(map(str, s)) for s in shares)}" if shares
        else f"the {n} processes share them all"), flush=True)

    base, code = common.timed_run(
        f"1 process ({devices} devices)", work / "one_process", opts["skip"],
        common.train_in_one_process(cmd.config, {**overrides, "run_dir": str(work / "one_process")},
                                    local.device_env(installed, devices)))
    if code:
        return code
    rate, code = common.timed_run(
        f"{n} processes ({devices // n} device(s) each, one world)", work / f"{n}_processes", opts["skip"],
        lambda log: local.run(cmd.config, {**overrides, "run_dir": str(work / f"{n}_processes")}, processes=n,
                              pin=pin, out=log))
    if code:
        return code
    print(f"{n} processes / 1 process, tokens/s: {rate / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
