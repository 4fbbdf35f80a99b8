"""Prints a schedule's timeline: `python -m hetjax.pipeline --stages 4 --microbatches 8
--schedule 1f1b [--png timeline.png]`."""

import argparse
import sys

from hetjax.errors import ConfigError
from hetjax.pipeline.schedule import KINDS, make_schedule, plot, timeline


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetjax.pipeline", description=__doc__)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=KINDS, default="1f1b")
    parser.add_argument("--png", help="also write a Gantt chart to this file (matplotlib)")
    args = parser.parse_args(argv)
    try:
        schedule = make_schedule(args.schedule, args.stages, args.microbatches)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(timeline(schedule))
    if args.png:
        plot(schedule, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
