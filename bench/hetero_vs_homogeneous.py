"""Two islands against one: the same model on the same total devices.

    python -m bench.hetero_vs_homogeneous [--config configs/tiny_hetero.py] [--config.KEY=VALUE ...]
                                          [--steps 30] [--skip 5] [--data] [--no-pin]

One island: one process holding every device, the SPMD pipeline over the `pipeline`
axis (one stage per island, the islands' layer split and mesh), or with --data a
`data` axis of one slice per island. Two islands: one process per island started by
launch.local (pipeline placement, or data placement with --data), first over the
`host` transfer backend, then `direct`. On CPU each island's process keeps to its own
share of the cores (launch.local's cpu_shares) and the one island gets them all;
--no-pin lets the islands' processes share every core. Each run's tokens/s comes from its
metrics.jsonl: tokens over step time of the steps after the first --skip (compiles)
and before the last (whose time is not a whole step). Where the islands' platforms
are not installed, they run on the installed one (on a CPU-only machine: CPU islands
standing in for CUDA and ROCm). With pipeline placement the islands keep their forwards'
residuals for the backward (config.pipeline.recompute=False, the default) while the one
island's SPMD pipeline recomputes them: --config.pipeline.recompute=True makes both do the
same arithmetic (the run says which). The last line: two-island tokens/s over one-island
tokens/s, per backend.
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
from hetjax.hetero import placement
from hetjax.launch import local
from hetjax.pipeline.config import virtual_stages

DEFAULT = "configs/tiny_hetero.py"
BACKENDS = ("host", "direct")


def one_island_overrides(cfg) -> dict[str, str]:
    """The same model as one island of all the islands' devices: one pipeline stage per
    island (pipeline placement), or one slice of the `data` axis per island (data)."""
    islands = cfg.hetero.islands
    shapes = {(i.num_processes * i.devices_per_process, i.mesh) for i in islands}
    if len(shapes) > 1:
        raise ConfigError("config.hetero.islands differ in devices or mesh; one island with a stage "
                          "(or data slice) per island needs them alike: give the islands equal meshes")
    m = islands[0].mesh
    if cfg.hetero.placement == "data":
        if m.pipeline != 1 or m.data != 1:
            raise ConfigError(f"config.hetero.islands[0].mesh={m}: with --data the one-island run puts the "
                              f"islands on its `data` axis; give the islands pipeline=1 and data=1")
        return {"hetero.islands": "()", "mesh.pipeline": "1", "mesh.data": str(len(islands)),
                "mesh.fsdp": str(m.fsdp), "mesh.tensor": str(m.tensor)}
    # Interleaved chunks split the layers evenly, as the islands' placement does with V > 1;
    # the one island runs the islands' V (its own automatic choice might differ).
    V = virtual_stages(cfg, len(islands))
    stage_layers = placement.island_layers(cfg) if V == 1 else ()
    return {"hetero.islands": "()", "mesh.pipeline": str(len(islands)), "mesh.data": str(m.data),
            "mesh.fsdp": str(m.fsdp), "mesh.tensor": str(m.tensor), "pipeline.virtual_stages": str(V),
            "pipeline.stage_layers": str(stage_layers), "pipeline.split_backward": "False"}


def main(argv: list[str]) -> int:
    counts, switches = {"--steps": (30, 4), "--skip": (5, 1)}, ("--data", "--no-pin")
    cmd, opts = common.command_line(argv, DEFAULT, counts, switches, __doc__)
    config, overrides = cmd.config, dict(cmd.overrides)
    if opts["data"]:
        overrides["hetero.placement"] = "data"
    pin = "off" if opts["no_pin"] else "auto"
    if opts["steps"] <= opts["skip"] + 1:
        raise ConfigError(f"--steps={opts['steps']} leaves no step to time after --skip={opts['skip']}")
    work = Path(tempfile.mkdtemp(prefix="hetero_bench_"))
    # A first step waits for its peer's compile: on a busy machine that outlasts the default.
    overrides.setdefault("hetero.link.timeout_s", "600")
    overrides.update({"steps": str(opts["steps"]), "eval_every": "0", "tensorboard": "False",
                      "checkpoint.every": "0", "log_every": str(opts["steps"])})
    cfg = config_lib.load(config, overrides)
    config_lib.validate(cfg)
    installed, _ = backend.detect()
    stand_in = "" if all(i.platform == installed for i in cfg.hetero.islands) else installed
    total = sum(i.num_processes * i.devices_per_process for i in cfg.hetero.islands)
    processes = sum(i.num_processes for i in cfg.hetero.islands)
    cores = sorted(os.sched_getaffinity(0))
    shares = local.cpu_shares([i.devices_per_process for i in cfg.hetero.islands for _ in range(i.num_processes)],
                              cores) if installed == "cpu" and pin == "auto" else None
    print(f"{cfg.name}: {len(cfg.hetero.islands)} islands ({cfg.hetero.placement} placement), {total} {installed} "
          f"devices in all; {opts['steps']} steps, timing those after the first {opts['skip']}; logs in {work}",
          flush=True)
    if cfg.hetero.placement == "pipeline":
        print("backwards: the islands " + ("recompute their forwards, as the one island's SPMD pipeline does"
              if cfg.pipeline.recompute else "keep their forwards' residuals (config.pipeline.recompute=False), "
              "where the one island's SPMD pipeline recomputes them: less arithmetic on the islands' side; "
              "--config.pipeline.recompute=True compares like with like")
              + ("; the islands split each backward into its input- and weight-gradient parts "
                 "(config.pipeline.split_backward), the one island cannot" if cfg.pipeline.split_backward else ""),
              flush=True)
    print(f"cores: one island uses {len(cores)} ({','.join(map(str, cores))}); "
          + (f"the islands' processes get {' and '.join(','.join(map(str, s)) for s in shares)}" if shares
             else "the islands' processes share them all"), flush=True)

    # Each run compiles afresh into its own cache (a direct run after a host run of the same
    # programs, from a warm cache, stalled its first transfer here: docs/measurements.md).
    kind = "data axis" if cfg.hetero.placement == "data" else "SPMD pipeline"
    one = {**overrides, **one_island_overrides(cfg), "run_dir": str(work / "one_island"),
           "compile.cache_dir": str(work / "cache_one")}
    base, code = common.timed_run(
        f"one island  (1 process, {total} devices, {kind})", work / "one_island", opts["skip"],
        common.train_in_one_process(config, one, local.device_env(installed, total)))
    if code:
        return code
    ratios = {}
    for name in BACKENDS:
        run_dir = work / f"two_islands_{name}"
        rate, code = common.timed_run(
            f"two islands ({name:>6}, {processes} processes)", run_dir, opts["skip"],
            lambda log: local.run(config, {**overrides, "run_dir": str(run_dir),
                                           "compile.cache_dir": str(work / f"cache_{name}")},
                                  stand_in=stand_in, backend=name, out=log, pin=pin))
        if code:
            return code
        ratios[name] = rate / base
    print("two islands / one island, tokens/s: " + "  ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
