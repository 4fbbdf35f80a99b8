"""The `host` backend: device -> host buffer -> N TCP streams -> host buffer -> device.

Each process listens on its NIC addresses (loopback by default). A sender opens
`streams` connections to each destination process it feeds (stream i to the peer's
address i % len), proves the job's shared secret by HMAC challenge-response (both
ways), then pushes chunks: a small JSON header (tag, leaf, piece, shape, dtype,
region, offset, length, checksum) and the payload; a message of at most 64 KiB goes as
one frame, the headers of all its chunks and then their payloads. The receiver checks the header
against its own plan before reading the payload into place, verifies the checksum,
and moves a block to the device as soon as its pieces are in, while other chunks
are still on the wire. Each stream has one sending thread for the life of the
endpoint, which starts copying its next chunk off the device while it sends the
current one; a message smaller than a MiB takes one stream (its chunks, END, ACK). A
small message whose arrays are ready goes out on the caller's thread when its stream is
idle, which saves a thread hop (its ACK is still read by the stream's thread).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
import typing
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import xxhash

from hetjax.transfer import core, link
from hetjax.transfer.api import Endpoint, check_leaf
from hetjax.transfer.link import TransferError, TransferTimeout
from hetjax.transfer.plan import extent, split, volume
from hetjax.errors import PeerLost  # noqa: F401 - raised here, caught by callers

log = logging.getLogger("hetjax.transfer")

_FRAME = struct.Struct("<4sBI")  # magic, kind, length of the JSON header that follows
_MAGIC = b"HJX1"
_CHUNK, _END, _ACK, _BATCH = 1, 2, 3, 4  # _BATCH: a whole small message; an END is implied
_CHECKSUM = {"xxh3": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32, "adler32": zlib.adler32}
# How long close() waits for the END frames of messages that already arrived: they follow
# their last chunk at once, so this is only reached when a sender died mid-message.
CLOSE_GRACE_S = 5.0
_SMALL = 64 << 10  # a chunk (or a whole message) this small goes out with its header(s) in one write
_STREAM_BYTES = 1 << 20  # a message uses another stream for every MiB it holds, up to LinkConfig.streams
_counted = threading.Lock()  # guards Handle.wire_bytes across stream threads


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def _recv_into(sock, view: memoryview, peer: str) -> None:
    while len(view):
        try:
            n = sock.recv_into(view)
        except socket.timeout:
            raise TransferTimeout(f"peer {peer} stopped answering mid-message (LinkConfig.timeout_s)") from None
        except OSError as e:
            raise PeerLost(f"peer {peer}: connection lost ({e})") from None
        if n == 0:
            raise PeerLost(f"peer {peer} closed the connection mid-message")
        view = view[n:]


def _recv_exact(sock, n: int, peer: str) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), peer)
    return bytes(buf)


def _sendall(sock, data, peer: str) -> None:
    try:
        sock.sendall(data)
    except socket.timeout:
        raise TransferTimeout(f"peer {peer} stopped reading (LinkConfig.timeout_s)") from None
    except OSError as e:
        raise PeerLost(f"peer {peer}: connection lost ({e})") from None


def _frame(kind: int, meta: dict) -> bytes:
    head = json.dumps(meta).encode()
    return _FRAME.pack(_MAGIC, kind, len(head)) + head


def _send_frame(sock, kind: int, meta: dict, peer: str) -> None:
    _sendall(sock, _frame(kind, meta), peer)


def _read_frame(sock, peer: str, idle_ok: bool, timeout_s: float) -> tuple[int, dict]:
    if idle_ok:  # a persistent connection may sit idle between transfers
        sock.settimeout(None)
        first = sock.recv(1)
        if not first:
            raise EOFError
        sock.settimeout(timeout_s)
        raw = first + _recv_exact(sock, _FRAME.size - 1, peer)
    else:
        raw = _recv_exact(sock, _FRAME.size, peer)
    magic, kind, n = _FRAME.unpack(raw)
    if magic != _MAGIC or n > 1 << 20:
        raise TransferError(f"peer {peer} sent a frame that is not a hetjax transfer frame")
    return kind, json.loads(_recv_exact(sock, n, peer))


def authenticate(conn, secret: bytes, peer: str) -> bool:
    """The accepting side of the handshake: True once the peer proved the job's secret
    (and got our proof back); False, logged, when it did not."""
    nonce = os.urandom(32)
    conn.sendall(nonce)
    answer = _recv_exact(conn, 64, peer)
    if not hmac.compare_digest(answer[32:], _mac(secret, b"client", nonce)):
        log.warning("transfer: refused a connection from %s: it did not prove the job's shared secret", peer)
        return False
    conn.sendall(_mac(secret, b"server", answer[:32]))
    return True


def connect(address: str, secret: bytes, timeout_s: float) -> socket.socket:
    """A connection to `address` ("host:port") on which both sides proved the job's
    secret; retries while the peer starts, TransferTimeout after timeout_s."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    sock = link.retry(lambda: socket.create_connection((host, int(port)), timeout=timeout_s),  # it may be starting
                      timeout_s, 0.05, lambda e: TransferTimeout(f"peer {address} did not accept a connection "
                                                                 f"within {timeout_s:g} s ({e})"))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = os.urandom(32)
    challenge = _recv_exact(sock, 32, address)
    sock.sendall(nonce + _mac(secret, b"client", challenge))
    try:
        proof = _recv_exact(sock, 32, address)
    except PeerLost:
        raise TransferError(f"peer {address} refused the connection: the shared secrets differ") from None
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonce)):
        raise TransferError(f"peer {address} did not prove the job's shared secret; not sending to it")
    return sock


