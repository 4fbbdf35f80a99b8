"""Two real processes (separate XLA runtimes): random cases per backend, the direct
backend's sharding trap, and a killed peer."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.transfer import Layout, LinkConfig, TransferTimeout, open_endpoint
from tests.transfer_peer import BITS, case_array

PEER = Path(__file__).with_name("transfer_peer.py")
SECRET = "two-process-secret-0123456789"


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("HETJAX_TRANSFER_SECRET", SECRET)


def start_peer(backend, timeout_s=30.0):
    env = dict(os.environ, HETJAX_TRANSFER_SECRET=SECRET)
    env.pop("XLA_FLAGS", None)
    child = subprocess.Popen([sys.executable, str(PEER), backend, str(timeout_s)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    return child, tuple(json.loads(child.stdout.readline()))


def random_cases(seed, n):
    """Sender meshes over its 4 devices; receiver meshes over our 8, other specs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        mesh = [(4,), (2, 2), (1, 4)][rng.integers(3)]
        axes = ("a", "b")[:len(mesh)]
        spec = [[None, "a"][rng.integers(2)], [None, axes[-1]][rng.integers(2)] if len(axes) > 1 else None]
        dst_mesh = [(8,), (2, 4), (4, 2)][rng.integers(3)]
        dst_axes = ("x", "y")[:len(dst_mesh)]
        dst_spec = [[None, dst_axes[-1]][rng.integers(2)], [None, "x"][rng.integers(2)]]
        out.append({"shape": [8 * int(rng.integers(1, 3)), 8], "dtype": ["float32", "bfloat16", "int32"][rng.integers(3)],
                    "seed": int(rng.integers(2**16)), "mesh": mesh, "axes": axes, "spec": spec,
                    "dst_mesh": dst_mesh, "dst_axes": dst_axes, "dst_spec": dst_spec})
    return out


def dst_sharding(case):
    devices = np.array(jax.devices()[::-1]).reshape(case["dst_mesh"])
    return NamedSharding(Mesh(devices, case["dst_axes"]), P(*case["dst_spec"]))


@pytest.mark.parametrize("backend", ["host", "direct"])
def test_random_cases_across_two_processes(backend):
    """The `direct` cases include sender and receiver shardings that differ: the trap
    where jax.experimental.transfer alone returns wrong data without an error."""
    cases = random_cases({"host": 1, "direct": 2}[backend], 3)
    cases[0].update(mesh=(4,), axes=("a",), spec=["a", None], dst_mesh=(2, 4), dst_axes=("x", "y"),
                    dst_spec=[None, "y"])  # rows split on one side, columns on the other: always different
    child, child_addresses = start_peer(backend)
    ep = open_endpoint(LinkConfig(backend=backend, timeout_s=30))
    try:
        handles = []
        for k, case in enumerate(cases):
            sh = dst_sharding(case)
            src = Layout(tuple(case["mesh"]), tuple(case["axes"]), (0,) * math.prod(case["mesh"]),
                         tuple(case["spec"]))
            handles.append(ep.recv(f"case{k}", jax.ShapeDtypeStruct(case["shape"], case["dtype"], sharding=sh),
                                   src, peers={0: child_addresses}))
            case["dst"] = Layout.of(sh).to_json()
        child.stdin.write(json.dumps({"peers": {0: ep.addresses}, "cases": cases}) + "\n")
        child.stdin.flush()
        for case, h in zip(cases, handles):
            y = h.wait()
            want = case_array(case)
            assert y.sharding == dst_sharding(case)
            np.testing.assert_array_equal(np.asarray(y).view(BITS[case["dtype"]]), want.view(BITS[case["dtype"]]))
            assert h.wire_bytes == want.nbytes
        assert child.stdout.readline().strip() == "sent"
    finally:
        child.stdin.write("exit\n")
        child.stdin.close()
        child.wait(timeout=30)
        ep.close()


def test_killed_peer_gives_a_timeout_naming_it():
    timeout_s = 3.0
    child, child_addresses = start_peer("host")
    ep = open_endpoint(LinkConfig(backend="host", timeout_s=timeout_s))
    try:
        sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
        src = Layout((4,), ("a",), (0,) * 4, ("a",))
        h = ep.recv("case0", jax.ShapeDtypeStruct((8, 8), "float32", sharding=sh), src,
                    peers={0: child_addresses})
        child.kill()  # the sender dies before it sends anything
        child.wait()
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match=f"from source process 0 at {child_addresses[0]}"):
            h.wait()
        assert time.monotonic() - start < timeout_s + 2
    finally:
        ep.close()
