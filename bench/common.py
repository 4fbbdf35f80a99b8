"""What the config-driven benchmarks share: their command line, hetjax's train step
built as hetjax/train.py builds it, and the timed runs of the benches that start
training processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable, TextIO

from hetjax import cli
from hetjax import config as config_lib
from hetjax.errors import ConfigError

DEFAULT_CONFIG = "configs/tiny.py"


def parse(argv: list[str], counts: dict[str, tuple[int, int]], switches: tuple[str, ...] = (),
          default_overrides: dict | None = None, doc: str = "") -> tuple[config_lib.Config, dict]:
    """The benchmark's own options, then hetjax's --config parsing of the rest.

    counts: integer options, `--name` -> (default, least allowed value); switches:
    boolean `--name` flags. Without --config, DEFAULT_CONFIG runs with
    `default_overrides` under the given --config.KEY=VALUE. `--help` prints `doc`.
    Returns the loaded config (not yet validated: callers adjust steps first) and the
    options, keyed by name without dashes ("--constrain-baseline" -> "constrain_baseline")."""
    opts, rest = {**{k: d for k, (d, _) in counts.items()}, **{k: False for k in switches}}, []
    args = list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.partition("=")
        if arg in ("-h", "--help"):
            print(doc.strip())
            sys.exit(0)
        elif arg in switches:
            opts[arg] = True
        elif key in counts:
            if not eq:
                if not args:
                    raise config_lib.ConfigError(f"{arg}: give a value, e.g. {arg}=10")
                value = args.pop(0)
            try:
                opts[key] = int(value)
            except ValueError:
                raise config_lib.ConfigError(f"{key}={value!r}: expected an integer") from None
            if opts[key] < counts[key][1]:
                raise config_lib.ConfigError(f"{key}={value}: too small (at least {counts[key][1]})")
        elif key == "--config" or key.startswith("--config.") or not key.startswith("--"):
            rest.append(arg)
        else:
            raise config_lib.ConfigError(
                f"unknown argument {arg!r}; known: --config, --config.KEY=VALUE, "
                f"{', '.join([*counts, *switches])}, --help")
    has_config = any(a == "--config" or a.startswith("--config=") for a in rest)
    cmd = cli.parse_command_line(rest if has_config else ["--config", DEFAULT_CONFIG] + rest,
                                 flags=())
    overrides = cmd.overrides if has_config else {**(default_overrides or {}), **cmd.overrides}
    opts = {k.removeprefix("--").replace("-", "_"): v for k, v in opts.items()}
    return config_lib.load(cmd.config, overrides), opts


def command_line(argv: list[str], default_config: str, counts: dict[str, tuple[int, int]],
                 switches: tuple[str, ...], doc: str) -> tuple[cli.CommandLine, dict]:
    """For benches that start training processes: their options (checked by `parse`) and
    the rest of argv, --config (`default_config` when absent) and its overrides, as the
    processes get it."""
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", default_config] + argv
    _, opts = parse(argv, counts, switches, doc=doc)  # checks every argument
    rest, args = [], list(argv)
    while args:
        arg = args.pop(0)
        if arg in counts:
            args.pop(0)
        elif arg.partition("=")[0] not in counts and arg not in switches:
            rest.append(arg)
    return cli.parse_command_line(rest, flags=()), opts



def tokens_per_sec(run_dir: Path, skip: int) -> tuple[float, float, int]:
    """(tokens/s, last loss, steps measured) from the run's metrics.jsonl.

    Tokens are every position of the batch (metrics' tokens_per_sec, what MFU counts), not
    only those the loss reads.
    """
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    timed = rows[skip:-1]
    if not timed:
        raise ConfigError(f"--skip={skip}: the run has only {len(rows)} steps; use more --steps")
    tokens = sum(r["tokens_per_sec"] * r["step_time"] for r in timed)  # batch_size * seq_len each
    return tokens / sum(r["step_time"] for r in timed), rows[-1]["loss"], len(timed)


def train_in_one_process(config: str, overrides: dict, env: dict) -> Callable[[TextIO], int]:
    """A `launch` for `timed_run`: python -m hetjax.train in one process with `env`."""
    args = [f"--config.{k}={v}" for k, v in overrides.items()]
    return lambda log: subprocess.call([sys.executable, "-m", "hetjax.train", "--config", config, *args],
                                       stdout=log, stderr=subprocess.STDOUT, env=env)


def timed_run(label: str, run_dir: Path, skip: int, launch: Callable[[TextIO], int]) -> tuple[float, int]:
    """One side of a bench: `launch(log)` trains into run_dir with its output in
    run_dir.log; prints its tokens/s line under `label`. (tokens/s, 0), or (0, exit
    status) after saying where to look when it failed."""
    log_path = run_dir.with_name(run_dir.name + ".log")
    with open(log_path, "w") as log:
        code = launch(log)
    if code:
        print(f"the {label} run failed ({code}); see {log_path}")
        return 0.0, code
    rate, loss, steps = tokens_per_sec(run_dir, skip)
    print(f"{label}: {rate:10.1f} tokens/s  (last loss {loss:.4f}, {steps} steps timed)", flush=True)
    return rate, 0
