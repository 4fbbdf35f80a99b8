"""The `host` backend: device -> host buffer -> N TCP streams -> host buffer -> device.

Each process listens on its NIC addresses (loopback by default). A sender opens `streams`
connections to each destination process it feeds (stream i to the peer's address i % len),
proves the job's secret by HMAC challenge-response (both ways), then pushes chunks: a JSON
header (tag, leaf, piece, shape, dtype, region, offset, length), the payload, its checksum
(a message of at most 64 KiB: one frame, all headers and checksums, then all payloads).
The receiver checks each header against its plan, sums the payload slice by slice as it
lands, checks the sum, and moves a block to the device once its pieces are in. Here: the
endpoint and its receiving side; inbox.py a posted receive, wire.py the frames, handshake
and pings, stream.py the sending streams.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import secrets
import socket
import threading
import time

from hetjax.errors import PeerLost
from hetjax.transfer import buffers, core, link, stream, wire
from hetjax.transfer.api import Endpoint
from hetjax.transfer.inbox import Inbox, Withdrawn
from hetjax.transfer.link import TransferError, TransferTimeout
from hetjax.transfer.stream import Job, Stream

log = logging.getLogger("hetjax.transfer")

# How long close() waits for the END frames of messages that already arrived: they follow
# their last chunk at once, so this is only reached when a sender died mid-message.
CLOSE_GRACE_S = 5.0
# Anyone who can reach the port can open connections: one not proved yet holds a thread and
# a descriptor, so at most this many at a time per endpoint, each for at most HANDSHAKE_S
# (not timeout_s), and refusals are logged at most once per REFUSAL_LOG_S (with a count of
# those not logged). A silent peer's ping waits as long per step: a starved peer answers late.
MAX_UNAUTHENTICATED = 32
HANDSHAKE_S = 5.0
REFUSAL_LOG_S = 10.0


class HostEndpoint(Endpoint):
    def __init__(self, cfg, process_index=None):
        super().__init__(cfg, process_index)
        self._secret = cfg.secret()
        self.checksum = cfg.checksum  # wire.CHECKSUM_FUNCTIONS' name
        self._inboxes: dict[str, Inbox] = {}
        self._sending: set[str] = set()  # the tags of sends in flight
        self.buffers = buffers.BufferPool()  # where received pieces land
        self._posted = threading.Condition()
        self._withdrawn = Withdrawn()  # the messages of receives that ended, whose late chunks are refused
        self._pipes: dict[tuple, list[Stream]] = {}
        self._pipes_lock = threading.Lock()
        self._routes: dict[tuple, stream.Route] = {}
        self._turn = itertools.count()  # the stream a message starts on, round robin
        self._conns: set[socket.socket] = set()  # open incoming connections (close() ends them)
        self._gate = threading.Lock()  # guards _conns, _unauthenticated, the refusal log and bytes_received
        self._unauthenticated = 0
        self._threads: set[threading.Thread] = set()  # accepting and receiving (close() waits for them)
        self._log_after, self._unlogged = 0.0, 0
        self._shut = False  # close() shut the sockets (self.closed, Endpoint's, is set as it begins)
        # Streams holding chunks whose END is not acknowledged yet: a receive completes
        # when its last byte lands, just before the END frame is read and acknowledged,
        # so close() waits for these or the sender would see its peer vanish.
        self._unacked = 0
        self._quiet = threading.Condition()
        self.refused = 0  # connections refused: wrong secret, no handshake in time, too many at once
        self.accept_errors, self.bytes_received = 0, 0  # accept_errors: failed accept() calls, each survived
        self._listeners, addresses = [], []
        for host in cfg.listen_addresses:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, cfg.port))
            except OSError as e:
                s.close()
                self.close()  # the addresses already bound, and their accepting threads
                raise TransferError(f"link.bind_address/nic_addresses: cannot listen on {host}:{cfg.port} ({e})") from None
            s.listen(64)
            self._listeners.append(s)
            addresses.append(link.address(host, s.getsockname()[1]))
            self._start(self._accept, s, addresses[-1], name=f"hetjax-accept-{addresses[-1]}")
        self.addresses = tuple(addresses)

    # -- receiving -------------------------------------------------------------------

    def recv(self, tag, like, src, peers=None):
        expect = self.prepare_recv(tag, like, src)
        senders = sorted({p.src_process for plan in expect.plans for p in plan.received_by(self.process)})
        if peers is not None:  # as send checks its own: a string's characters were pinged one by one
            core.check_peers(peers, senders, f"recv {tag!r}", "source")
        handle = core.Handle(core.futures.Future(), f"recv {tag!r} from source {wire.named(peers, senders)}")
        inbox = Inbox(self, tag, expect, handle)
        handle.watch(inbox.activity.idle, self.cfg.timeout_s,
                     wire.pinger(peers, senders, self._secret, HANDSHAKE_S, inbox.owing()), self.cfg.busy_timeout_s)
        with self._posted:
            self.check_open(f"recv {tag!r}")
            if tag in self._inboxes:
                raise self.twin(tag)
            self._inboxes[tag] = inbox
            self._posted.notify_all()
        # By id, not the inbox itself: the handle's future keeps its callbacks, and an inbox
        # it held would keep the received buffers from the pool until a garbage collection.
        handle.future.add_done_callback(lambda f, key=id(inbox): self._drop(tag, key, f.exception()))
        if not inbox.left:
            inbox.finish()
        return handle

    def _drop(self, tag, key: int, failed):
        with self._posted:  # a receive that failed: the rest of its messages is refused (_inbox)
            if id(self._inboxes.get(tag)) == key:
                messages = self._inboxes.pop(tag).messages
                self._withdrawn.add(messages if failed is not None else set())

    def _start(self, target, *args, name: str) -> None:
        """Starts one of this endpoint's threads, which close() waits for."""
        thread = threading.Thread(target=self._finally_gone, args=(target, *args), daemon=True, name=name)
        with self._gate:
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._gate:
                self._threads.discard(thread)
            raise

    def _finally_gone(self, target, *args) -> None:
        try:
            target(*args)
        finally:
            with self._gate:
                self._threads.discard(threading.current_thread())

    def _accept(self, listener, here: str):
        """Accepts connections until close(). An accept error (out of descriptors or memory)
        is waited out with a growing pause, connections waiting in the kernel's backlog."""
        pause = 0.0
        while not self._shut:
            try:
                conn, addr = listener.accept()
            except OSError as e:
                if self._shut:
                    return
                pause = min(1.0, 2 * pause or 0.01)
                self.accept_errors += 1
                self._log(f"transfer: the listener on {link.address(*listener.getsockname()[:2])} cannot accept "
                          f"a connection ({e}); retrying")
                time.sleep(pause)
                continue
            if self._shut:  # arrived as close() ran
                conn.close()
                return
            pause, peer = 0.0, link.address(*addr[:2])
            with self._gate:
                room = self._unauthenticated < MAX_UNAUTHENTICATED
                if room:
                    self._unauthenticated += 1
            if not room:
                conn.close()
                self._refused(peer, f"{MAX_UNAUTHENTICATED} connections are already in their handshake")
                continue
            try:
                self._start(self._serve, conn, peer, name=f"hetjax-recv-{here}")
            except RuntimeError as e:  # no thread to be had: refused like any other excess
                with self._gate:
                    self._unauthenticated -= 1
                conn.close()
                self._refused(peer, str(e))

    def _refused(self, peer, why: str) -> None:
        with self._gate:
            self.refused += 1
        self._log(f"transfer: refused a connection from {peer}: {why}")

    def _log(self, text: str) -> None:
        """Logs a refusal or an accept error at most once per REFUSAL_LOG_S (a flood of them is one line)."""
        with self._gate:
            now = time.monotonic()
            if now < self._log_after:
                self._unlogged += 1
                return
            self._log_after, unlogged, self._unlogged = now + REFUSAL_LOG_S, self._unlogged, 0
        more = f" ({unlogged} more such events not logged in the last {REFUSAL_LOG_S:g} s)" if unlogged else ""
        log.warning("%s%s", text, more)

    def _handshake(self, conn, peer) -> bool:
        """The secret's handshake under its own short deadline; False (refused) when the
        peer does not prove the secret in time. Leaves the unauthenticated count."""
        deadline = HANDSHAKE_S
        try:
            conn.settimeout(deadline)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if wire.authenticate(conn, self._secret, peer, quiet=True):
                return True
            why = wire.NOT_PROVED
        except (OSError, TransferError) as e:  # silent, gone or garbage
            why = f"no handshake within {deadline:g} s ({e})"
        finally:
            with self._gate:
                self._unauthenticated -= 1
        self._refused(peer, why)
        return False

    def _serve(self, conn, peer):
        """One incoming stream: handshake, then chunks until the peer closes. A message
        this side refuses is answered with a REFUSE frame naming why, so the sender can
        tell a refusal from a peer that died."""
        with self._gate:
            self._conns.add(conn)
        inbox, busy, tag = None, False, None
        began = None  # (tag, its receive) of the chunked message this stream is in the middle of
        try:
            if not self._handshake(conn, peer):
                return
            conn.settimeout(self.cfg.timeout_s)
            while True:
                try:
                    kind, meta = wire.read_frame(conn, peer, idle_ok=True, timeout_s=self.cfg.timeout_s)
                except (EOFError, TransferError) as e:  # closed, reset, silent or garbled
                    if began is None and isinstance(e, EOFError):
                        return
                    if began is None:
                        raise
                    inbox = began[1]  # the rest of its message cannot come: fail it now, not at busy_timeout_s
                    raise (PeerLost(f"recv {began[0]!r}: peer {peer} closed its stream in the middle of the message "
                                    f"(its send failed, or it was stopped)") if isinstance(e, EOFError)
                           else type(e)(f"recv {began[0]!r}, between two chunks: {e}")) from None
                if kind == wire.PING:
                    wire.send_frame(conn, wire.PONG, {"status": self.status}, peer)
                    continue
                tag = meta.get("tag")
                if kind != wire.END:
                    busy = busy or self._settle(+1)
                    inbox = self._inbox(tag, peer, meta.get("msg"))
                    if kind == wire.BATCH:  # the chunks' headers, then their payloads in that order
                        self._batch(conn, peer, inbox, meta["chunks"])
                    else:
                        self._chunk(conn, peer, inbox, meta)
                        began = (tag, inbox)
                    inbox = None
                else:
                    began = None
                if kind in (wire.END, wire.BATCH):  # every chunk of the message was verified
                    wire.send_frame(conn, wire.ACK, {"tag": tag}, peer)
                    busy = busy and self._settle(-1)
        except Exception as e:  # noqa: BLE001 - reported to the receive it broke, and logged
            if inbox is not None:
                inbox.fail(e)
            if busy:  # before the refusal's drain: close() need not wait for it
                busy = self._settle(-1)
            if not self._shut:
                log.warning("transfer: stream from %s closed: %s", peer, e)
                if not isinstance(e, TransferTimeout):  # a refusal, not a peer gone silent or away
                    wire.refuse(conn, tag, str(e), peer, min(self.cfg.timeout_s, CLOSE_GRACE_S))
        finally:
            if busy:
                self._settle(-1)
            with self._gate:
                self._conns.discard(conn)
            conn.close()

    def _settle(self, change: int) -> bool:
        """Counts a stream into (+1) or out of (-1) the unacknowledged ones; True when in."""
        with self._quiet:
            self._unacked += change
            self._quiet.notify_all()
        return change > 0

    def _inbox(self, tag, peer, message) -> Inbox:
        """The posted receive for `tag`, waited for up to busy_timeout_s (its process is busy:
        compiling, restoring, a long step). The rest of a failed (withdrawn) receive's message
        is refused on any stream: checked and taken in under the lock _drop holds."""
        deadline = time.monotonic() + self.cfg.busy_timeout_s
        with self._posted:
            self._withdrawn.check(tag, message, peer)
            while tag not in self._inboxes:
                left = deadline - time.monotonic()
                if self.closed:
                    raise TransferError(f"peer {peer} sent tag {tag!r}, but no receive for it was posted before "
                                        f"this endpoint began to close; message refused")
                if left <= 0:
                    raise TransferError(f"peer {peer} sent tag {tag!r}, but no receive for it was posted "
                                        f"within {self.cfg.busy_timeout_s:g} s (LinkConfig.busy_timeout_s); "
                                        f"message refused")
                self._posted.wait(left)
            self._withdrawn.check(tag, message, peer)
            self._inboxes[tag].messages.add(message)
            return self._inboxes[tag]

    def _chunk(self, conn, peer, inbox: Inbox, meta: dict) -> None:
        i, j, offset, n, view = inbox.place(peer, meta)
        inbox.claim(i, j, offset, n, peer)
        inbox.handle.arriving()
        total = wire.Sum(self.checksum, meta["leaves"], i, j, offset, n)
        try:
            sent = wire.recv_summed(conn, view, total, peer)
        except TransferTimeout as e:  # PeerLost too
            raise inbox.cut(e, i, j) from None
        inbox.verify(peer, meta, n, total.value(), sent)
        inbox.activity.touch()
        with self._gate:  # several streams count at once
            self.bytes_received += n
        inbox.arrived(i, j, offset, n)

    def _batch(self, conn, peer, inbox: Inbox, metas: list) -> None:
        """A whole small message: every header checked, its payloads in one read, then
        each chunk verified and claimed in turn (as _chunk would, chunk after chunk)."""
        places = [inbox.place(peer, meta) for meta in metas]
        total = sum(n for _, _, _, n, _ in places)
        if total > wire.SMALL:
            raise TransferError(f"recv {inbox.tag!r}: peer {peer} sent a batch of {total} bytes; a batch holds at "
                                f"most {wire.SMALL}")
        inbox.handle.arriving()
        payloads = memoryview(bytearray(total))
        try:
            wire.recv_into(conn, payloads, peer)
        except TransferTimeout as e:
            raise inbox.cut(e, *places[0][:2]) from None
        at = 0
        for meta, (i, j, offset, n, view) in zip(metas, places):
            payload = payloads[at:at + n]
            inbox.verify(peer, meta, n, wire.chunk_sum(self.checksum, meta["leaves"], i, j, offset, payload), meta["sum"])
            inbox.claim(i, j, offset, n, peer)
            view[:] = payload
            at += n
        inbox.activity.touch()
        with self._gate:
            self.bytes_received += total
        for i, j, offset, n, _ in places:
            inbox.arrived(i, j, offset, n)

    # -- sending ---------------------------------------------------------------------

    def send(self, tree, tag, dst, peers=None):
        leaves, plans, _ = self.prepare_send(tree, tag, dst)
        route = self._route(leaves, plans, tag, peers)
        handle = core.Handle(core.futures.Future(), f"send {tag!r} to destination {route.named}")
        message = secrets.randbits(63)  # not `random`'s: a seeded one (a test's) repeats it
        jobs = []  # (destination, stream, part)
        for q, addresses, parts in route.dests:
            streams = self._streams(addresses)
            first = next(self._turn) % len(streams)
            jobs += [(q, streams[(first + k) % len(streams)], part) for k, part in enumerate(parts)]
        with self._posted:  # two messages of one tag would interleave at the receiver
            if tag in self._sending:
                raise TransferError(f"send {tag!r}: a send with this tag is still in flight; tags must be unique "
                                    f"in flight (wait for its handle first)")
            if jobs:
                self._sending.add(tag)
        if not jobs:
            handle.future.set_result(None)
        owed = collections.Counter(q for q, _, _ in jobs)  # each destination's jobs not yet off their streams
        lock = threading.Lock()

        def finished(q, error):  # from the streams' threads: the first error, or the last success, counts
            with lock:
                owed[q] -= 1
                last = not any(owed.values())
                if last:  # every part is off its stream (a failed message's too): the tag is free
                    self._sending.discard(tag)
                if error is not None or last:
                    core.settle(handle.future, None, error)

        # Its streams wait for a busy receiver (busy_timeout_s); a ping tells busy from lost,
        # asked of the destinations that have not acknowledged their parts yet.
        handle.watch(core.progress_idle(handle), self.cfg.timeout_s,
                     wire.pinger(peers, route.to, self._secret, HANDSHAKE_S,
                                 lambda: sorted(q for q, n in owed.items() if n)), self.cfg.busy_timeout_s)
        for q, pipe, part in jobs:
            pipe.put(Job(tag, message, leaves, plans, part, handle, functools.partial(finished, q), {}, {}))
        # A send its waiter gave up on (TransferTimeout) frees its streams for the next ones.
        handle.future.add_done_callback(lambda f: [s.abort(tag) for _, s, _ in jobs] if f.exception() else None)
        return handle

    def _route(self, leaves, plans, tag, peers) -> stream.Route:
        """How a message of these plans goes out: its parts per destination and stream.
        Made once per (plans, dtypes, peers) and kept: a step sends the same every time,
        and working it out again cost more than a small message's trip."""
        try:  # plans are kept in the route: their ids stay theirs
            key = (tuple(map(id, plans)), tuple(x.dtype for x in leaves),
                   tuple((q, a if isinstance(a, str) else tuple(a)) for q, a in peers.items()) if peers else None)
            route = self._routes.get(key)
        except TypeError:  # an odd peers entry: check_peers names it if the message goes there
            key = route = None
        if route is not None:
            return route
        route = stream.route(self.process, self.cfg, leaves, plans, tag, peers)
        if key is not None:
            if len(self._routes) >= 256:  # a job's routes are a few; more is a sweep of shapes
                self._routes.clear()
            self._routes[key] = route
        return route

    def connect(self, address: str) -> socket.socket:
        """A new authenticated connection to a peer's `address` (a stream's, on its first use).
        Its writes and its wait for an ACK may outlast timeout_s while the receiver is busy
        (its receive not yet posted); the send's waiter pings it meanwhile (send)."""
        sock = wire.connect(address, self._secret, self.cfg.timeout_s, stop=lambda: self.closed)  # close() ends retries
        sock.settimeout(self.cfg.busy_timeout_s)
        return sock

    def _streams(self, addresses: tuple[str, ...]) -> list["Stream"]:
        """The streams to one destination process, started on first use."""
        with self._pipes_lock:
            if self._shut:
                raise TransferError("send: the endpoint is closed")
            if addresses not in self._pipes:
                self._pipes[addresses] = [Stream(self, addresses[k % len(addresses)]) for k in range(self.cfg.streams)]
            return self._pipes[addresses]

    def close(self):
        self.closed = True  # refuse new messages now (_inbox), so only the last ones are waited for
        with self._posted:
            self._posted.notify_all()
        deadline = time.monotonic() + min(self.cfg.timeout_s, CLOSE_GRACE_S)
        with self._quiet:  # acknowledge what already arrived (see _unacked)
            while self._unacked and (left := deadline - time.monotonic()) > 0:
                self._quiet.wait(left)
        with self._pipes_lock:  # no stream starts after this (_streams)
            self._shut = True
        with self._gate:
            conns = list(self._conns)
        for s in self._listeners + conns:
            # shutdown() wakes threads blocked in accept() or recv() (on Linux a bare close() does not)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected (yet, or any more)
                pass
            s.close()
        with self._pipes_lock:
            for streams in self._pipes.values():
                for pipe in streams:
                    pipe.close()
        with self._posted:
            inboxes = list(self._inboxes.values())
            self._posted.notify_all()
        for inbox in inboxes:  # their waiters would otherwise ping a live peer until busy_timeout_s
            inbox.fail(TransferError(f"recv {inbox.tag!r}: this endpoint was closed"))
        # Its threads end now (sockets shut); one waking as the interpreter finalizes aborts it (docs/DESIGN.md)
        deadline = time.monotonic() + min(self.cfg.timeout_s, CLOSE_GRACE_S)
        with self._gate, self._pipes_lock:
            threads = list(self._threads) + [pipe.thread for streams in self._pipes.values() for pipe in streams]
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
