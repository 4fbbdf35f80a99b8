"""The `host` backend's sending side: one TCP stream to a destination process and its thread.

Each stream has one sending thread for the life of the endpoint, which starts copying its
next chunk off the device while it sends the current one, writes END after a message's
chunks and waits for the receiver's ACK. A small message whose arrays are ready goes out
on the caller's thread when its stream is idle, which saves a thread hop (its ACK is
still read by the stream's thread).
"""

from __future__ import annotations

import queue
import select
import socket
import threading
import time
import typing

import numpy as np

from hetjax.errors import PeerLost
from hetjax.transfer import core, wire
from hetjax.transfer.link import TransferError, TransferTimeout
from hetjax.transfer.plan import split, volume

_counted = threading.Lock()  # guards Handle.wire_bytes across stream threads
_STREAM_BYTES = 1 << 20  # a message uses another stream for every MiB it holds, up to LinkConfig.streams


class Part(typing.NamedTuple):
    """One stream's share of a message to one destination, the same in every message of
    its route (host.py): its chunks, their headers but the checksums, and whether it
    goes as one BATCH frame (at most wire.SMALL bytes)."""

    chunks: list  # (leaf, piece index, piece, sub-region, byte offset in the piece)
    fields: list  # per chunk: wire.chunk_fields
    small: bool


