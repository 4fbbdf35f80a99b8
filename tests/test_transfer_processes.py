"""Real processes (separate XLA runtimes): hypothesis-drawn cases per backend, the
direct backend's sharding trap, a destination island of two jax.distributed
processes that fans out across them, and a killed peer."""

import dataclasses
import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.transfer import Layout, LinkConfig, TransferTimeout, host, open_endpoint
from tests.test_transfer_plan import cases
from tests.transfer_peer import BITS, PREFIX, case_array, shard_bits_match, sharding_on

PEER = Path(__file__).with_name("transfer_peer.py")
SECRET = "two-process-secret-0123456789"
WAIT_S = 60.0  # for a peer's line: generous on a loaded 2-core machine, but never a hang


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("HETJAX_TRANSFER_SECRET", SECRET)


class Peer:
    """A transfer_peer.py process: JSON orders in on stdin, lines out on stdout."""

    def __init__(self, *args):
        env = dict(os.environ, HETJAX_TRANSFER_SECRET=SECRET)
        env.pop("XLA_FLAGS", None)
        self.child = subprocess.Popen([sys.executable, str(PEER), *map(str, args)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self._lines.put(x) for x in self.child.stdout], daemon=True).start()

    def line(self):
        """The peer's next protocol message (other output, such as gloo's, goes to stderr)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                text = self._lines.get(timeout=0.5)
            except queue.Empty:
                if self.child.poll() is not None and self._lines.empty():
                    raise AssertionError(f"peer {self.child.args[2:]} exited ({self.child.returncode})") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"peer {self.child.args[2:]} said nothing for {WAIT_S:g} s") from None
                continue
            deadline = time.monotonic() + WAIT_S
            if text.startswith(PREFIX):
                return json.loads(text[len(PREFIX):])
            sys.stderr.write(text)

    def tell(self, order) -> None:
        self.child.stdin.write(json.dumps(order) + "\n")
        self.child.stdin.flush()

    def close(self) -> None:
        try:
            self.child.stdin.write("exit\n")
            self.child.stdin.close()
            self.child.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.child.kill()
            self.child.wait()


def on_one_process(layout: Layout) -> Layout:
    return dataclasses.replace(layout, processes=(0,) * len(layout.processes))


# Rows split on one side, columns on the other: jax.experimental.transfer alone would
# hand back wrong data here without an error.
TRAP = ((8, 8), 4, Layout((4,), ("a",), (0,) * 4, ("a", None)), Layout((2, 4), ("x", "y"), (0,) * 8, (None, "y")))


@pytest.mark.parametrize("backend", ["host", "direct"])
def test_drawn_cases_arrive_bit_for_bit_across_two_processes(backend):
    """Hypothesis draws shape, dtype and both meshes and specs here; one sender process
    (4 devices) sends each case to this process (8 devices, in reverse order)."""
    sender = Peer("send", backend, 30.0)
    sender_addresses = tuple(sender.line())
    ep = open_endpoint(LinkConfig(backend=backend, timeout_s=30))
    tags = itertools.count()

    @settings(max_examples=15, deadline=None)
    @example(TRAP, "float32", 7)
    @given(cases(src_devices=4), st.sampled_from(sorted(BITS)), st.integers(0, 2**16))
    def check(case, dtype, seed):
        shape, _, src, dst = case
        src, dst = on_one_process(src), on_one_process(dst)
        sh = sharding_on(dst, jax.devices()[::-1])
        order = {"tag": f"case{next(tags)}", "shape": list(shape), "dtype": dtype, "seed": seed,
                 "src": src.to_json(), "dst": dst.to_json()}
        h = ep.recv(order["tag"], jax.ShapeDtypeStruct(shape, dtype, sharding=sh), src, peers={0: sender_addresses})
        sender.tell({"peers": {0: ep.addresses}, "cases": [order]})
        y = h.wait()
        assert sender.line() == "sent"
        want = case_array(order).view(BITS[dtype])
        assert y.sharding == sh and len(y.addressable_shards) == len(sh.device_set)
        assert shard_bits_match(y, want)
        assert h.wire_bytes == want.nbytes  # one copy per replica group, however replicated

    try:
        check()
    finally:
        sender.close()
        ep.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Destination layouts over a two-process island (process 0 owns the first two mesh
# positions) and this process's source layouts: (shape, dtype, source, destination).
SPANNING = [
    ((8, 8), "float32", Layout((4,), ("a",), (0,) * 4, ("a", None)),
     Layout((2, 2), ("r", "s"), (0, 0, 1, 1), ("s", None))),  # replicated across the processes
    ((4, 16), "bfloat16", Layout((2, 2), ("a", "b"), (0,) * 4, (None, "b")),
     Layout((4,), ("r",), (0, 0, 1, 1), (None, None))),  # replicated on all four devices
    ((8, 4), "int32", Layout((8,), ("a",), (0,) * 8, ("a", None)),
     Layout((2, 2), ("r", "s"), (0, 0, 1, 1), (None, "r"))),  # replicas inside each process only
]


def test_destination_of_two_processes_fans_out_across_them():
    """One copy of each block crosses the link; the destination island's own gloo
    collective copies it to the replicas in the other process, bit for bit, with
    several receives in flight at once (they finish in different orders in the two
    processes; the fan-outs must not)."""
    port = free_port()
    receivers = [Peer("recv", i, port, 30.0) for i in range(2)]
    try:
        addresses = [r.line() for r in receivers]
        for backend in ("host", "direct"):
            ep = open_endpoint(LinkConfig(backend=backend, timeout_s=30))
            orders = [{"tag": f"{backend}{k}", "shape": list(shape), "dtype": dtype, "seed": k,
                       "src": src.to_json(), "dst": dst.to_json()} for k, (shape, dtype, src, dst) in enumerate(SPANNING)]
            for r in receivers:
                r.tell({"backend": backend, "peers": {0: ep.addresses}, "cases": orders})
            peers = {i: tuple(a[backend]) for i, a in enumerate(addresses)}
            # One send after another, while the receives of all wait: a receive with no
            # data for one process completes there first, before the earlier ones.
            for order, (_, _, src, dst) in zip(orders, SPANNING):
                x = jax.device_put(case_array(order), sharding_on(src, jax.devices()))
                h = ep.send(x, order["tag"], dst, peers=peers)
                h.wait()
                got = [r.line() for r in receivers]
                assert all(g["tag"] == order["tag"] and g["ok"] and g["shards"] == 2 for g in got), got
                # One copy of each block crossed the link, not one per replica or process.
                assert h.wire_bytes == sum(g["wire_bytes"] for g in got) == x.nbytes, got
            ep.close()
    finally:
        for r in receivers:
            r.close()


@pytest.mark.parametrize("backend", ["host", "direct"])
def test_killed_peer_gives_a_timeout_naming_it(backend):
    timeout_s = 3.0
    sender = Peer("send", backend, 30.0)
    sender_addresses = tuple(sender.line())
    ep = open_endpoint(LinkConfig(backend=backend, timeout_s=timeout_s))
    try:
        sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
        src = Layout((4,), ("a",), (0,) * 4, ("a",))
        h = ep.recv("case0", jax.ShapeDtypeStruct((8, 8), "float32", sharding=sh), src,
                    peers={0: sender_addresses})
        sender.child.kill()  # the sender dies before it sends anything
        sender.child.wait()
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match=f"source process 0 at {sender_addresses[0]}"):
            h.wait()
        assert time.monotonic() - start < timeout_s + 2
    finally:
        ep.close()


def test_a_stopped_peer_is_named_by_its_unanswered_ping():
    """A peer process that is there but frozen (SIGSTOP: a hung host, a swapped-out
    process) cannot answer the ping that a silent peer gets (host), so it is named after
    timeout_s and the ping's own 5 s bound, not waited for as a busy one (busy_timeout_s):
    a receive from a frozen sender, and a send to a frozen receiver, whose stream is then
    free for the next message once the receiver thaws."""
    timeout_s = 2.0
    sender, receiver = Peer("send", "host", 30.0), Peer("lowfiles", 1024, 30.0)
    sender_addresses, receiver_address = tuple(sender.line()), receiver.line()[0]
    ep = open_endpoint(LinkConfig(backend="host", timeout_s=timeout_s, busy_timeout_s=600, streams=1))
    stopped = []
    try:
        sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
        src = Layout((4,), ("a",), (0,) * 4, ("a",))
        dst = Layout((4,), ("x",), (0,) * 4, (None, "x"))
        big = {"tag": "to-frozen", "shape": [2048, 1024], "dtype": "float32", "seed": 4,
               "src": TRAP[2].to_json(), "dst": dst.to_json()}

        def send_small(tag):  # to the receiver, which checks it
            small = dict(big, tag=tag, shape=[8, 8], seed=5)
            receiver.tell({"peers": {0: ep.addresses}, "cases": [small]})
            y = jax.device_put(case_array(small), sharding_on(TRAP[2], jax.devices()))
            return ep.send(y, tag, dst, peers={0: (receiver_address,)})

        send_small("before").wait()  # the stream is connected: what follows is the waiter's ping
        assert receiver.line()["ok"]
        h = ep.recv("case0", jax.ShapeDtypeStruct((8, 8), "float32", sharding=sh), src,
                    peers={0: sender_addresses})
        for peer in (sender, receiver):
            os.kill(peer.child.pid, signal.SIGSTOP)
            stopped.append(peer)
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match=f"source process 0 at {sender_addresses[0]}: nothing for 2 s "
                                                  rf"\(LinkConfig.timeout_s\), and process 0 at .* did not answer a ping"):
            h.wait()
        assert time.monotonic() - start < timeout_s + host.HANDSHAKE_S + 2

        x = jax.device_put(case_array(big), sharding_on(TRAP[2], jax.devices()))
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match=f"send 'to-frozen' to destination process 0 at {receiver_address}: "
                                                  f"nothing for 2 s .* did not answer a ping"):
            ep.send(x, "to-frozen", dst, peers={0: (receiver_address,)}).wait()
        assert time.monotonic() - start < timeout_s + host.HANDSHAKE_S + 2
        os.kill(receiver.child.pid, signal.SIGCONT)
        stopped.remove(receiver)
        after = send_small("after")
        assert futures.wait([after.future], timeout=30).done, "the stream is still stuck on the message given up on"
        after.wait()
        assert receiver.line()["ok"]
    finally:
        for peer in stopped:
            os.kill(peer.child.pid, signal.SIGCONT)
        sender.close()
        receiver.close()
        ep.close()


def test_a_flood_of_connections_under_a_low_file_limit_leaves_the_listener_working():
    """A host endpoint in a process limited to 256 files: connections arrive while it has
    no descriptor left (accept fails with EMFILE), then a flood past its cap of
    connections in their handshake; once they are closed, a real transfer completes."""
    peer = Peer("lowfiles", 256, 20.0)
    ep = open_endpoint(LinkConfig(backend="host", timeout_s=20))
    flood = []

    def connect_many(n, within_s):
        """n more connections, or as many as connect within within_s."""
        want, end = len(flood) + n, time.monotonic() + within_s
        while len(flood) < want and time.monotonic() < end:
            try:
                flood.append(socket.create_connection((host, int(port)), timeout=0.3))
            except OSError:  # the backlog is full: the kernel drops the SYN
                pass

    try:
        address = peer.line()[0]
        host, port = address.rsplit(":", 1)
        peer.tell({"hog": True})
        assert peer.line() > 0
        connect_many(20, 3)  # each accept() fails now: out of descriptors
        time.sleep(0.5)
        peer.tell({"release": True})
        assert peer.line() == "released"
        before = len(flood)
        connect_many(300, 20)  # past the cap of 32 unauthenticated connections, and past 256 files
        assert len(flood) - before == 300  # the listener kept accepting (and closing) them
        for s in flood:
            s.close()
        shape, dtype, src, dst = (8, 8), "float32", TRAP[2], Layout((4,), ("x",), (0,) * 4, (None, "x"))
        order = {"tag": "after-flood", "shape": list(shape), "dtype": dtype, "seed": 3,
                 "src": src.to_json(), "dst": dst.to_json()}
        peer.tell({"peers": {0: ep.addresses}, "cases": [order]})
        x = jax.device_put(case_array(order), sharding_on(src, jax.devices()))
        ep.send(x, order["tag"], dst, peers={0: (address,)}).wait()
        got = peer.line()
        assert got["ok"] and got["accept_errors"] >= 1 and got["refused"] >= 32, got
    finally:
        for s in flood:
            s.close()
        ep.close()
        peer.close()
