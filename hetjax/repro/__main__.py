"""`python -m hetjax.repro compare RUN_A RUN_B` and `python -m hetjax.repro check ...`.

Exit status: 0 within tolerance (or bit-identical), 1 out of tolerance or a run
failed, 2 a usage error, 3 the comparison is void (different data or initial weights).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetjax import config as config_lib
from hetjax.repro import check as check_lib
from hetjax.repro import compare as compare_lib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hetjax.repro", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="compare the fingerprints of two run directories")
    c.add_argument("run_a")
    c.add_argument("run_b")
    k = sub.add_parser("check", help="train one config under several layouts and compare them",
                       epilog="Other arguments --config.KEY=VALUE override the config for every layout.")
    k.add_argument("--config", required=True)
    k.add_argument("--layouts", default="fsdp=8; fsdp=2,tensor=4; pipeline=2",
                   help="';'-separated layouts, each 'axis=size,...' or 'islands=N'")
    k.add_argument("--out", default="runs/repro_check", help="a new directory for the runs")
    k.add_argument("--steps", type=int, default=20)
    k.add_argument("--devices", type=int, default=8,
                   help="virtual CPU devices of a layout with an axis left to fill (CPU only)")
    k.add_argument("--fingerprint-every", type=int, default=10)
    for q in (c, k):
        q.add_argument("--rtol", type=float, default=compare_lib.LOSS_RTOL,
                       help="largest allowed relative loss gap (default %(default)g)")
        q.add_argument("--norm-rtol", type=float, default=compare_lib.NORM_RTOL,
                       help="largest allowed relative gap of a tensor's norm (default %(default)g)")
    c.add_argument("--plot", default=None, help="PNG of both loss curves (default RUN_B/compare.png)")
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "compare":
            if rest:
                p.error(f"unrecognized arguments: {' '.join(rest)}")
            report = compare_lib.compare(args.run_a, args.run_b, args.rtol, args.norm_rtol)
            print(compare_lib.describe(report))
            if report.steps:
                path = compare_lib.plot(args.run_a, args.run_b, args.plot or Path(args.run_b) / "compare.png")
                print(f"plot: {path}")
            return report.code
        overrides = config_lib.parse_command_line(["--config", args.config, *rest], flags=()).overrides
        code, _ = check_lib.check(args.config, args.layouts, args.out, overrides, steps=args.steps,
                                  devices=args.devices, fingerprint_every=args.fingerprint_every,
                                  rtol=args.rtol, norm_rtol=args.norm_rtol)
        return code
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