def part(leaves, chunks) -> Part:
    """The Part of `chunks` of arrays like `leaves`."""
    fields, total = [], 0
    for i, j, piece, sub, offset in chunks:
        x = leaves[i]
        n = volume(sub) * np.dtype(x.dtype).itemsize
        fields.append(wire.chunk_fields(len(leaves), i, j, x.shape, x.dtype, piece.region, offset, n))
        total += n
    # One BATCH frame holds every chunk's header (and its sum, up to 30 characters more):
    # many tiny pieces (a transpose of small arrays) go as chunks, each a frame of its own.
    headers = sum(len(f) + 32 for f in fields)
    return Part(chunks, fields, total <= wire.SMALL and headers <= wire.MAX_HEADER // 2)


class Route(typing.NamedTuple):
    """How a message of one tree of plans goes out (see route)."""

    plans: list
    dests: list  # (destination process, its addresses, [Part, one per stream used])
    named: str  # the destinations, named for errors
    to: list  # the destination processes


def route(process: int, cfg, leaves, plans, tag: str, peers) -> Route:
    """The parts, per destination and stream, of a message of `leaves` (with their
    `plans`) sent by `process` over a link of `cfg`."""
    work: dict[int, list] = {}
    for i, plan in enumerate(plans):
        for j, piece in enumerate(plan.pieces):
            if piece.src_process == process:
                work.setdefault(piece.dst_process, []).append((i, j, piece))
    core.check_peers(peers, work, f"send {tag!r}", "destination")
    dests = []
    for q, items in sorted(work.items()):
        chunks = [(i, j, piece, sub, offset) for i, j, piece in items
                  for sub, offset in split(piece.region, np.dtype(leaves[i].dtype).itemsize, cfg.chunk_bytes)]
        if not chunks:  # nothing to send; and a stream with no chunk sends no END
            continue
        # Enough bytes per stream to pay for its own round trip; a small message takes one.
        used = max(1, min(cfg.streams, sum(p.nbytes for _, _, p in items) // _STREAM_BYTES, len(chunks)))
        dests.append((q, tuple(peers[q]), [part(leaves, chunks[k::used]) for k in range(used)]))
    return Route(plans, dests, wire.named(peers, sorted(work)), sorted(work))


class Job(typing.NamedTuple):
    """A Part of one message, and whom to tell when it is in."""

    tag: str
    message: int  # the send's id, in every frame of it (wire.chunk_frame)
    leaves: list
    plans: list
    part: Part
    handle: core.Handle
    finished: typing.Callable  # finished(None) once acknowledged, finished(error) on failure
    shards: dict  # (leaf, source position) -> the shard as a numpy array (CPU), made once
    by_position: dict  # leaf -> core.shards_by_position(leaf), made once


class Stream:
    """One TCP connection to a destination process, with its own thread that sends the
    jobs put to it in order: each job's chunks, then END, then it waits for the ACK
    (the receiver has verified every chunk). It connects on first use, and again after
    a failure."""

    def __init__(self, endpoint, address: str):
        self.endpoint, self.address = endpoint, address
        self.sock: socket.socket | None = None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # (job, already written)
        self.closed, self.lock = False, threading.Lock()
        self.queued = 0  # jobs put and not yet finished by the thread; 0: it leaves the socket alone
        self.current = None  # the tag of the message the thread is on
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"hetjax-send-{address}")
        self.thread.start()

    def put(self, job: Job) -> None:
        with self.lock:  # never behind close()'s None, where no thread would take it
            if self.closed:
                error = TransferError(f"send {job.tag!r}: the endpoint is closed")
            else:
                self.queued += 1
                # Idle, connected, and a small message that is ready: written here (the
                # lock keeps later puts behind it), acknowledged on the thread.
                written = (self.queued == 1 and self.sock is not None and job.part.small
                           and all(job.leaves[i].is_ready() for i in {c[0] for c in job.part.chunks}))
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
        self.abort(None)

    def abort(self, tag) -> None:
        """Cuts the connection if the thread is on message `tag` (None: any), which wakes
        it from a write or an ACK wait (a bare close() would not, on Linux); it reconnects
        for the next message."""
        with self.lock:
            sock = self.sock if tag is None or self.current == tag else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected any more
                pass

    def _run(self) -> None:
        try:
            self._serve()
        finally:  # a socket the thread opened after close() looked at it
            if self.sock is not None:
                self.sock.close()

    def _serve(self) -> None:
        while (item := self.jobs.get()) is not None:
            job, written = item
            if not written and job.handle.future.done():
                # Its message already failed or was given up: this part must not reach the
                # receiver after it, where a later message of the same tag would meet it.
                with self.lock:
                    self.queued -= 1
                job.finished(TransferError(f"send {job.tag!r}: part not sent, the message had already failed"))
                continue
            error = None
            with self.lock:
                self.current = job.tag
            try:
                if self.closed:
                    raise TransferError(f"send {job.tag!r}: the endpoint is closed")
                if not written:
                    if self.sock is None:
                        self.sock = self.endpoint.connect(self.address)
                        if self.closed:  # close() came while it connected, and found no socket to shut
                            raise TransferError(f"send {job.tag!r}: the endpoint is closed")
                    self._write(job)
                self._acknowledged(job)
            except BaseException as e:  # noqa: BLE001 - handed to the message's handle
                error = e
                if self.closed and isinstance(e, TransferError):  # close() cut it: not the peer's doing
                    error = TransferError(f"send {job.tag!r}: this endpoint was closed while the message was in "
                                          f"flight to peer {self.address}")
                elif self.sock is not None and isinstance(e, TransferTimeout) and not isinstance(e, PeerLost):
                    error = TransferTimeout(  # the socket's timeout
                        f"send {job.tag!r}: peer {self.address} neither read nor acknowledged the message "
                        f"within {self.endpoint.cfg.busy_timeout_s:g} s (LinkConfig.busy_timeout_s)")
                if self.sock is not None:
                    self.sock.close()
                    self.sock = None  # reconnect for the next job
            with self.lock:
                self.queued -= 1
                self.current = None
            job.finished(error)

    def _write(self, job: Job) -> None:
        """Puts the job's chunks and its END on the wire (one BATCH frame when small)."""
        chunks, fields = job.part.chunks, job.part.fields
        if job.part.small:
            # Every chunk's copy off the device starts before the first is waited for.
            hosts = [_host_chunk(job, k, self.endpoint) for k in range(len(chunks))]
            payloads = [_payload(h) for h in hosts]
            sums = [wire.chunk_sum(self.endpoint.checksum, len(job.leaves), i, j, offset, payload)
                    for (i, j, _, _, offset), payload in zip(chunks, payloads)]
            wire.sendall(self.sock, b"".join([wire.batch_frame(job.tag, job.message, fields, sums), *payloads]), self.address)
            with _counted:
                job.handle.wire_bytes += sum(map(len, payloads))
            return
        ep, sock, address, tag = self.endpoint, self.sock, self.address, job.tag
        copy = _host_chunk(job, 0, ep)  # the next chunk's copy to the host runs while this one is sent
        pending = []  # small chunks wait here and go out together, in as few packets as they fit
        for k in range(len(chunks)):
            data, copy = copy, (_host_chunk(job, k + 1, ep) if k + 1 < len(chunks) else None)
            payload = _payload(data)
            i, j, _, _, offset = chunks[k]
            total = wire.Sum(ep.checksum, len(job.leaves), i, j, offset, payload.nbytes)
            frame = wire.chunk_frame(tag, job.message, fields[k])
            if payload.nbytes <= wire.SMALL and sum(map(len, pending)) <= wire.SMALL:
                total.update(payload)
                pending += [frame, payload.tobytes(), total.trailer()]
            else:
                self._refused(job)
                wire.sendall(sock, b"".join(pending) + frame, address)
                wire.send_summed(sock, payload, total, address)
                pending = []
            with _counted:
                job.handle.wire_bytes += payload.nbytes
        # With TCP_NODELAY every write is a packet and a wake-up of the receiver: the last
        # small chunks and END go in one.
        wire.sendall(sock, b"".join(pending) + wire.frame(wire.END, {"tag": tag}), address)

    def _refused(self, job: Job) -> None:
        """Raises the receiver's refusal when one waits: a receiver writes nothing else while a
        message comes in. Read only at the end, a refusal was lost when the rest of a large
        message took longer to write than the receiver drains it for (then it closes, and
        the sender saw a lost peer)."""
        try:  # (a socket with a timeout waits in recv even with MSG_DONTWAIT: poll first;
            # select() refuses descriptors from 1024 on, which a busy trainer reaches)
            poll = select.poll()
            poll.register(self.sock, select.POLLIN)
            waiting = poll.poll(0) and self.sock.recv(1, socket.MSG_PEEK)
        except OSError:  # the next write names the loss
            return
        if waiting:
            self._acknowledged(job)  # a REFUSE frame: raises its reason

    def _acknowledged(self, job: Job) -> None:
        """Waits for the receiver's ACK: it verified every chunk of the job."""
        try:
            kind, meta = wire.read_frame(self.sock, self.address, idle_ok=False, timeout_s=self.endpoint.cfg.busy_timeout_s)
        except PeerLost as e:  # a refusal comes as a REFUSE frame: a bare end means the peer is gone
            raise PeerLost(f"send {job.tag!r}: lost peer {self.address}: its connection ended before it "
                           f"acknowledged the message (its process died or closed its endpoint; {e})") from None
        if kind == wire.REFUSE:
            raise TransferError(f"send {job.tag!r}: peer {self.address} refused the message: {meta.get('reason')}")
        if kind != wire.ACK or meta.get("tag") != job.tag:  # a protocol check: kept under python -O
            raise TransferError(f"send {job.tag!r}: peer {self.address} answered with frame kind {kind} for tag "
                                f"{meta.get('tag')!r}, not the message's acknowledgement; is it a hetjax endpoint "
                                f"of the same version?")


def _payload(data) -> memoryview:
    return memoryview(np.ascontiguousarray(np.asarray(data)).reshape(-1).view(np.uint8))


def _host_chunk(job: Job, k: int, endpoint):
    """Chunk k of a job as host memory: a view on CPU (no copy when contiguous; each
    shard is made a numpy array once per job, not once per chunk); elsewhere a
    device-side slice whose copy to the host starts now (it is read later)."""
    i, _, piece, sub, _ = job.part.chunks[k]
    x, plan = job.leaves[i], job.plans[i]
    within = plan.src_regions[piece.src]
    index = core.local_slices(sub, within)
    if (i, piece.src) in job.shards:
        return job.shards[i, piece.src][index]
    if i not in job.by_position:  # one walk over the leaf's shards, not one per piece
        job.by_position[i] = core.shards_by_position(x)
    data = core.shard_on(x, piece.src, job.by_position[i])
    if next(iter(data.devices())).platform == "cpu":
        data.block_until_ready()  # the producing program's time is not a copy's
        t = time.perf_counter()
        job.shards[i, piece.src] = host = np.asarray(data)
        endpoint.copied(job.tag, t)
        return host[index]
    part = core.as_bits(data)[index]
    part.copy_to_host_async()
    return part
