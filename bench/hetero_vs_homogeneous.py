"""Two islands against one: the same model on the same total devices.

    python -m bench.hetero_vs_homogeneous [--config configs/tiny_hetero.py] [--config.KEY=VALUE ...]
                                          [--steps 30] [--skip 5]

One island: one process holding every device, the SPMD pipeline over the `pipeline`
axis (one stage per island, the islands' layer split and mesh). Two islands: one
jax.distributed world per island started by launch.local (pipeline placement), first
over the `host` transfer backend, then `direct`. Each run's tokens/s comes from its
metrics.jsonl: tokens over step time of the steps after the first --skip (compiles)
and before the last (whose time is not a whole step). Where the islands' platforms
are not installed, they run on the installed one (on a CPU-only machine: CPU islands
standing in for CUDA and ROCm). The last line: two-island tokens/s over one-island
tokens/s, per backend.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import common
from hetjax import config as config_lib
from hetjax.compile import backend, cli
from hetjax.config import ConfigError
from hetjax.hetero import placement
from launch import local

DEFAULT = "configs/tiny_hetero.py"
BACKENDS = ("host", "direct")


def tokens_per_sec(run_dir: Path, skip: int) -> tuple[float, float, int]:
    """(tokens/s, last loss, steps measured) from the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    timed = rows[skip:-1]
    if not timed:
        raise ConfigError(f"--skip={skip}: the run has only {len(rows)} steps; use more --steps")
    return sum(r["tokens"] for r in timed) / sum(r["step_time"] for r in timed), rows[-1]["loss"], len(timed)


def one_island_overrides(cfg) -> dict[str, str]:
    """The same model as one island: every island's devices, one pipeline stage per island."""
    islands = cfg.hetero.islands
    if cfg.hetero.placement != "pipeline":
        raise ConfigError(f"config.hetero.placement={cfg.hetero.placement!r}: this benchmark compares "
                          f"pipeline placement with the single-island pipeline")
    shapes = {(i.num_processes * i.devices_per_process, i.mesh) for i in islands}
    if len(shapes) > 1:
        raise ConfigError("config.hetero.islands differ in devices or mesh; the single-island pipeline "
                          "needs every stage alike: give the islands equal meshes")
    m = islands[0].mesh
    return {"hetero.islands": "()", "mesh.pipeline": str(len(islands)), "mesh.data": str(m.data),
            "mesh.fsdp": str(m.fsdp), "mesh.tensor": str(m.tensor),
            "pipeline.stage_layers": str(placement.island_layers(cfg))}


def main(argv: list[str]) -> int:
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", DEFAULT] + argv
    counts = {"--steps": (30, 4), "--skip": (5, 1)}
    _, opts = common.parse(argv, counts, doc=__doc__)  # checks every argument
    rest, args = [], list(argv)
    while args:  # what the runs themselves get: --config and its overrides
        arg = args.pop(0)
        if arg in counts:
            args.pop(0)
        elif arg.partition("=")[0] not in counts:
            rest.append(arg)
    cmd = config_lib.parse_command_line(rest, flags=())
    config, overrides = cmd.config, dict(cmd.overrides)
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
    print(f"{cfg.name}: {len(cfg.hetero.islands)} islands, {total} {installed} devices in all; "
          f"{opts['steps']} steps, timing those after the first {opts['skip']}; logs in {work}", flush=True)

    one = work / "one_island"
    # Each run compiles afresh into its own cache (a direct run after a host run of the same
    # programs, from a warm cache, stalled its first transfer here: see the README).
    args = [f"--config.{k}={v}" for k, v in {**overrides, **one_island_overrides(cfg), "run_dir": str(one),
                                               "compile.cache_dir": str(work / "cache_one")}.items()]
    with open(work / "one_island.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "hetjax.train", "--config", config, *args],
                               stdout=log, stderr=subprocess.STDOUT, env=local.device_env(installed, total))
    if code:
        print(f"the one-island run failed ({code}); see {work / 'one_island.log'}")
        return code
    base, loss, n = tokens_per_sec(one, opts["skip"])
    print(f"one island  (1 process, {total} devices, SPMD pipeline): {base:10.1f} tokens/s  "
          f"(last loss {loss:.4f}, {n} steps timed)", flush=True)
    ratios = {}
    for name in BACKENDS:
        run_dir = work / f"two_islands_{name}"
        with open(work / f"two_islands_{name}.log", "w") as log:
            code = local.run(config, {**overrides, "run_dir": str(run_dir),
                                      "compile.cache_dir": str(work / f"cache_{name}")},
                             stand_in=stand_in, backend=name, out=log)
        if code:
            print(f"the two-island run over {name} failed ({code}); see {run_dir / 'logs'}")
            return code
        rate, loss, n = tokens_per_sec(run_dir, opts["skip"])
        ratios[name] = rate / base
        print(f"two islands ({name:>6}, {processes} processes): {rate:10.1f} tokens/s  "
              f"(last loss {loss:.4f}, {n} steps timed)", flush=True)
    print("two islands / one island, tokens/s: " + "  ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
