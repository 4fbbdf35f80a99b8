"""Measures each backend's bandwidth and latency between two processes.

    python -m hetjax.transfer.probe [--mib 64] [--streams 2] [--iters 3] [--backends raw,host,direct]
                                    [--bind 127.0.0.1] [--nic 10.0.0.1,10.0.1.1]

This process receives; it starts the sending process itself (4 virtual devices on
CPU). `raw` is a plain TCP copy of the same bytes over the same number of streams:
the ceiling for `host`. Bandwidth: a (MiB) float32 array sharded over the sender's
devices into the same sharding on the receiver's, timed from "go" to the last byte
on the receiver's devices. Latency: the same for a 4-byte array.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

SECRET_ENV = "HETJAX_TRANSFER_SECRET"


def _array(nbytes, devices):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    rows = max(len(devices), nbytes // 4 // 1024 // len(devices) * len(devices))
    sh = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    return jax.ShapeDtypeStruct((rows, 1024 if nbytes >= 4096 * len(devices) else 1), jnp.float32, sharding=sh)


def _child(args):
    """The sending process: one line of addresses out, then one transfer per "go"."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from hetjax.transfer import open_endpoint
    from hetjax.transfer.plan import Layout
    cfg = _link(args, args.backend if args.backend != "raw" else "host")
    sizes = {"bw": args.mib << 20, "lat": 4}
    arrays = {k: jax.jit(lambda s=s: jnp.ones(s.shape, s.dtype), out_shardings=s.sharding)()
              for k, s in ((k, _array(n, jax.devices())) for k, n in sizes.items())}
    if args.backend == "raw":
        print(json.dumps([]), flush=True)
        peer = json.loads(sys.stdin.readline())
        host, port = peer[0].rsplit(":", 1)
        socks = [socket.create_connection((host, int(port))) for _ in range(args.streams)]
        payload = {k: np.asarray(v).reshape(-1).view(np.uint8) for k, v in arrays.items()}
        while (line := sys.stdin.readline().strip()) not in ("", "exit"):
            data = payload[line.split()[0]]
            parts = np.array_split(data, len(socks))
            threads = [threading.Thread(target=s.sendall, args=(memoryview(p),)) for s, p in zip(socks, parts)]
            [t.start() for t in threads]
            [t.join() for t in threads]
        os._exit(0)
    ep = open_endpoint(cfg)
    print(json.dumps(ep.addresses), flush=True)
    peer = json.loads(sys.stdin.readline())
    while (line := sys.stdin.readline().strip()) not in ("", "exit"):
        kind, tag = line.split()
        x = arrays[kind]
        dst = Layout((args.dst_devices,), ("x",), (0,) * args.dst_devices, ("x",))
        ep.send(x, tag, dst, peers={0: tuple(peer)}).wait()
    os._exit(0)


def _link(args, backend):
    from hetjax.transfer import LinkConfig
    nic = tuple(a for a in args.nic.split(",") if a)
    return LinkConfig(backend=backend, streams=args.streams, bind_address=args.bind, nic_addresses=nic,
                      timeout_s=args.timeout)


def _raw_receive(listener, streams, nbytes, conns):
    import numpy as np
    from hetjax.transfer.core import aligned_empty
    while len(conns) < streams:
        conns.append(listener.accept()[0])
    buf = aligned_empty((nbytes,), np.uint8)  # fresh memory each time, as a receiver's would be
    parts = np.array_split(buf, streams)

    def fill(sock, part):
        view = memoryview(part)
        while len(view):
            view = view[sock.recv_into(view):]

    threads = [threading.Thread(target=fill, args=(c, p)) for c, p in zip(conns, parts)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return buf


def measure(backend: str, args) -> dict:
    """{'gbps': bytes/s / 1e9 (median), 'latency_ms': median} for one backend."""
    import jax
    from hetjax.transfer import open_endpoint
    from hetjax.transfer.plan import Layout
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "hetjax.transfer.probe", "--child", "--backend", backend,
           "--mib", str(args.mib), "--streams", str(args.streams), "--bind", args.bind, "--nic", args.nic,
           "--timeout", str(args.timeout), "--dst-devices", str(args.dst_devices)]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    child_addresses = tuple(json.loads(child.stdout.readline()))
    devices = jax.devices()[:args.dst_devices]
    likes = {"bw": _array(args.mib << 20, devices), "lat": _array(4, devices)}
    nbytes = {k: like.size * 4 for k, like in likes.items()}
    times = {"bw": [], "lat": []}
    try:
        if backend == "raw":
            listener = socket.create_server((args.bind, 0))
            child.stdin.write(json.dumps([f"{args.bind}:{listener.getsockname()[1]}"]) + "\n")
            child.stdin.flush()
            conns = []
            for k in ["bw"] * (args.iters + 1) + ["lat"] * (args.iters + 1):
                start = time.perf_counter()
                child.stdin.write(f"{k}\n")
                child.stdin.flush()
                buf = _raw_receive(listener, args.streams, nbytes[k], conns)
                jax.device_put(buf, devices[0]).block_until_ready()  # the same landing as `host` gets
                times[k].append(time.perf_counter() - start)
        else:
            ep = open_endpoint(_link(args, backend))
            child.stdin.write(json.dumps(ep.addresses) + "\n")
            child.stdin.flush()
            src = Layout((4,), ("x",), (0,) * 4, ("x",))
            for i, k in enumerate(["bw"] * (args.iters + 1) + ["lat"] * (args.iters + 1)):
                h = ep.recv(f"{k}{i}", likes[k], src, peers={0: child_addresses})
                start = time.perf_counter()
                child.stdin.write(f"{k} {k}{i}\n")
                child.stdin.flush()
                h.wait().block_until_ready()
                times[k].append(time.perf_counter() - start)
    finally:
        child.stdin.write("exit\n")
        child.stdin.close()
        child.wait(timeout=60)
        if backend != "raw":
            ep.close()  # after the sender had its acknowledgements
    bw = statistics.median(times["bw"][1:])  # the first of each is a warm-up
    return {"backend": backend, "streams": args.streams, "mib": nbytes["bw"] / 2**20,
            "gbps": nbytes["bw"] / bw / 1e9, "latency_ms": statistics.median(times["lat"][1:]) * 1e3}


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--backends", default="raw,host,direct")
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--nic", default="")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--dst-devices", type=int, default=4)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="host", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.child:
        return _child(args)
    os.environ.setdefault(SECRET_ENV, os.urandom(16).hex())  # both processes share it
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.dst_devices}")
    rows = [measure(b, args) for b in args.backends.split(",")]
    print(f"{'backend':8} {'streams':>7} {'MiB':>6} {'GB/s':>7} {'latency ms':>10}")
    for r in rows:
        print(f"{r['backend']:8} {r['streams']:7d} {r['mib']:6.0f} {r['gbps']:7.2f} {r['latency_ms']:10.2f}")
    return rows


if __name__ == "__main__":
    main()
