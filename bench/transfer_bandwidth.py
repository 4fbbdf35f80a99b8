"""Each transfer backend's throughput for a 256 MiB sharded array between two
processes, against a raw loopback TCP copy of the same bytes over the same number
of streams, measured in the same run. Last line: host / raw (target >= 0.9).

Before it, each one's CPU time per GB moved: this machine's busy cores (/proc/stat, both
processes of the local probe) over its GB/s. When raw already keeps every core busy, as
on a small machine, host / raw cannot pass raw's CPU per GB over host's: whatever host
does beyond the copy (its per-chunk checksums) takes cores from the copy itself.

    python -m bench.transfer_bandwidth [--mib 256] [--streams 2] [--iters 10]
"""

import os
import sys

from hetjax.transfer import probe


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:  # the options are the probe's
        print(__doc__.strip() + "\n\nOptions: those of python -m hetjax.transfer.probe (its --help).")
        return
    defaults = ["--mib", "256", "--iters", "10", "--backends", "raw,host,direct"]
    rows = {r["backend"]: r for r in probe.main(defaults + argv)}
    if all(r["cores_busy"] is not None for r in rows.values()):
        cpu = {k: r["cores_busy"] / r["gbps"] for k, r in rows.items()}
        print(f"CPU seconds per GB moved ({os.cpu_count()} cores here): "
              + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())
              + f"; raw / host: {cpu['raw'] / cpu['host']:.3f}")
    if "direct" in rows:
        print(f"direct / raw: {rows['direct']['gbps'] / rows['raw']['gbps']:.3f}")
    print(f"host / raw: {rows['host']['gbps'] / rows['raw']['gbps']:.3f}")


if __name__ == "__main__":
    main()
