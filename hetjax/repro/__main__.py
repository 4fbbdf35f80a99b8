"""`python -m hetjax.repro compare RUN_A RUN_B` and `python -m hetjax.repro check ...`.

Exit status: 0 within tolerance (or bit-identical), 1 out of tolerance or a run
failed, 2 a usage error, 3 the comparison is void (different data or initial weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hetjax import cli
from hetjax import config as config_lib
from hetjax.repro import check as check_lib
from hetjax.repro import compare as compare_lib
from hetjax.repro import platforms as platforms_lib


LAYOUTS = "fsdp=8; fsdp=4,tensor=2; pipeline=2"  # each divides tiny's 2 kv heads


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m hetjax.repro", description=__doc__,
                           example=f"python -m hetjax.repro check --config tiny --layouts {LAYOUTS!r}\n"
                                   "python -m hetjax.repro compare runs/a runs/b")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="compare the fingerprints of two run directories")
    c.add_argument("run_a")
    c.add_argument("run_b")
    k = sub.add_parser("check", help="train one config under several layouts and compare them",
                       epilog="Other arguments --config.KEY=VALUE override the config for every layout.")
    k.add_argument("--config", required=True)
    k.add_argument("--layouts", default=LAYOUTS,
                   help="';'-separated layouts, each 'axis=size,...' or 'islands=N'")
    k.add_argument("--out", default="runs/repro_check", help="a new directory for the runs")
    k.add_argument("--steps", type=int, default=20)
    k.add_argument("--devices", type=int, default=8,
                   help="virtual CPU devices of a layout with an axis left to fill (CPU only)")
    k.add_argument("--fingerprint-every", type=int, default=10)
    g = sub.add_parser("platforms", help="train on CPU and on this machine's GPU from one set of initial "
                       "weights and compare", epilog="Other arguments --config.KEY=VALUE override the config.")
    g.add_argument("--config", required=True)
    g.add_argument("--platforms", default="cpu,gpu", help="two of cpu, cuda, rocm, gpu (this machine's)")
    g.add_argument("--out", default="runs/repro_platforms", help="a new directory for the runs")
    g.add_argument("--steps", type=int, default=20)
    g.add_argument("--fingerprint-every", type=int, default=10)
    i = sub.add_parser("init", help="save a config's initial weights as checkpoint 0 (for init_from)")
    i.add_argument("--config", required=True)
    i.add_argument("--out", required=True)
    for q in (c, k, g):
        default = platforms_lib.PLATFORM_RTOL if q is g else compare_lib.LOSS_RTOL
        norm_default = platforms_lib.PLATFORM_NORM_RTOL if q is g else compare_lib.NORM_RTOL
        q.add_argument("--rtol", type=float, default=default,
                       help="largest allowed relative loss gap (default %(default)g)")
        q.add_argument("--norm-rtol", type=float, default=norm_default,
                       help="largest allowed relative gap of a tensor's norm (default %(default)g)")
    c.add_argument("--plot", default=None, help="PNG of both loss curves (default RUN_B/compare.png)")
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        _check_numbers(args)
        if args.command == "compare":
            if rest:
                p.error(f"unrecognized arguments: {' '.join(rest)}")
            report = compare_lib.compare(args.run_a, args.run_b, args.rtol, args.norm_rtol)
            print(compare_lib.describe(report))
            if report.steps:
                compare_lib.plot_or_say_why_not(args.run_a, args.run_b, args.plot or Path(args.run_b) / "compare.png")
            return report.code
        overrides = cli.parse_command_line(["--config", args.config, *rest], flags=()).overrides
        if args.command == "init":
            print(f"initial weights saved in {platforms_lib.save_initial(args.config, overrides, args.out)}")
            return 0
        if args.command == "platforms":
            names = platforms_lib.parse_platforms(args.platforms)
            return platforms_lib.compare_platforms(args.config, overrides, args.out, names, steps=args.steps,
                                                   fingerprint_every=args.fingerprint_every, rtol=args.rtol,
                                                   norm_rtol=args.norm_rtol)
        code, _ = check_lib.check(args.config, args.layouts, args.out, overrides, steps=args.steps,
                                  devices=args.devices, fingerprint_every=args.fingerprint_every,
                                  rtol=args.rtol, norm_rtol=args.norm_rtol)
        return code
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check_numbers(args) -> None:
    """A tolerance that is negative or not finite would fail (or pass) every comparison, and
    a count below 1 compare nothing: refused, naming the flag, before anything trains."""
    if args.command != "init":
        compare_lib.check_tolerances(args.rtol, args.norm_rtol, names=("--rtol", "--norm-rtol"))
    for flag in ("steps", "devices", "fingerprint_every"):
        if getattr(args, flag, 1) < 1:
            raise config_lib.ConfigError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be at least 1")


if __name__ == "__main__":
    sys.exit(main())
