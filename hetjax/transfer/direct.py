"""The `direct` backend: jax.experimental.transfer pulls arrays into device memory.

That API does no resharding: pulling with a sharding other than the offered one
returns wrong data without an error. So nothing but single-device pieces cross it:
the sender offers each planned piece as an array on its source device, the receiver
pulls exactly those shapes onto each group's receiver device, and the destination
array is put together from them here.

Safety: the transfer server has no authentication of its own, so every offer's id is
an HMAC of (tag, processes, shapes, dtypes, layouts) under the job's secret: a peer
without the secret cannot name an offer, and a receive whose tag, shape, dtype or
layout differs from the send matches no offer and times out naming the peer. The
transport is TCP; there is no per-chunk checksum on this path (use `host` for one).
With each message the sender also offers a small descriptor (every leaf's dtype, shape
and both layouts), which the receiver pulls beside the data: a receive whose message
differs from the send names the difference at once, not after the timeout.
Pulls have no working deadline in jax (a dead sender blocks them forever), so each
pull runs in a daemon thread that we stop waiting for after timeout_s. Here timeout_s
bounds each source's whole transfer, data included (`host` times out on silence).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import threading
import zlib

import jax
import numpy as np
from jax.experimental import transfer as jax_transfer
from jax.sharding import SingleDeviceSharding

from hetjax.transfer import core
from hetjax.transfer.api import Endpoint
from hetjax.transfer.link import TransferError, TransferTimeout, address
from hetjax.transfer.plan import extent

DESCRIPTOR_BYTES = 4096  # a message's descriptor: its length, then zlib'd JSON, padded


def message_key(avals, src, dst) -> tuple:
    """What the two sides of a message must agree on, hashable: each leaf's shape and
    dtype, and both layouts. A step repeats a few messages, so what is made of one (its
    offer ids' text, its descriptor) is made once per key, not per message."""
    return tuple((tuple(a.shape), np.dtype(a.dtype).name) for a in avals), tuple(src), tuple(dst)


@functools.lru_cache(maxsize=256)
def describe(key: tuple) -> tuple[str, ...]:
    """Each leaf of a message_key as the two sides must agree on it: dtype, shape, both layouts."""
    def layout(x):
        return f"mesh {dict(zip(x.axis_names, x.mesh_shape))} spec {list(x.spec)} processes {list(x.processes)}"
    shapes, src, dst = key
    return tuple(f"{dtype}{list(shape)} from {layout(s)} to {layout(d)}" for (shape, dtype), s, d in zip(shapes, src, dst))


@functools.lru_cache(maxsize=256)
def _identity(key: tuple) -> str:
    """A message_key as the text its offer ids are made of (Layout.to_json is slow)."""
    shapes, src, dst = key
    return json.dumps([[list(shape), dtype, s.to_json(), d.to_json()] for (shape, dtype), s, d in zip(shapes, src, dst)])


def pack(leaves: tuple[str, ...]) -> np.ndarray:
    """The descriptor as DESCRIPTOR_BYTES bytes (leaves at the end dropped if it would not fit)."""
    for n in range(len(leaves), -1, -1):
        data = zlib.compress(json.dumps({"count": len(leaves), "leaves": leaves[:n]}).encode())
        if len(data) <= DESCRIPTOR_BYTES - 4:
            out = np.zeros(DESCRIPTOR_BYTES, np.uint8)
            out[:4] = np.frombuffer(len(data).to_bytes(4, "little"), np.uint8)
            out[4:4 + len(data)] = np.frombuffer(data, np.uint8)
            return out
    raise AssertionError("an empty descriptor always fits")


def disagreement(theirs: np.ndarray, ours: tuple[str, ...]) -> str | None:
    """How the sender's descriptor differs from this receive's leaves (None: it does not)."""
    return _disagreement(theirs[:4 + int.from_bytes(theirs[:4].tobytes(), "little")].tobytes(), ours)


@functools.lru_cache(maxsize=256)
def _disagreement(theirs: bytes, ours: tuple[str, ...]) -> str | None:
    got = json.loads(zlib.decompress(theirs[4:]))
    if got["count"] != len(ours):
        return f"the sender sends {got['count']} arrays, this receive expects {len(ours)}"
    for i, (a, b) in enumerate(zip(got["leaves"], ours)):
        if a != b:
            return f"leaf {i} is sent as {a}, but this receive expects {b}"
    return None


class DirectEndpoint(Endpoint):
    def __init__(self, cfg, process_index=None):
        super().__init__(cfg, process_index)
        self._secret = cfg.secret()
        hosts = cfg.listen_addresses
        client = jax.local_devices()[0].client
        self._server = jax_transfer.start_transfer_server(
            client, address(hosts[0], cfg.port), [address(h, 0) for h in hosts])
        self.addresses = (self._server.address(),)
        self._conns: dict[str, object] = {}
        self._descriptors: dict[tuple, jax.Array] = {}
        self._lock = threading.Lock()
        self._posted: dict[str, core.Handle] = {}  # receives in flight: a twin would pull the same offer

    def _uuid(self, tag, p, q, key) -> int:
        """The offer's id: of the message with this message_key, or with key None of its descriptor."""
        what = json.dumps([tag, p, q]) + (_identity(key) if key is not None else '"descriptor"')
        return int.from_bytes(hmac.new(self._secret, what.encode(), hashlib.sha256).digest()[:8], "little") >> 1

    def send(self, tree, tag, dst, peers=None):
        leaves, plans, dst_layouts = self.prepare_send(tree, tag, dst)
        self.check_open(f"send {tag!r}")
        src_layouts = core.layouts([x.sharding for x in leaves])
        by_dst: dict[int, list] = {}
        for i, plan in enumerate(plans):
            # Pulls read the bytes as they lie, row-major: a shard of another layout is copied first.
            relayout = not core.row_major(leaves[i])
            for piece in plan.sent_by(self.process):
                by_dst.setdefault(piece.dst_process, []).append(core.device_piece(leaves[i], plan, piece, relayout))
        handle = core.Handle(core.finished(), f"send {tag!r}")
        key = message_key(leaves, src_layouts, dst_layouts)
        if by_dst:
            desc = self._descriptor(key)
        for q, arrays in sorted(by_dst.items()):
            self._server.await_pull(self._uuid(tag, self.process, q, None), [desc])
            self._server.await_pull(self._uuid(tag, self.process, q, key), arrays)
            handle.wire_bytes += sum(a.nbytes for a in arrays)
        return handle

    def _descriptor(self, key: tuple) -> jax.Array:
        """The descriptor of the message with this message_key on a device, made once per key."""
        with self._lock:
            if key not in self._descriptors:
                if len(self._descriptors) >= 256:
                    self._descriptors.clear()
                self._descriptors[key] = jax.device_put(pack(describe(key)), jax.local_devices()[0])
            return self._descriptors[key]

    def recv(self, tag, like, src, peers=None):
        expect = self.prepare_recv(tag, like, src)
        src_layouts = core.layouts(src)
        wanted: dict[int, list] = {}
        for i, (aval, plan) in enumerate(zip(expect.avals, expect.plans)):
            receivers = list(aval.sharding.mesh.devices.flat)
            for piece in plan.received_by(self.process):
                shape = extent(piece.region)
                sds = jax.ShapeDtypeStruct(shape, aval.dtype, sharding=SingleDeviceSharding(receivers[piece.dst]))
                wanted.setdefault(piece.src_process, []).append((i, piece, sds))
        core.check_peers(peers, wanted, f"recv {tag!r}", "source")
        self.check_open(f"recv {tag!r}")
        handle = core.Handle(None, f"recv {tag!r}")
        with self._lock:
            if tag in self._posted:
                raise self.twin(tag)
            self._posted[tag] = handle
        handle.watch(None, self.cfg.timeout_s)  # bounds the fan-out; pulls have their own wait
        try:
            handle.run(self._receive, tag, expect, src_layouts, wanted, peers, handle)
        except BaseException:
            self._unpost(tag)
            raise
        handle.future.add_done_callback(lambda _: self._unpost(tag))
        if self.closed:  # close() came while it was posted, and found no future to fail
            core.settle(handle.future, error=TransferError(f"recv {tag!r}: this endpoint was closed"))
        return handle

    def _unpost(self, tag: str) -> None:
        with self._lock:
            self._posted.pop(tag, None)

    def close(self) -> None:
        """Fails the receives in flight at once (a pull cannot be cancelled: its thread ends
        with it, within timeout_s) and lets go of the offers' descriptors and connections.
        The transfer server listens until it is garbage-collected: jax has no stop for it."""
        self.closed = True
        with self._lock:
            handles = list(self._posted.values())
            self._descriptors.clear()
            self._conns.clear()
        for handle in handles:  # they would wait out timeout_s, then blame the peer
            if handle.future is not None:  # (one being posted checks `closed` once it runs)
                core.settle(handle.future, error=TransferError(f"{handle.describe}: this endpoint was closed"))

    def _connection(self, address):
        with self._lock:
            if address not in self._conns:
                self._conns[address] = self._server.connect(address)
            return self._conns[address]

    def _pull(self, address, uuid, like, desc_uuid, desc_like, described):
        """Pulls the descriptor and the data together; hands the descriptor to `described`
        once it is in, then waits for the data."""
        data = None
        try:
            conn = self._connection(address)
            desc = conn.pull(desc_uuid, desc_like)
            data = conn.pull(uuid, like)
            described.set_result(np.asarray(desc[0]))
        except BaseException as e:  # noqa: BLE001 - the data's wait reports a lost peer
            described.set_exception(e)
            if data is None:
                raise
        return jax.block_until_ready(data)

    def _receive(self, tag, expect, src_layouts, wanted, peers, handle):
        pulls, descriptors = {}, {}
        key = message_key(expect.avals, src_layouts, expect.dst)
        on = SingleDeviceSharding(jax.local_devices()[0])
        like = [jax.ShapeDtypeStruct((DESCRIPTOR_BYTES,), np.uint8, sharding=on)]
        for p, items in sorted(wanted.items()):
            uuid = self._uuid(tag, p, self.process, key)
            address = peers[p][0]
            descriptors[p] = core.futures.Future()
            # pull() returns at once, its arrays become ready when the data is in: wait for that
            # here, under the timeout, since an op on them would block their device until then.
            pulls[p] = (address, core.run_async(self._pull, address, uuid, [sds for _, _, sds in items],
                                                self._uuid(tag, p, self.process, None), like, descriptors[p]))
        received = []
        ours = describe(key)
        for p, (address, future) in pulls.items():
            described = descriptors[p]
            core.wait_overdue(handle, [described, future], self.cfg.timeout_s, first=True)
            if described.done() and described.exception() is None:
                if (why := disagreement(described.result(), ours)) is not None:
                    raise TransferError(f"recv {tag!r}: source process {p} at {address} sent a message that "
                                        f"differs from this receive: {why}; both islands must agree on the tree")
            if not core.wait_overdue(handle, [future], self.cfg.timeout_s):
                raise TransferTimeout(
                    f"recv {tag!r}: source process {p} at {address} sent nothing matching, or not all "
                    f"of it, within {self.cfg.timeout_s:g} s of waiting (LinkConfig.timeout_s, which bounds "
                    f"the whole transfer on this backend): it is gone, too slow for the limit, its tag, "
                    f"shapes, dtypes or layouts differ from this receive's, or the two sides' shared "
                    f"secrets differ ($HETJAX_TRANSFER_SECRET)")
            try:
                arrays = future.result()
            except jax.errors.JaxRuntimeError as e:
                if "deleted or donated" in str(e):  # the sender's handle is done at once on this backend
                    raise TransferError(
                        f"recv {tag!r}: source process {p} at {address} deleted or donated a sent array "
                        f"before this process pulled it; with the direct backend a sender keeps what it "
                        f"sent alive until the receiver has it ({e})") from None
                # The sender died mid-pull: reported as the timeout a silent sender gives,
                # so callers catch one error for a lost peer on every backend.
                raise TransferTimeout(f"recv {tag!r}: lost source process {p} at {address} ({e})") from None
            received += [(i, piece, data) for (i, piece, _), data in zip(wanted[p], arrays)]
        return core.assemble(expect, self.process, received, handle)
