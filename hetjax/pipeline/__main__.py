"""Prints schedules' timelines: `python -m hetjax.pipeline --stages 4 --microbatches 8
[--schedule 1f1b] [--virtual-stages 2] [--split-backward] [--png timeline.png]`; without
--schedule, every schedule, and the interleaved ones with --virtual-stages (default 2) chunks
per stage, these also in the order each island runs them (the cross-island pipeline's
schedule); --split-backward: every schedule in each island's order with its backwards split
into input- and weight-gradient parts (config.pipeline.split_backward), beside the unsplit one
(with --png, drawn too: PATH_islands_split.png)."""

import os
import sys

from hetjax import cli
from hetjax.errors import ConfigError
from hetjax.pipeline.schedule import (KINDS, VIRTUAL_KINDS, island_orders, make_schedule, plot, plot_islands,
                                      timeline)


# make_schedule's errors in this command's options, not the config's.
OPTION_NAMES = {"schedule": "--schedule {}", "stages": "--stages {}", "microbatches": "--microbatches {}",
                "virtual": "--virtual-stages {}"}


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m hetjax.pipeline", description=__doc__.split("`")[0].strip(),
                                example="python -m hetjax.pipeline --stages 4 --microbatches 8 --schedule 1f1b "
                                        "--png timeline.png")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=KINDS, help="one schedule (default: every one)")
    parser.add_argument("--virtual-stages", type=int, help="chunks of layers per stage (default: 1 with "
                        "--schedule, else 2 for the interleaved variants)")
    parser.add_argument("--split-backward", action="store_true",
                        help="also each island's order with split backwards (config.pipeline.split_backward)")
    parser.add_argument("--png", help="also write a Gantt chart to this file (matplotlib)")
    return cli.run_main(lambda: draw(parser.parse_args(argv)))


def draw(args) -> int:
    """Prints (and with --png draws) the schedules `args` asks for."""
    if args.virtual_stages is not None and args.virtual_stages < 1:
        raise ConfigError(f"--virtual-stages={args.virtual_stages}: must be at least 1 (1: no interleaving)")
    if args.schedule:
        wanted = [(args.schedule, args.virtual_stages or 1)]
    else:
        V = args.virtual_stages or 2
        wanted = [(k, 1) for k in KINDS] + ([(k, V) for k in VIRTUAL_KINDS] if V > 1 else [])
        if 0 < args.microbatches < args.stages:  # the others are still worth drawing
            print(f"(1F1B schedules left out: --microbatches {args.microbatches} is below --stages "
                  f"{args.stages}, and 1F1B never fills such a pipeline; gpipe is drawn)\n")
            wanted = [(k, v) for k, v in wanted if not k.startswith("1f1b")]
    schedules = [make_schedule(k, args.stages, args.microbatches, v, OPTION_NAMES) for k, v in wanted]
    if args.png:
        cli.need("matplotlib", "plot", "--png")
    for schedule in schedules:
        print(timeline(schedule), end="\n\n")
        if schedule.virtual > 1 or args.split_backward:
            print(island_orders(schedule), end="\n\n")
        if args.split_backward:
            print(island_orders(schedule, split=True), end="\n\n")
        if args.png:
            # Several schedules: one file each, named after the schedule.
            stem, ext = os.path.splitext(args.png)
            ext = ext or ".png"  # matplotlib's default, said so in the path printed
            path = stem + ext if len(schedules) == 1 else f"{stem}_{schedule.kind}_v{schedule.virtual}{ext}"
            plot(schedule, path)
            print(f"wrote {path}")
            if args.split_backward:  # and the islands' split order beside it
                islands = f"{os.path.splitext(path)[0]}_islands_split{ext}"
                plot_islands(schedule, islands, split=True)
                print(f"wrote {islands}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
