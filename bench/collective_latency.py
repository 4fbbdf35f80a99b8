"""One all-reduce between processes against the same all-reduce between the devices of
one process, with nothing else running: what a collective of a multi-process CPU step
costs before any waiting for peers that are still computing.

    python -m bench.collective_latency [--processes 4] [--mib 3] [--iters 30]

Each of --processes processes holds one virtual CPU device, in one jax.distributed
world on this machine with gloo collectives, as `launch.local --processes` starts a
one-mesh job. The baseline is one process holding --processes devices. An array of
--mib MiB (float32) per device is summed over every device by a jitted psum, timed
--iters times after a warm-up. 3 MiB is one layer's gradient of configs/medium_hetero.py's
model, which a data-parallel step all-reduces once per layer. The last line is one
process's median time over the processes' median time (1.0: the processes cost nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from hetjax import cli
from hetjax.launch import local


def _worker(rank: int, world: int, devices: int, port: int, mib: float, iters: int) -> None:
    """Times the psum; prints {"median_ms", "min_ms"} as JSON on rank 0 (or alone)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    if world > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", world, rank, initialization_timeout=120)
    mesh = jax.make_mesh((devices * world,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    n = int(mib * 2**20) // 4
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")),
                                               np.ones((n * devices,), np.float32))
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    want = float(devices * world)
    got = total(x)  # compile, and check the sum once
    assert float(np.asarray(got.addressable_shards[0].data)[0]) == want
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}), flush=True)
    if world > 1:
        jax.distributed.shutdown()


def _run(world: int, devices: int, mib: float, iters: int, timeout_s: float) -> dict:
    """Starts `world` worker processes of `devices` devices each; rank 0's timings."""
    port = local.free_ports(1)[0]
    env = dict(local.device_env("cpu", devices), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-m", "bench.collective_latency", "--worker", str(rank),
                               "--world", str(world), "--devices", str(devices), "--port", str(port),
                               "--mib", str(mib), "--iters", str(iters)],
                              env=env, stdout=subprocess.PIPE, text=True) for rank in range(world)]
    deadline = time.monotonic() + timeout_s  # one limit for the whole world
    try:
        outs = [p.communicate(timeout=max(deadline - time.monotonic(), 0.0))[0] for p in procs]
    except subprocess.TimeoutExpired:
        hung = [rank for rank, p in enumerate(procs) if p.poll() is None]
        raise SystemExit(f"ranks {hung} did not finish within --timeout={timeout_s:g} s; raise --timeout "
                         f"on a loaded machine") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed (exit codes {[p.returncode for p in procs]}); see its stderr above")
    return json.loads(outs[0].strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                                example="python -m bench.collective_latency --processes 4 --mib 3")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--mib", type=float, default=3.0, help="MiB per device")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the workers are killed")
    for name in ("--worker", "--world", "--devices", "--port"):  # a worker's own, set by the bench
        parser.add_argument(name, type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker, args.world, args.devices, args.port, args.mib, args.iters)
        return 0
    for name in ("processes", "iters"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}={getattr(args, name)}: must be at least 1")
    if args.timeout <= 0:
        raise SystemExit(f"--timeout={args.timeout:g}: must be positive (seconds), e.g. --timeout 300")
    if args.mib * 2**20 < 4:
        raise SystemExit(f"--mib={args.mib:g}: must hold at least one float32 (4 bytes); use e.g. --mib 3")
    n = args.processes
    one = _run(1, n, args.mib, args.iters, args.timeout)
    many = _run(n, 1, args.mib, args.iters, args.timeout)
    print(f"psum of {args.mib:g} MiB per device over {n} devices, {args.iters} times:")
    print(f"  1 process ({n} devices):  median {one['median_ms']:.2f} ms, min {one['min_ms']:.2f} ms")
    print(f"  {n} processes (gloo):      median {many['median_ms']:.2f} ms, min {many['min_ms']:.2f} ms")
    print(f"1 process / {n} processes, median time: {one['median_ms'] / many['median_ms']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
