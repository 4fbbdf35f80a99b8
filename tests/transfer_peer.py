"""An island's process for the multi-process transfer tests.

Messages to the test are lines of JSON after PREFIX on stdout; orders come as JSON
lines on stdin.

`transfer_peer.py send BACKEND TIMEOUT_S`: a one-process sending island with 4 CPU
devices. Says its endpoint addresses, then for each line of orders ({"peers",
"cases": [{tag, shape, dtype, seed, src, dst}]}, src and dst as Layout JSON) sends
each case's array (random bits from its seed) and says "sent"; stops at "exit"
(or when killed).

`transfer_peer.py recv PROCESS_ID PORT TIMEOUT_S`: process PROCESS_ID of a
two-process receiving island (its own jax.distributed world, 2 CPU devices each,
gloo collectives). Says {"host": addresses, "direct": addresses}, then for each line of orders ({"backend", "peers", "cases"}) posts a receive for
every case, waits for them in order (a fan-out is a collective: both processes must
run them in the same order), checks the shards this process holds against the seed's bits and says,
per case: {"tag", "ok", "shards", "wire_bytes"}; stops at "exit".

`transfer_peer.py lowfiles NOFILE TIMEOUT_S`: a one-process receiving island (4 CPU
devices, `host`) limited to NOFILE open files. Says its addresses; then per line of
orders: {"hog": true} opens files until none is left and says how many ("release" closes
them), or receives every case of {"peers", "cases"} as `recv` does and says
{"tag", "ok", "refused", "accept_errors"} per case.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetjax.compile.backend import with_cpu_device_count  # noqa: E402 - imports no jax

if __name__ == "__main__":  # a peer process; a test that imports this module keeps its own
    count = 2 if sys.argv[1:2] == ["recv"] else 4
    os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), count)
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from hetjax.transfer import Layout, LinkConfig, open_endpoint  # noqa: E402

PREFIX = "peer: "
BITS = {"float32": np.uint32, "bfloat16": np.uint16, "int32": np.uint32}  # each case dtype's bits


def case_array(case):
    """The same random bits the test computes from the case."""
    bits = BITS[case["dtype"]]
    values = np.random.default_rng(case["seed"]).integers(0, 2**31, size=case["shape"]).astype(bits)
    return values.view(jax.numpy.dtype(case["dtype"]))


def shard_bits_match(y, want) -> bool:
    """Every shard of `y` this process holds, replicas included, has the bits of its
    block of `want` (an array of unsigned integers)."""
    return all(np.array_equal(np.asarray(s.data).view(want.dtype), want[s.index]) for s in y.addressable_shards)


def sharding_on(layout: Layout, devices) -> NamedSharding:
    """The layout's NamedSharding over the first devices, in order."""
    grid = np.array(devices[:int(np.prod(layout.mesh_shape))]).reshape(layout.mesh_shape)
    return NamedSharding(Mesh(grid, layout.axis_names), P(*layout.spec))


def say(message) -> None:
    """One protocol line: others on stdout (gloo prints there) are not for the test."""
    print(PREFIX + json.dumps(message), flush=True)


def orders():
    """Each line of orders from the test until "exit" (or its stdin closes)."""
    while (line := sys.stdin.readline().strip()) not in ("", "exit"):
        yield json.loads(line)


def peers_of(order):
    return {int(k): tuple(v) for k, v in order["peers"].items()}


def send(backend, timeout_s):
    ep = open_endpoint(LinkConfig(backend=backend, timeout_s=timeout_s))
    say(ep.addresses)
    for order in orders():
        handles = []
        for case in order["cases"]:
            x = jax.device_put(case_array(case), sharding_on(Layout.from_json(case["src"]), jax.devices()))
            handles.append(ep.send(x, case["tag"], Layout.from_json(case["dst"]), peers=peers_of(order)))
        for h in handles:
            h.wait()
        say("sent")
    ep.close()


def recv(process_id, port, timeout_s):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    eps = {b: open_endpoint(LinkConfig(backend=b, timeout_s=timeout_s)) for b in ("host", "direct")}
    say({b: ep.addresses for b, ep in eps.items()})
    for order in orders():
        ep = eps[order["backend"]]
        posted = []  # all receives in flight at once, as a pipeline would have them
        for case in order["cases"]:
            dst = Layout.from_json(case["dst"])
            sh = sharding_on(dst, jax.devices())
            assert Layout.of(sh) == dst, (Layout.of(sh), dst)  # the test placed the processes right
            like = jax.ShapeDtypeStruct(tuple(case["shape"]), case["dtype"], sharding=sh)
            posted.append((case, sh, ep.recv(case["tag"], like, Layout.from_json(case["src"]), peers=peers_of(order))))
        for case, sh, h in posted:  # in the same order in both processes: the fan-out is a collective
            y, want = h.wait(), case_array(case).view(BITS[case["dtype"]])
            say({"tag": case["tag"], "ok": y.sharding == sh and shard_bits_match(y, want),
                 "shards": len(y.addressable_shards), "wire_bytes": h.wire_bytes})
    for ep in eps.values():
        ep.close()


def lowfiles(nofile, timeout_s):
    import resource
    jax.devices()  # the runtime's own files first
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    ep = open_endpoint(LinkConfig(backend="host", timeout_s=timeout_s))
    say(ep.addresses)
    hog = []
    for order in orders():
        if order.get("hog"):
            try:
                while True:
                    hog.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                say(len(hog))
        elif order.get("release"):
            [os.close(f) for f in hog]
            hog.clear()
            say("released")
        else:
            for case in order["cases"]:
                dst = Layout.from_json(case["dst"])
                sh = sharding_on(dst, jax.devices())
                like = jax.ShapeDtypeStruct(tuple(case["shape"]), case["dtype"], sharding=sh)
                y = ep.recv(case["tag"], like, Layout.from_json(case["src"]), peers=peers_of(order)).wait()
                say({"tag": case["tag"], "ok": shard_bits_match(y, case_array(case).view(BITS[case["dtype"]])),
                     "refused": ep.refused, "accept_errors": ep.accept_errors})
    ep.close()


if __name__ == "__main__":
    if sys.argv[1] == "send":
        send(sys.argv[2], float(sys.argv[3]))
    elif sys.argv[1] == "lowfiles":
        lowfiles(int(sys.argv[2]), float(sys.argv[3]))
    else:
        recv(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    os._exit(0)  # a direct-backend server may hold threads; do not wait for them