class _Inbox:
    """One posted receive: buffers for the pieces this process expects, and progress."""

    def __init__(self, endpoint, tag, expect, handle):
        self.tag, self.expect, self.handle, self.endpoint = tag, expect, handle, endpoint
        self.lock = threading.Lock()
        self.activity = core.Activity()
        self.future = handle.future
        self.buffers, self.left, self.group_left, self.blocks = {}, {}, {}, []
        for i, (aval, plan) in enumerate(zip(expect.avals, expect.plans)):
            self.blocks.append({})
            for j, piece in enumerate(plan.pieces):
                if piece.dst_process == endpoint.process:
                    shape = extent(piece.region)
                    self.buffers[i, j] = endpoint.buffers.take(shape, aval.dtype)
                    self.left[i, j] = piece.nbytes
                    self.group_left[i, piece.group] = self.group_left.get((i, piece.group), 0) + 1
        self.groups_left = len(self.group_left)
        self.process = endpoint.process

    def arrived(self, i: int, j: int, n: int) -> None:
        """Counts n verified bytes of piece j of leaf i; finishes blocks and the receive."""
        with self.lock:
            self.handle.wire_bytes += n
            self.left[i, j] -= n
            if self.left[i, j]:
                return
            plan = self.expect.plans[i]
            gi = plan.pieces[j].group
            self.group_left[i, gi] -= 1
            if self.group_left[i, gi]:
                return
        # The block is complete. A large one goes host -> device now, while other chunks
        # still arrive; small ones go together when the message is in (build: one call).
        t = time.perf_counter()
        group = plan.groups[gi]
        parts = [(p, self.buffers[i, k]) for k, p in enumerate(plan.pieces) if (i, k) in self.buffers and p.group == gi]
        block = core.block_from_host_pieces(group, parts, self.expect.avals[i].dtype)
        if block.nbytes > _SMALL:
            block = jax.device_put(block, self.expect.avals[i].sharding.mesh.devices.flat[group.receiver])
            self.endpoint.copied(self.tag, t)
        with self.lock:
            self.blocks[i][gi] = block
            self.groups_left -= 1
            finished = self.groups_left == 0
        if finished:
            self.finish()

    def finish(self):
        try:
            out = [core.build(a, p, d, self.process, b)
                   for a, p, d, b in zip(self.expect.avals, self.expect.plans, self.expect.dst, self.blocks)]
            self.future.set_result(jax.tree.unflatten(self.expect.treedef, out))
        except Exception as e:  # noqa: BLE001 - handed to the waiter
            self.fail(e)

    def fail(self, error: Exception) -> None:
        with self.lock:  # two streams may fail one receive at once
            if not self.future.done():
                self.future.set_exception(error)


