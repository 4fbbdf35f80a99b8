"""Command lines of the compile-time programs: their own flags, then hetjax's --config ones."""

from __future__ import annotations

import argparse
import math
import sys

from hetjax import cli
from hetjax import config as config_lib
from hetjax.compile import backend


def parse(parser: argparse.ArgumentParser, argv: list[str]):
    """(namespace, validated Config): `parser`'s flags, plus --config X and --config.a.b=v.
    These programs lower one mesh's train step, so a config of islands is refused."""
    parser.add_argument("--config", required=True, help="config file, e.g. configs/tiny.py")
    ns, rest = parser.parse_known_args(argv)
    cmd = cli.parse_command_line(["--config", ns.config, *rest], flags=())
    cfg = config_lib.load(cmd.config, cmd.overrides)
    config_lib.validate(cfg)
    if cfg.model.attention_impl == "cudnn":  # these programs lower on virtual CPU devices
        raise config_lib.ConfigError(
            f"config.model.attention_impl='cudnn': jax asks a CUDA GPU's cuDNN while tracing it, and "
            f"{parser.prog} lowers on CPU devices; use --config.model.attention_impl=xla here (the same "
            f"FLOPs; XLA's attention also holds the scores that cuDNN's kernel does not)")
    if cfg.hetero.islands:
        names = ", ".join(i.name for i in cfg.hetero.islands)
        raise config_lib.ConfigError(
            f"config.hetero.islands ({names}): {parser.prog} works on one mesh's train step, and islands "
            f"compile their own stage programs when the job starts; give one island's mesh as "
            f"--config.mesh.* with --config.hetero.islands=()")
    return ns, cfg


def device_count(cfg, devices: int | None, flag: str = "--devices") -> int:
    """The virtual device count: `devices`, or the product of a fully given config.mesh."""
    sizes = {a: getattr(cfg.mesh, a) for a in config_lib.MESH_AXES}
    if devices is not None:
        if devices < 1:
            raise config_lib.ConfigError(f"{flag}={devices}: must be positive")
        return devices
    if -1 in sizes.values():
        wild = next(a for a, n in sizes.items() if n == -1)
        raise config_lib.ConfigError(
            f"config.mesh.{wild}=-1 takes the remaining devices, so the device count is unknown; "
            f"give {flag} N (the target's device count) or set config.mesh.{wild}")
    return math.prod(sizes.values())


def run(main, argv=None) -> int:
    """Runs `main(argv)`, turning a user mistake into one line on stderr and exit code 2."""
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except (config_lib.ConfigError, backend.BackendStarted) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
