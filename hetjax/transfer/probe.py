"""Measures each backend's bandwidth and latency between two processes.

    python -m hetjax.transfer.probe [--mib 64] [--streams 2] [--iters 3] [--backends raw,host,direct]
                                    [--bind 127.0.0.1] [--nic 10.0.0.1,10.0.1.1]

Across two machines (both with the same $HETJAX_TRANSFER_SECRET):

    A$ python -m hetjax.transfer.probe --serve --bind 10.0.0.1 --port 5555
    B$ python -m hetjax.transfer.probe --peer 10.0.0.1:5555 --bind 10.0.0.2 [--mib ...]

The peer (B, or this process when run alone) receives and prints the table; the
server (A, or a child this process starts on the same machine with 4 virtual CPU
devices) sends, with the parameters the peer sends it. Both talk over one control
connection that proves the job's secret like every transfer stream does. `raw` is a
plain TCP copy of the same bytes over the same number of streams into a buffer that was
allocated and written before the timing starts: the ceiling for `host`. Bandwidth: a (MiB) float32 array sharded over the server's devices into the
same sharding on the peer's, timed from "go" to the last byte on the peer's devices.
Latency: the same for a tiny array.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

from hetjax.errors import ConfigError
from hetjax.transfer import link, wire
from hetjax.transfer.link import TransferError, TransferTimeout

_CONTROL = 9  # frame kind of control messages (the host backend's frames, a kind of its own)


class Control:
    """The probe's control channel: JSON messages both ways on an authenticated socket;
    a peer silent for timeout_s raises TransferTimeout naming it."""

    def __init__(self, sock: socket.socket, peer: str, timeout_s: float):
        sock.settimeout(timeout_s)
        self.sock, self.peer, self.timeout_s = sock, peer, timeout_s

    def send(self, **msg) -> None:
        wire.send_frame(self.sock, _CONTROL, msg, self.peer)

    def recv(self) -> dict:
        try:
            kind, msg = wire.read_frame(self.sock, self.peer, idle_ok=False, timeout_s=self.timeout_s)
        except TransferTimeout as e:
            raise TransferTimeout(f"probe: {self.peer} sent nothing for {self.timeout_s:g} s (--timeout): {e}") from None
        if kind != _CONTROL:
            raise TransferError(f"probe: {self.peer} sent a frame of kind {kind}, not a probe control message")
        return msg

    def close(self) -> None:
        self.sock.close()


def _array(nbytes, devices, multiple):
    """The probe array for `nbytes`, sharded over `devices`; rows a multiple of
    `multiple` (both sides' device counts) so both sides agree on its shape."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    cols = 1024 if nbytes >= 4096 * multiple else 1
    rows = max(multiple, nbytes // 4 // cols // multiple * multiple)
    sh = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    return jax.ShapeDtypeStruct((rows, cols), jnp.float32, sharding=sh)


def _layout(n):
    from hetjax.transfer.plan import Layout
    return Layout((n,), ("x",), (0,) * n, ("x",))


def _link(args, backend, streams):
    from hetjax.transfer import LinkConfig
    nic = tuple(a for a in args.nic.split(",") if a)
    return LinkConfig(backend=backend, streams=streams, bind_address=args.bind, nic_addresses=nic,
                      timeout_s=args.timeout)


# -- the sending side ------------------------------------------------------------------


def serve(args) -> None:
    """Waits (without limit) for one peer that proves the secret, then sends for each
    backend it asks; from then on a silent peer raises TransferTimeout."""
    secret = _link(args, "host", 1).secret()
    listener = socket.create_server((args.bind, args.port))
    print(f"hetjax probe: waiting for a peer on {link.address(args.bind, listener.getsockname()[1])}", flush=True)
    while True:  # a refused or silent caller does not end the wait
        conn, addr = listener.accept()
        peer = link.address(addr[0], addr[1])
        conn.settimeout(args.timeout)
        try:
            if wire.authenticate(conn, secret, peer):
                break
        except (TransferError, OSError) as e:
            print(f"hetjax probe: dropped {peer}: {e}", file=sys.stderr, flush=True)
        conn.close()
    listener.close()
    ctl = Control(conn, peer, args.timeout)
    import jax
    params = ctl.recv()
    ctl.send(devices=len(jax.devices()))
    while "backend" in (msg := ctl.recv()):
        _send_backend(ctl, msg, params, args)
    ctl.close()


def _send_backend(ctl: Control, msg: dict, params: dict, args) -> None:
    """One backend: our addresses out, then one transfer per "go" until "done"."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from hetjax.transfer import open_endpoint
    backend, streams, n_dst = msg["backend"], params["streams"], params["dst_devices"]
    multiple = math.lcm(len(jax.devices()), n_dst)
    sizes = {"bw": params["mib"] << 20, "lat": 4}
    arrays = {k: jax.jit(lambda s=s: jnp.ones(s.shape, s.dtype), out_shardings=s.sharding)()
              for k, s in ((k, _array(n, jax.devices(), multiple)) for k, n in sizes.items())}
    peer_addresses = tuple(msg["addresses"])
    if backend == "raw":
        ctl.send(addresses=[])
        payload = {k: np.asarray(v).reshape(-1).view(np.uint8) for k, v in arrays.items()}
        secret, socks = _link(args, "host", streams).secret(), []
        while "go" in (msg := ctl.recv()):
            if not socks:  # here, not earlier: the peer accepts once it has sent "go"
                socks = [wire.connect(peer_addresses[0], secret, args.timeout) for _ in range(streams)]
            parts = np.array_split(payload[msg["go"]], len(socks))
            _in_threads([(s.sendall, memoryview(p)) for s, p in zip(socks, parts)])
            ctl.send(sent=msg["go"])
        [s.close() for s in socks]
        return
    ep = open_endpoint(_link(args, backend, streams))
    try:
        ctl.send(addresses=list(ep.addresses))
        while "go" in (msg := ctl.recv()):
            ep.send(arrays[msg["go"]], msg["tag"], _layout(n_dst), peers={0: peer_addresses}).wait()
            ctl.send(sent=msg["tag"])  # after the receiver's acknowledgements
    finally:
        ep.close()


# -- the receiving side ----------------------------------------------------------------


def _raw_receive(listener, streams, buf, conns, secret, timeout_s):
    """Receives len(buf) bytes into `buf` over `streams` authenticated connections."""
    import numpy as np
    while len(conns) < streams:
        conn, addr = listener.accept()
        conn.settimeout(timeout_s)
        if not wire.authenticate(conn, secret, link.address(*addr[:2])):
            raise TransferError(f"probe: raw stream from {link.address(*addr[:2])} did not prove the job's secret")
        conns.append(conn)
    parts = np.array_split(buf, streams)
    _in_threads([(wire.recv_into, c, memoryview(p), f"raw stream {i} of the server")
                 for i, (c, p) in enumerate(zip(conns, parts))])
    return buf


def _in_threads(calls) -> None:
    """Runs every (function, *args) at once, a thread each, and raises the first error: a
    raw stream that failed must not pass for a fast one."""
    errors = []

    def run(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
            errors.append(e)
    threads = [threading.Thread(target=run, args=call) for call in calls]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise errors[0]


def _busy_seconds() -> float | None:
    """CPU seconds this machine's cores have been busy since boot (Linux /proc/stat: all
    but idle and iowait), or None where that is not readable."""
    try:
        with open("/proc/stat") as f:
            jiffies = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")


def _timed(kind: str, times: dict, busy: list, copy) -> None:
    """Runs copy(), adding its seconds to times[kind] and, for a bandwidth copy, the
    machine's busy CPU seconds before and after it to busy."""
    cpu, start = _busy_seconds(), time.perf_counter()
    copy()
    times[kind].append(time.perf_counter() - start)
    if kind == "bw":
        busy.append((cpu, _busy_seconds()))


def measure(ctl: Control, backend: str, args, n_src: int) -> dict:
    """{'gbps': bytes/s / 1e9 (median), 'latency_ms': median, 'cores_busy': this machine's
    busy cores over the timed bandwidth copies (None off Linux, or when they took under 20
    jiffies)} for one backend. Both processes of a local probe count, so cores_busy / gbps
    is the CPU time a GB costs."""
    import jax
    from hetjax.transfer import open_endpoint
    devices = jax.devices()[:args.dst_devices]
    multiple = math.lcm(n_src, len(devices))
    likes = {"bw": _array(args.mib << 20, devices, multiple), "lat": _array(4, devices, multiple)}
    nbytes = {k: like.size * 4 for k, like in likes.items()}
    times = {"bw": [], "lat": []}
    busy = []  # CPU seconds busy during each bandwidth copy
    order = ["bw"] * (args.iters + 1) + ["lat"] * (args.iters + 1)
    if backend == "raw":
        secret = _link(args, "host", 1).secret()
        listener = socket.create_server((args.bind, 0))
        listener.settimeout(args.timeout)
        ctl.send(backend=backend, addresses=[link.address(args.bind, listener.getsockname()[1])])
        ctl.recv()
        conns = []
        # The ceiling, as a plain socket program gets it: one buffer per size, written once
        # before timing starts (no page faults), reused.
        import numpy as np
        from hetjax.transfer.buffers import aligned_empty
        bufs = {k: aligned_empty((n,), np.uint8) for k, n in nbytes.items()}
        for buf in bufs.values():
            buf.fill(0)
        try:
            for k in order:
                _timed(k, times, busy, lambda: (
                    ctl.send(go=k), _raw_receive(listener, args.streams, bufs[k], conns, secret, args.timeout)))
                ctl.recv()
            ctl.send(done=True)
        except socket.timeout:
            raise TransferTimeout(f"probe: the server at {ctl.peer} opened no raw stream within {args.timeout:g} s") from None
        finally:
            [c.close() for c in conns]
            listener.close()
    else:
        ep = open_endpoint(_link(args, backend, args.streams))
        try:
            ctl.send(backend=backend, addresses=list(ep.addresses))
            server_addresses = tuple(ctl.recv()["addresses"])
            for i, k in enumerate(order):
                h = ep.recv(f"{k}{i}", likes[k], _layout(n_src), peers={0: server_addresses})
                _timed(k, times, busy, lambda: (ctl.send(go=k, tag=f"{k}{i}"), h.wait().block_until_ready()))
                h = None  # the received array goes, as a training step's would
                ctl.recv()  # the sender had its acknowledgements
            ctl.send(done=True)
        finally:
            ep.close()
    bw = statistics.median(times["bw"][1:])  # the first of each is a warm-up
    timed = sum(times["bw"][1:])
    # /proc/stat counts in jiffies: under 20 of them per core the figure says nothing.
    cores = (None if busy[0][0] is None or timed < 20 / os.sysconf("SC_CLK_TCK")
             else sum(b - a for a, b in busy[1:]) / timed)
    return {"backend": backend, "streams": args.streams, "mib": nbytes["bw"] / 2**20,
            "gbps": nbytes["bw"] / bw / 1e9, "latency_ms": statistics.median(times["lat"][1:]) * 1e3,
            "cores_busy": cores}


def probe(address: str, args) -> list[dict]:
    """Connects to the server at `address` and measures each of args.backends."""
    secret = _link(args, "host", 1).secret()
    ctl = Control(wire.connect(address, secret, args.timeout), address, args.timeout)
    try:
        import jax
        n_dst = min(args.dst_devices, len(jax.devices()))
        args = argparse.Namespace(**dict(vars(args), dst_devices=n_dst))
        ctl.send(mib=args.mib, streams=args.streams, iters=args.iters, dst_devices=n_dst)
        n_src = ctl.recv()["devices"]
        rows = [measure(ctl, b, args, n_src) for b in args.backends.split(",")]
        ctl.send(finished=True)
        return rows
    finally:
        ctl.close()


def _local_server(args) -> tuple[subprocess.Popen, str]:
    """A `--serve` child on this machine (4 virtual CPU devices) and its address."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "hetjax.transfer.probe", "--serve", "--bind", args.bind, "--port", "0",
           "--nic", args.nic, "--timeout", str(args.timeout)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline()
    if " on " not in line:
        child.wait(timeout=args.timeout)
        raise TransferError(f"probe: the local server exited ({child.returncode}) before listening; see its stderr")
    return child, line.rsplit(" on ", 1)[1].strip()


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--backends", default="raw,host,direct")
    p.add_argument("--bind", default="127.0.0.1", help="this side's address (control, raw and data endpoints)")
    p.add_argument("--nic", default="", help="this side's NIC addresses for the data endpoints, comma-separated")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a silent peer is waited for")
    p.add_argument("--dst-devices", type=int, default=4, help="the peer's devices the arrays land on")
    p.add_argument("--serve", action="store_true", help="send, for the one peer that connects")
    p.add_argument("--port", type=int, default=0, help="--serve: the control port (0: any free one)")
    p.add_argument("--peer", default="", help="receive from the server at HOST:PORT")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    for field in ("mib", "iters", "streams", "dst_devices"):
        if getattr(args, field) < 1:
            raise ConfigError(f"--{field.replace('_', '-')}={getattr(args, field)}: must be at least 1")
    if args.serve:
        return serve(args)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.dst_devices}")
    if args.peer:
        rows = probe(args.peer, args)
    else:
        os.environ.setdefault(link.LinkConfig.secret_env, os.urandom(16).hex())  # the child inherits it
        child, address = _local_server(args)
        try:
            rows = probe(address, args)
            child.wait(timeout=args.timeout)
        finally:
            if child.poll() is None:
                child.kill()
    print(f"{'backend':8} {'streams':>7} {'MiB':>6} {'GB/s':>7} {'latency ms':>10} {'cores busy':>10}")
    for r in rows:
        cores = "n/a" if r["cores_busy"] is None else f"{r['cores_busy']:.2f}"
        print(f"{r['backend']:8} {r['streams']:7d} {r['mib']:6.0f} {r['gbps']:7.2f} {r['latency_ms']:10.2f} "
              f"{cores:>10}")
    return rows


def cli(argv=None) -> int:
    """The command: 0 after the table; 2 after `error: ...` for bad input, 1 for a link
    that failed (a silent peer, a refused secret), without a traceback."""
    from hetjax import cli as cli_lib

    def run():
        main(argv)
        return 0
    return cli_lib.run_main(run)


if __name__ == "__main__":
    sys.exit(cli())