class HostEndpoint(Endpoint):
    def __init__(self, cfg, process_index=None):
        super().__init__(cfg, process_index)
        self._secret = cfg.secret()
        self._checksum = _CHECKSUM[cfg.checksum]
        self._inboxes: dict[str, _Inbox] = {}
        self.buffers = core.BufferPool()  # where received pieces land
        self._posted = threading.Condition()
        self._pipes: dict[tuple, list[_Stream]] = {}
        self._pipes_lock = threading.Lock()
        self._turn = itertools.count()  # the stream a message starts on, round robin
        self._conns: list[socket.socket] = []
        self._closed = self._closing = False
        # Streams holding chunks whose END is not acknowledged yet: a receive completes
        # when its last byte lands, just before the END frame is read and acknowledged,
        # so close() waits for these or the sender would see its peer vanish.
        self._unacked = 0
        self._quiet = threading.Condition()
        self.refused = 0  # connections refused for a wrong secret
        self.bytes_received = 0
        self._listeners, addresses = [], []
        for host in cfg.listen_addresses:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, cfg.port))
            except OSError as e:
                raise TransferError(f"link.bind_address/nic_addresses: cannot listen on {host}:{cfg.port} ({e})") from None
            s.listen(64)
            self._listeners.append(s)
            addresses.append(link.address(host, s.getsockname()[1]))
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()
        self.addresses = tuple(addresses)

    # -- receiving -------------------------------------------------------------------

    def recv(self, tag, like, src, peers=None):
        expect = self.prepare_recv(tag, like, src)
        senders = sorted({p.src_process for plan in expect.plans for p in plan.received_by(self.process)})
        who = ", ".join(f"process {p}" + (f" at {','.join(peers[p])}" if peers and p in peers else "") for p in senders)
        handle = core.Handle(core.futures.Future(), f"recv {tag!r} from source {who}")
        inbox = _Inbox(self, tag, expect, handle)
        handle.watch(inbox.activity.idle, self.cfg.timeout_s)
        with self._posted:
            if tag in self._inboxes:
                raise TransferError(f"recv {tag!r}: a receive with this tag is already posted; tags must be unique in flight")
            self._inboxes[tag] = inbox
            self._posted.notify_all()
        # By id, not the inbox itself: the handle's future keeps its callbacks, and an inbox
        # it held would keep the received buffers from the pool until a garbage collection.
        handle.future.add_done_callback(lambda _, key=id(inbox): self._drop(tag, key))
        if not inbox.left:
            inbox.finish()
        return handle

    def _drop(self, tag, key: int):
        with self._posted:
            if id(self._inboxes.get(tag)) == key:
                del self._inboxes[tag]

    def _accept(self, listener):
        while not self._closed:
            try:
                conn, addr = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, link.address(*addr[:2])), daemon=True).start()

    def _serve(self, conn, peer):
        """One incoming stream: handshake, then chunks until the peer closes."""
        conn.settimeout(self.cfg.timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns.append(conn)
        inbox, busy = None, False
        try:
            if not authenticate(conn, self._secret, peer):
                self.refused += 1
                return
            while True:
                try:
                    kind, meta = _read_frame(conn, peer, idle_ok=True, timeout_s=self.cfg.timeout_s)
                except EOFError:
                    return
                if kind == _END:  # every chunk before it on this stream was verified
                    _send_frame(conn, _ACK, {"tag": meta.get("tag")}, peer)
                    busy = busy and self._settle(-1)
                    continue
                busy = busy or self._settle(+1)
                inbox = self._inbox(meta.get("tag"), peer)
                if kind == _BATCH:  # the chunks' headers, then their payloads in that order
                    for chunk in meta["chunks"]:
                        self._chunk(conn, peer, inbox, chunk)
                    _send_frame(conn, _ACK, {"tag": meta.get("tag")}, peer)
                    busy = busy and self._settle(-1)
                else:
                    self._chunk(conn, peer, inbox, meta)
                inbox = None
        except Exception as e:  # noqa: BLE001 - reported to the receive it broke, and logged
            if inbox is not None:
                inbox.fail(e)
            if not self._closed:
                log.warning("transfer: stream from %s closed: %s", peer, e)
        finally:
            if busy:
                self._settle(-1)
            conn.close()

    def _settle(self, change: int) -> bool:
        """Counts a stream into (+1) or out of (-1) the unacknowledged ones; True when in."""
        with self._quiet:
            self._unacked += change
            self._quiet.notify_all()
        return change > 0

    def _inbox(self, tag, peer) -> _Inbox:
        """The posted receive for `tag`, waiting up to timeout_s for it to be posted."""
        deadline = time.monotonic() + self.cfg.timeout_s
        with self._posted:
            while tag not in self._inboxes:
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    raise TransferError(f"peer {peer} sent tag {tag!r}, but no receive for it was posted "
                                        f"within {self.cfg.timeout_s:g} s; message refused")
                self._posted.wait(left)
            return self._inboxes[tag]

    def _chunk(self, conn, peer, inbox: _Inbox, meta: dict) -> None:
        tag, i, j = inbox.tag, meta["leaf"], meta["piece"]
        if not isinstance(i, int) or not isinstance(j, int):
            raise TransferError(f"recv {tag!r}: peer {peer} sent a chunk header without leaf and piece numbers")
        avals, plans = inbox.expect.avals, inbox.expect.plans
        if not 0 <= i < len(avals):
            raise TransferError(f"recv {tag!r}: peer {peer} sent leaf {i}, but the receiver expects {len(avals)} leaves")
        check_leaf(tag, i, meta["shape"], jnp.dtype(meta["dtype"]), avals[i])
        region = tuple(tuple(r) for r in meta["region"])
        if (i, j) not in inbox.buffers or plans[i].pieces[j].region != region:
            raise TransferError(f"recv {tag!r}: peer {peer} sent piece {j} {region} of leaf {i}, which this "
                                f"process's plan does not expect here; the two islands disagree on the layouts")
        buf = inbox.buffers[i, j].reshape(-1).view(np.uint8)
        offset, n = meta["offset"], meta["n"]
        if not (0 <= offset and offset + n <= buf.size):
            raise TransferError(f"recv {tag!r}: peer {peer} sent bytes {offset}..{offset + n} of a {buf.size}-byte piece")
        view = memoryview(buf)[offset:offset + n]
        inbox.handle.arriving()
        _recv_into(conn, view, peer)
        if self._checksum(view) != meta["sum"]:
            raise TransferError(f"recv {tag!r}: a chunk from peer {peer} (leaf {i}, piece {j}, bytes "
                                f"{offset}..{offset + n}) failed its {self.cfg.checksum} check: the data was corrupted")
        inbox.activity.touch()
        self.bytes_received += n
        inbox.arrived(i, j, n)

    # -- sending ---------------------------------------------------------------------

    def send(self, tree, tag, dst, peers=None):
        leaves, plans, _ = self.prepare_send(tree, tag, dst)
        work: dict[int, list] = {}
        for i, plan in enumerate(plans):
            for j, piece in enumerate(plan.pieces):
                if piece.src_process == self.process:
                    work.setdefault(piece.dst_process, []).append((i, j, piece))
        core.check_peers(peers, work, f"send {tag!r}", "destination")
        handle = core.Handle(core.futures.Future(), f"send {tag!r}")
        jobs = []
        for q, items in sorted(work.items()):
            chunks = [(i, j, piece, sub, offset) for i, j, piece in items
                      for sub, offset in split(piece.region, np.dtype(leaves[i].dtype).itemsize, self.cfg.chunk_bytes)]
            if not chunks:  # nothing to send; and a stream with no chunk sends no END
                continue
            streams = self._streams(tuple(peers[q]))
            # Enough bytes per stream to pay for its own round trip; a small message takes one.
            used = max(1, min(len(streams), sum(p.nbytes for _, _, p in items) // _STREAM_BYTES, len(chunks)))
            first = next(self._turn) % len(streams)
            for k in range(used):
                jobs.append((streams[(first + k) % len(streams)], chunks[k::used]))
        if not jobs:
            handle.future.set_result(None)
        left = [len(jobs)]
        lock = threading.Lock()

        def finished(error):  # from the streams' threads: the first error, or the last success, counts
            with lock:
                left[0] -= 1
                if handle.future.done():
                    return
                if error is not None:
                    handle.future.set_exception(error)
                elif left[0] == 0:
                    handle.future.set_result(None)

        for stream, chunks in jobs:
            small = sum(volume(sub) * np.dtype(leaves[i].dtype).itemsize for i, _, _, sub, _ in chunks) <= _SMALL
            stream.put(_Job(tag, leaves, plans, chunks, handle, finished, {}, small))
        return handle

    def _connect(self, address: str) -> socket.socket:
        return connect(address, self._secret, self.cfg.timeout_s)

    def _streams(self, addresses: tuple[str, ...]) -> list["_Stream"]:
        """The streams to one destination process, started on first use."""
        with self._pipes_lock:
            if addresses not in self._pipes:
                self._pipes[addresses] = [_Stream(self, addresses[k % len(addresses)]) for k in range(self.cfg.streams)]
            return self._pipes[addresses]

    def close(self):
        self._closing = True  # refuse new messages now (_inbox), so only the last ones are waited for
        with self._posted:
            self._posted.notify_all()
        deadline = time.monotonic() + min(self.cfg.timeout_s, CLOSE_GRACE_S)
        with self._quiet:  # acknowledge what already arrived (see _unacked)
            while self._unacked and (left := deadline - time.monotonic()) > 0:
                self._quiet.wait(left)
        self._closed = True
        for s in self._listeners + self._conns:
            s.close()
        with self._pipes_lock:
            for streams in self._pipes.values():
                for stream in streams:
                    stream.close()
        with self._posted:
            self._posted.notify_all()


class _Job(typing.NamedTuple):
    """Part of one message for one stream: its chunks, and whom to tell when they are in."""

    tag: str
    leaves: list
    plans: list
    chunks: list  # (leaf, piece index, piece, sub-region, byte offset in the piece)
    handle: core.Handle
    finished: typing.Callable  # finished(None) once acknowledged, finished(error) on failure
    shards: dict  # (leaf, source position) -> the shard as a numpy array (CPU), made once
    small: bool  # at most _SMALL bytes: one _BATCH frame


class _Stream:
    """One TCP connection to a destination process, with its own thread that sends the
    jobs put to it in order: each job's chunks, then END, then it waits for the ACK
    (the receiver has verified every chunk). It connects on first use, and again after
    a failure."""

    def __init__(self, endpoint: HostEndpoint, address: str):
        self.endpoint, self.address = endpoint, address
        self.sock: socket.socket | None = None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # (job, already written)
        self.closed, self.lock = False, threading.Lock()
        self.queued = 0  # jobs put and not yet finished by the thread; 0: it leaves the socket alone
        threading.Thread(target=self._run, daemon=True, name=f"hetjax-send-{address}").start()

    def put(self, job: _Job) -> None:
        with self.lock:  # never behind close()'s None, where no thread would take it
            if self.closed:
                error = TransferError(f"send {job.tag!r}: the endpoint is closed")
            else:
                self.queued += 1
                # Idle, connected, and a small message that is ready: written here (the
                # lock keeps later puts behind it), acknowledged on the thread.
                written = (self.queued == 1 and self.sock is not None and job.small
                           and all(job.leaves[i].is_ready() for i in {c[0] for c in job.chunks}))
                try:
                    if written:
                        self._write(job)
                except BaseException as e:  # noqa: BLE001 - handed to the message's handle
                    self.sock.close()
                    self.sock, self.queued, error = None, self.queued - 1, e
                else:
                    self.jobs.put((job, written))
                    return
        job.finished(error)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.jobs.put(None)
        if self.sock is not None:
            self.sock.close()

    def _run(self) -> None:
        while (item := self.jobs.get()) is not None:
            job, written = item
            error = None
            try:
                if self.closed:
                    raise TransferError(f"send {job.tag!r}: the endpoint is closed")
                if not written:
                    if self.sock is None:
                        self.sock = self.endpoint._connect(self.address)
                    self._write(job)
                self._acknowledged(job)
            except BaseException as e:  # noqa: BLE001 - handed to the message's handle
                if self.sock is not None:
                    self.sock.close()
                    self.sock = None  # reconnect for the next job
                error = e
            with self.lock:
                self.queued -= 1
            job.finished(error)

    def _write(self, job: _Job) -> None:
        """Puts the job's chunks and its END on the wire (one _BATCH frame when small)."""
        if job.small:
            payloads, metas = [], []
            for k, (i, j, piece, sub, offset) in enumerate(job.chunks):
                payload = _payload(_host_chunk(job, k, self.endpoint))
                payloads.append(payload)
                metas.append(_chunk_meta(job, i, j, piece, offset, payload, self.endpoint))
            _sendall(self.sock, b"".join([_frame(_BATCH, {"tag": job.tag, "chunks": metas}), *payloads]), self.address)
            with _counted:
                job.handle.wire_bytes += sum(map(len, payloads))
            return
        ep, sock, address, tag = self.endpoint, self.sock, self.address, job.tag
        copy = _host_chunk(job, 0, ep)  # the next chunk's copy to the host runs while this one is sent
        pending = []  # small chunks wait here and go out together, in as few packets as they fit
        for k, (i, j, piece, sub, offset) in enumerate(job.chunks):
            data, copy = copy, (_host_chunk(job, k + 1, ep) if k + 1 < len(job.chunks) else None)
            payload = _payload(data)
            frame = {"tag": tag, **_chunk_meta(job, i, j, piece, offset, payload, ep)}
            if payload.nbytes <= _SMALL and sum(map(len, pending)) <= _SMALL:
                pending += [_frame(_CHUNK, frame), payload.tobytes()]
            else:
                _sendall(sock, b"".join(pending) + _frame(_CHUNK, frame), address)
                _sendall(sock, payload, address)
                pending = []
            with _counted:
                job.handle.wire_bytes += payload.nbytes
        # With TCP_NODELAY every write is a packet and a wake-up of the receiver: the last
        # small chunks and END go in one.
        _sendall(sock, b"".join(pending) + _frame(_END, {"tag": tag}), address)

    def _acknowledged(self, job: _Job) -> None:
        """Waits for the receiver's ACK: it verified every chunk of the job."""
        try:
            kind, meta = _read_frame(self.sock, self.address, idle_ok=False, timeout_s=self.endpoint.cfg.timeout_s)
        except PeerLost:
            raise TransferError(f"send {job.tag!r}: peer {self.address} closed the stream instead of acknowledging; "
                                f"see its log (wrong tag, shape, dtype or a failed checksum)") from None
        assert kind == _ACK and meta["tag"] == job.tag, (kind, meta)


def _payload(data) -> memoryview:
    return memoryview(np.ascontiguousarray(np.asarray(data)).reshape(-1).view(np.uint8))


def _chunk_meta(job: _Job, i: int, j: int, piece, offset: int, payload: memoryview, endpoint) -> dict:
    x = job.leaves[i]
    return {"leaf": i, "piece": j, "shape": list(x.shape), "dtype": np.dtype(x.dtype).name,
            "region": [list(r) for r in piece.region], "offset": offset, "n": payload.nbytes,
            "sum": endpoint._checksum(payload)}


def _host_chunk(job: _Job, k: int, endpoint: HostEndpoint):
    """Chunk k of a job as host memory: a view on CPU (no copy when contiguous; each
    shard is made a numpy array once per job, not once per chunk); elsewhere a
    device-side slice whose copy to the host starts now (it is read later)."""
    i, _, piece, sub, _ = job.chunks[k]
    x, plan = job.leaves[i], job.plans[i]
    within = plan.src_regions[piece.src]
    index = core.local_slices(sub, within)
    if (i, piece.src) in job.shards:
        return job.shards[i, piece.src][index]
    data = core.shard_on(x, piece.src)
    if next(iter(data.devices())).platform == "cpu":
        data.block_until_ready()  # the producing program's time is not a copy's
        t = time.perf_counter()
        job.shards[i, piece.src] = host = np.asarray(data)
        endpoint.copied(job.tag, t)
        return host[index]
    part = core.as_bits(data)[index]
    part.copy_to_host_async()
    return part
