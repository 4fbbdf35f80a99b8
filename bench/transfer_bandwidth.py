"""Each transfer backend's throughput for a 256 MiB sharded array between two
processes, against a raw loopback TCP copy of the same bytes over the same number
of streams, measured in the same run. Last line: host / raw (target >= 0.9).

    python -m bench.transfer_bandwidth [--mib 256] [--streams 2] [--iters 3]
"""

import sys

from hetjax.transfer import probe


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:  # the options are the probe's
        print(__doc__.strip() + "\n\nOptions: those of python -m hetjax.transfer.probe (its --help).")
        return
    rows = {r["backend"]: r for r in probe.main(["--mib", "256", "--backends", "raw,host,direct"] + argv)}
    if "direct" in rows:
        print(f"direct / raw: {rows['direct']['gbps'] / rows['raw']['gbps']:.3f}")
    print(f"host / raw: {rows['host']['gbps'] / rows['raw']['gbps']:.3f}")


if __name__ == "__main__":
    main()
