"""A sending island in its own process, for the two-process transfer tests.

Prints its endpoint addresses as one JSON line, reads one JSON line of orders
({"backend", "peers", "timeout_s", "cases": [{shape, dtype, seed, mesh, axes, spec, dst}]}),
sends each case's array (random bits from its seed) with tag "case{k}", prints
"sent" and then waits for "exit" (or to be killed).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from hetjax.transfer import Layout, LinkConfig, open_endpoint  # noqa: E402

BITS = {"float32": np.uint32, "bfloat16": np.uint16, "int32": np.uint32}  # each case dtype's bits


def case_array(case):
    """The same random bits the test computes from the case."""
    bits = BITS[case["dtype"]]
    values = np.random.default_rng(case["seed"]).integers(0, 2**31, size=case["shape"]).astype(bits)
    return values.view(jax.numpy.dtype(case["dtype"]))


def main():
    backend = sys.argv[1]
    ep = open_endpoint(LinkConfig(backend=backend, timeout_s=float(sys.argv[2])))
    print(json.dumps(ep.addresses), flush=True)
    orders = json.loads(sys.stdin.readline())
    peers = {int(k): tuple(v) for k, v in orders["peers"].items()}
    handles = []
    for k, case in enumerate(orders["cases"]):
        n = int(np.prod(case["mesh"]))
        mesh = Mesh(np.array(jax.devices()[:n]).reshape(case["mesh"]), tuple(case["axes"]))
        spec = tuple(tuple(e) if isinstance(e, list) else e for e in case["spec"])
        x = jax.device_put(case_array(case), NamedSharding(mesh, P(*spec)))
        handles.append(ep.send(x, f"case{k}", Layout.from_json(case["dst"]), peers=peers))
    for h in handles:
        h.wait()
    print("sent", flush=True)
    sys.stdin.readline()
    ep.close()
    os._exit(0)  # a direct-backend server may hold threads; do not wait for them


if __name__ == "__main__":
    main()
