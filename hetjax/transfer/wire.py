"""The `host` backend's wire format: frames, the secret handshake, chunk checksums.

A frame is `FRAME` (magic, kind, length of the JSON header that follows) and that JSON
header; a chunk's payload follows its header unframed, and its checksum (`TRAILER`)
follows the payload, so that both sides sum each slice of it while the slice is in
cache. Every connection starts with an HMAC challenge-response in both directions under
the job's shared secret. The probe's control channel (probe.py) speaks the same frames
with a kind of its own.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import time
import zlib

import numpy as np
import xxhash

from hetjax.errors import PeerLost  # noqa: F401 - raised here, caught by callers
from hetjax.transfer import link
from hetjax.transfer.link import TransferError, TransferTimeout

log = logging.getLogger("hetjax.transfer")

FRAME = struct.Struct("<4sBI")  # magic, kind, length of the JSON header that follows
MAGIC = b"HJX2"  # HJX1 put a chunk's checksum in its header
CHUNK, END, ACK, BATCH = 1, 2, 3, 4  # BATCH: a whole small message; an END is implied
# The receiver's refusal of a message, sent before it hangs up: {"tag", "reason"}. A
# sender that sees the connection end without one knows its peer is gone, not displeased.
REFUSE = 5
# A liveness question on a connection of its own, answered from the endpoint's threads
# with the process's status ({"status"}), whatever its main thread is busy with.
PING, PONG = 6, 7
CHECKSUM_FUNCTIONS = {"xxh3": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32, "adler32": zlib.adler32}
SMALL = 64 << 10  # a chunk (or a whole message) this small goes out with its header(s) in one write
MAX_HEADER = 1 << 20  # a frame's JSON header, at most: a longer one is refused unread
TRAILER = struct.Struct("<Q")  # a CHUNK's checksum, after its payload
# A chunk is summed and moved this much at a time. Summed whole, an 8 MiB chunk is read
# from memory once more on each side (xxh3 ran at 8 GB/s there against 24-35 GB/s in
# cache on this machine); summed a slice at a time, each slice is still in cache.
SLICE = 256 << 10


def _seed(leaves: int, leaf: int, piece: int, offset: int, n: int) -> int:
    return ((((leaves * 1_000_003 + leaf) * 1_000_003 + piece) * 1_000_003 + offset) * 1_000_003 + n) & 0xFFFFFFFF


def chunk_sum(checksum: str, leaves: int, leaf: int, piece: int, offset: int, payload) -> int:
    """A chunk's LinkConfig.checksum: its payload's, seeded with the header fields that say
    where the payload lands, so a damaged header (another offset, piece or leaf count) is
    caught as damaged data is. (The tag picks the receive and the region is checked against
    the receiver's plan: neither can misplace bytes unseen.) Every checksum takes a
    starting value second; the seed is plain arithmetic, a microsecond less than hashing text."""
    return CHECKSUM_FUNCTIONS[checksum](payload, _seed(leaves, leaf, piece, offset, len(payload)))


class Sum:
    """chunk_sum of a chunk of n bytes, taken a slice at a time (update, in order)."""

    def __init__(self, checksum: str, leaves: int, leaf: int, piece: int, offset: int, n: int):
        seed = _seed(leaves, leaf, piece, offset, n)
        if checksum == "xxh3":
            h = xxhash.xxh3_64(seed=seed)
            self.update, self.value = h.update, h.intdigest
        else:
            function, self._value = CHECKSUM_FUNCTIONS[checksum], seed

            def update(data):
                self._value = function(data, self._value)
            self.update, self.value = update, lambda: self._value

    def trailer(self) -> bytes:
        return TRAILER.pack(self.value())


def send_summed(sock, payload: memoryview, total: Sum, peer: str) -> None:
    """Writes a chunk's payload slice by slice, each summed into `total` just after it
    went, then the checksum (a chunk the receiver began ends with it). After: the kernel's
    copy has just read the slice from memory, so the sum reads it from cache."""
    for at in range(0, len(payload), SLICE):
        part = payload[at:at + SLICE]
        sendall(sock, part, peer)
        total.update(part)
    sendall(sock, total.trailer(), peer)


def recv_summed(sock, view: memoryview, total: Sum, peer: str) -> int:
    """Fills `view` slice by slice, each summed into `total` as it lands, then reads the
    sender's checksum that follows (returned)."""
    for at in range(0, len(view), SLICE):
        part = view[at:at + SLICE]
        recv_into(sock, part, peer)
        total.update(part)
    return TRAILER.unpack(recv_exact(sock, TRAILER.size, peer))[0]


def _mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def recv_into(sock, view: memoryview, peer: str) -> None:
    """Fills `view` from the socket; TransferTimeout when the peer goes silent, PeerLost
    when its connection ends."""
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


def recv_exact(sock, n: int, peer: str) -> bytes:
    """The next n bytes from the socket (see recv_into for the errors)."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), peer)
    return bytes(buf)


def sendall(sock, data, peer: str) -> None:
    """Writes all of `data`, with the errors recv_into raises."""
    try:
        sock.sendall(data)
    except socket.timeout:
        raise TransferTimeout(f"peer {peer} stopped reading (LinkConfig.timeout_s)") from None
    except OSError as e:
        raise PeerLost(f"peer {peer}: connection lost ({e})") from None


def frame(kind: int, meta: dict) -> bytes:
    """A frame of `kind` carrying `meta` as its JSON header."""
    return _frame(kind, json.dumps(meta))


def _frame(kind: int, header: str) -> bytes:
    head = header.encode()
    return FRAME.pack(MAGIC, kind, len(head)) + head


def chunk_fields(leaves: int, leaf: int, piece: int, shape, dtype, region, offset: int, n: int) -> str:
    """A chunk header's fields but its checksum, as JSON text: the same in every message
    of a route (a step sends the same arrays each time), so written once, not per chunk."""
    return json.dumps({"leaves": leaves, "leaf": leaf, "piece": piece, "shape": list(shape), "dtype": dtype_name(dtype),
                       "region": [list(r) for r in region], "offset": offset, "n": n})[1:-1]


@functools.cache
def dtype_name(dtype) -> str:
    """The dtype's name, as a chunk header gives it."""
    return np.dtype(dtype).name  # numpy works the name out anew at each call: 4 us a chunk


def chunk_frame(tag: str, message: int, fields: str) -> bytes:
    """A CHUNK frame: the chunk's header (see chunk_fields) with its tag and its message's
    id (host.send's, one per send: the receiver tells a message's late chunks from the
    next one's by it). Its payload follows, then the payload's checksum (TRAILER)."""
    return _frame(CHUNK, f'{{"tag": {json.dumps(tag)}, "msg": {message}, {fields}}}')


def batch_frame(tag: str, message: int, fields: list[str], checksums: list[int]) -> bytes:
    """A BATCH frame: the headers of a whole small message's chunks (their payloads follow)."""
    chunks = ", ".join(f'{{{f}, "sum": {c}}}' for f, c in zip(fields, checksums))
    return _frame(BATCH, f'{{"tag": {json.dumps(tag)}, "msg": {message}, "chunks": [{chunks}]}}')


def send_frame(sock, kind: int, meta: dict, peer: str) -> None:
    """Writes one frame."""
    sendall(sock, frame(kind, meta), peer)


def read_frame(sock, peer: str, idle_ok: bool, timeout_s: float) -> tuple[int, dict]:
    """(kind, header) of the next frame. With idle_ok the connection may stay silent
    forever before the frame starts (EOFError if it closes then); timeout_s bounds the rest."""
    if idle_ok:  # a persistent connection may sit idle between transfers
        sock.settimeout(None)
        try:
            first = sock.recv(1)
        except OSError as e:  # reset, or the peer's machine gone (keepalive)
            raise PeerLost(f"peer {peer}: connection lost ({e})") from None
        if not first:
            raise EOFError
        sock.settimeout(timeout_s)
        raw = first + recv_exact(sock, FRAME.size - 1, peer)
    else:
        raw = recv_exact(sock, FRAME.size, peer)
    magic, kind, n = FRAME.unpack(raw)
    if magic != MAGIC:
        raise TransferError(f"peer {peer} sent a frame that is not a hetjax transfer frame (or one of another "
                            f"hetjax version: both sides must run the same)")
    if n > MAX_HEADER:
        raise TransferError(f"peer {peer} sent a frame header of {n} bytes; at most {MAX_HEADER} are read")
    try:
        meta = json.loads(recv_exact(sock, n, peer))
    except ValueError as e:
        raise TransferError(f"peer {peer} sent a frame header that is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise TransferError(f"peer {peer} sent a frame header that is not a JSON object: {type(meta).__name__}")
    return kind, meta


NOT_PROVED = "it did not prove the job's shared secret"


def refuse(sock, tag, reason: str, peer: str, drain_s: float) -> None:
    """Tells the sender why its message is refused, then reads and drops what it still
    writes (up to drain_s) so that closing sends no reset that could discard the refusal
    before the sender reads it. Best effort: the sender may be gone already."""
    try:
        sock.settimeout(drain_s)
        sock.sendall(frame(REFUSE, {"tag": tag, "reason": reason[:2000]}))
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and sock.recv(1 << 16):
            pass
    except OSError:
        pass


def authenticate(conn, secret: bytes, peer: str, quiet: bool = False) -> bool:
    """The accepting side of the handshake: True once the peer proved the job's secret
    (and got our proof back); False when it did not (logged unless quiet: the caller
    logs it then, at a bounded rate)."""
    nonce = os.urandom(32)
    conn.sendall(nonce)
    answer = recv_exact(conn, 64, peer)
    if not hmac.compare_digest(answer[32:], _mac(secret, b"client", nonce)):
        if not quiet:
            log.warning("transfer: refused a connection from %s: %s", peer, NOT_PROVED)
        return False
    conn.sendall(_mac(secret, b"server", answer[:32]))
    return True


def ping(address: str, secret: bytes, timeout_s: float) -> tuple[str | None, str]:
    """(the status of the endpoint at `address`, "") when it answers within timeout_s;
    (None, why not) when it does not: gone, stopped, unreachable, or another secret."""
    try:  # one attempt: a refused connection is a process gone, not one starting
        sock = connect(address, secret, timeout_s, retry=False)
    except (TransferError, OSError) as e:
        return None, str(e)
    try:  # the connection keeps connect's timeout_s for each read and write
        send_frame(sock, PING, {}, address)
        kind, meta = read_frame(sock, address, idle_ok=False, timeout_s=timeout_s)
        return (str(meta.get("status", "")), "") if kind == PONG else (None, f"answered with frame kind {kind}")
    except (TransferError, OSError, ValueError) as e:
        return None, str(e)
    finally:
        sock.close()


def named(peers, processes) -> str:
    """'process 0 at 10.0.0.1:5000, process 1': the peers a message's description names."""
    return ", ".join(f"process {p}" + (f" at {','.join(peers[p])}" if peers and p in peers else "") for p in processes)


def pinger(peers, processes, secret: bytes, timeout_s: float, pending=None):
    """A function that pings `processes` (at their peers[p] addresses): (True, their
    statuses) when all answer, (False, which one did not and why) otherwise. `pending()`,
    when given, narrows them at each ping to those still owing data (one that delivered
    its part may have exited since). None (no pings) when a process has no address."""
    if not peers or not all(peers.get(p) for p in processes):
        return None

    def alive() -> tuple[bool, str]:
        answers = []
        for p in processes if pending is None else pending():
            failed = []
            for address in peers[p]:  # any of its NICs answering will do
                status, why = ping(address, secret, timeout_s)
                if status is not None:
                    answers.append(f"process {p}: {status}")
                    break
                failed.append(f"{address}: {why}" if len(peers[p]) > 1 else why)
            else:
                return False, f"process {p} at {','.join(peers[p])} did not answer a ping ({'; '.join(failed)})"
        return True, "; ".join(answers) or "no peer owes its part any more"
    return alive


def connect(address: str, secret: bytes, timeout_s: float, retry: bool = True, stop=None) -> socket.socket:
    """A connection to `address` ("host:port") on which both sides proved the job's
    secret; retries while the peer starts (with `retry`, until stop() if given),
    TransferTimeout after timeout_s."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")

    def attempt():  # the peer may be starting, or hang up before its challenge: too many in their handshake
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        try:
            return sock, recv_exact(sock, 32, address)
        except BaseException:
            sock.close()
            raise

    sock, challenge = link.retry(attempt, timeout_s if retry else 0.0, 0.05, lambda e: TransferTimeout(
        f"peer {address} did not accept a connection within {timeout_s:g} s ({e})"), stop)
    try:  # a failed handshake closes the socket: the error kept in a send's handle must not hold it
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(32)
        sock.sendall(nonce + _mac(secret, b"client", challenge))
        try:
            proof = recv_exact(sock, 32, address)
        except PeerLost:
            raise TransferError(f"peer {address} refused the connection: the shared secrets differ") from None
        if not hmac.compare_digest(proof, _mac(secret, b"server", nonce)):
            raise TransferError(f"peer {address} did not prove the job's shared secret; not sending to it")
    except BaseException:
        sock.close()
        raise
    return sock
