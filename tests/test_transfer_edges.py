"""Transfers at the edges: shards in another memory layout, a busy process's descriptor
numbers, messages of many tiny pieces, streams cut inside a chunk, and the receiver's
check of byte ranges."""

import random
import resource
import socket
import threading
import types

import jax
import numpy as np
import pytest
from jax.experimental.layout import Format
from jax.experimental.layout import Layout as DeviceLayout
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.errors import PeerLost
from hetjax.transfer import TransferError, stream
from hetjax.transfer.inbox import Inbox
from tests.test_transfer import endpoints, move, secret  # noqa: F401 - secret: an autouse fixture


def sharding(devices, axes, spec):
    return NamedSharding(Mesh(np.array(devices), axes), P(*spec))


@pytest.mark.parametrize("backend", ["local", "host", "direct"])
def test_a_shard_in_column_major_layout_arrives_with_its_values(backend):
    """`direct` offered a whole shard as it lay in memory, and the receiver read it
    row-major: a program's column-major output arrived transposed, silently."""
    d = jax.devices()
    src = sharding(d[:2], ("a",), ("a",))
    base = jax.device_put(np.arange(48, dtype=np.float32).reshape(8, 6), src)
    x = jax.jit(lambda v: v + 0, out_shardings=Format(DeviceLayout(major_to_minor=(1, 0)), src))(base)
    assert x.format.layout.major_to_minor == (1, 0)  # the case under test
    a, b = endpoints(backend)
    try:
        for k, dst in enumerate([sharding(d[4:6], ("p",), ("p",)), sharding(d[4:8], ("p",), ("p",))]):
            out, _, _ = move(a, b, x, dst, tag=f"t{k}")
            np.testing.assert_array_equal(np.asarray(out), np.asarray(base))
    finally:
        a.close(), b.close()


def test_a_large_message_goes_from_a_process_holding_over_1024_descriptors():
    """The sender's check for a refusal used select(), which raises ValueError for a
    descriptor numbered 1024 or more: every message over 64 KiB failed, unexplained."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1300:
        pytest.skip(f"this process may open {soft} descriptors")
    held = []
    try:
        while len(held) < 1100:
            held.append(socket.socket())  # the endpoints' sockets come after these
        a, b = endpoints("host", chunk_bytes=1 << 20, timeout_s=10, busy_timeout_s=10)  # the old failure: a wait, not an error
        try:
            one = sharding(jax.devices()[:1], ("a",), ())
            x = jax.device_put(np.arange(1 << 20, dtype=np.float32), one)  # 4 MiB: four chunks
            out, _, _ = move(a, b, x, one)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
        finally:
            a.close(), b.close()
    finally:
        [s.close() for s in held]


def test_a_small_message_of_many_tiny_pieces_goes_as_chunks_not_one_oversized_frame():
    """120 leaves of float32[8, 8], rows sharded over 8 devices on one side and columns on
    the other: 64 one-element pieces a leaf, 30 KiB in all. As one BATCH frame its
    headers came to over 1 MiB, which the receiver refuses unread (the message was
    refused as 'of another hetjax version' and the receive hung until busy_timeout_s)."""
    d = jax.devices()
    src, dst = sharding(d, ("a",), ("a",)), sharding(d, ("p",), (None, "p"))
    tree = [jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8) + i, src) for i in range(120)]
    a, b = endpoints("host", timeout_s=10, busy_timeout_s=10)
    try:
        leaves, plans, _ = a.prepare_send(tree, "t", [dst] * len(tree))
        parts = stream.route(0, a.cfg, leaves, plans, "t", {0: b.addresses}).dests[0][2]
        assert not any(p.small for p in parts)  # the case under test: small in bytes, not in headers
        out, _, _ = move(a, b, tree, [dst] * len(tree))
        for x, y in zip(tree, out):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    finally:
        a.close(), b.close()


def _relay(src: socket.socket, dst: socket.socket) -> None:
    """Copies src to dst until src ends, or until the proxy closes them under it (EBADF):
    the proxy's own hang-up, not a failure of the test."""
    try:
        for data in iter(lambda: src.recv(65536), b""):
            dst.sendall(data)
    except OSError:
        pass


def _cutting_proxy(upstream: str, cut_at: int) -> str:
    """A TCP proxy that hangs up on both sides once cut_at client bytes went through."""
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = upstream.rsplit(":", 1)

    def serve():
        client, _ = listener.accept()
        server = socket.create_connection((host, int(port)))
        threading.Thread(target=_relay, args=(server, client), daemon=True).start()
        seen = 0
        while seen < cut_at and (data := client.recv(min(65536, cut_at - seen))):
            server.sendall(data)
            seen += len(data)
        for s in (server, client):  # shutdown: close() alone wakes no thread blocked in recv
            s.shutdown(socket.SHUT_RDWR), s.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_stream_cut_inside_a_chunk_names_the_receive_and_the_sending_process():
    """It named only the connection's port ('peer 127.0.0.1:52432 closed the connection
    mid-message'): neither the message nor a process a user could look for."""
    one = sharding(jax.devices()[:1], ("a",), ())
    x = jax.device_put(np.arange(1 << 20, dtype=np.float32), one)  # one 4 MiB chunk
    a, b = endpoints("host", streams=1, timeout_s=10)
    try:
        r = b.recv("acts", jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), one)
        h = a.send(x, "acts", one, peers={0: (_cutting_proxy(b.addresses[0], 500_000),)})
        with pytest.raises(PeerLost, match=r"recv 'acts' from source process 0: .*closed the connection mid-message"):
            r.wait()
        with pytest.raises(TransferError):
            h.wait()
    finally:
        a.close(), b.close()


def _proxy_resetting_after_one_chunk(upstream: str) -> str:
    """A TCP proxy that passes the handshake and one whole CHUNK frame (header, payload,
    checksum), then resets the connection (RST): cut between two chunks of a message."""
    import json
    import struct

    from hetjax.transfer import wire
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = upstream.rsplit(":", 1)

    def exactly(sock, n):
        data = b""
        while len(data) < n:
            data += sock.recv(n - len(data))
        return data

    def serve():
        client, _ = listener.accept()
        server = socket.create_connection((host, int(port)))
        threading.Thread(target=_relay, args=(server, client), daemon=True).start()
        server.sendall(exactly(client, 64))  # the handshake: nonce and proof
        head = exactly(client, wire.FRAME.size)
        meta = exactly(client, wire.FRAME.unpack(head)[2])
        assert wire.FRAME.unpack(head)[1] == wire.CHUNK
        server.sendall(head + meta + exactly(client, json.loads(meta)["n"] + wire.TRAILER.size))
        for s in (server, client):  # a reset, not an orderly close: no FIN reaches either side
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.shutdown(socket.SHUT_RD)  # sends nothing; wakes the thread reading it, so close() frees it
            s.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_stream_reset_between_two_chunks_fails_the_receive_at_once():
    """A connection reset between two chunks of a message left the receive waiting: the
    receiving thread raised, but failed nothing, and the sending process, alive, answered
    every ping, so the receive waited out busy_timeout_s (900 s by default)."""
    import time
    one = sharding(jax.devices()[:1], ("a",), ())
    x = jax.device_put(np.arange(1 << 20, dtype=np.float32), one)  # 4 MiB: four chunks of 1 MiB
    a, b = endpoints("host", streams=1, chunk_bytes=1 << 20, timeout_s=2, busy_timeout_s=60)
    try:
        # The sender's own address for pings: it is alive and answers them.
        r = b.recv("acts", jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), one, peers={0: a.addresses})
        start = time.monotonic()
        h = a.send(x, "acts", one, peers={0: (_proxy_resetting_after_one_chunk(b.addresses[0]),)})
        with pytest.raises(PeerLost, match=r"recv 'acts'.*(reset|lost)"):
            r.wait()
        assert time.monotonic() - start < 10
        with pytest.raises(TransferError):
            h.wait()
    finally:
        a.close(), b.close()


def test_the_byte_range_check_refuses_exactly_the_overlapping_chunks():
    """Inbox.claim keeps each piece's ranges sorted (it was a scan of every range per
    chunk: 47 s of a receiver's time for a 128 MiB piece in 4 KiB chunks). Against a
    plain overlap test, for chunks arriving in any order."""
    rng = random.Random(0)
    for _ in range(200):
        inbox = types.SimpleNamespace(lock=threading.Lock(), ranges={}, tag="t")
        taken = []
        for _ in range(12):
            offset, n = rng.randrange(0, 64) * 4, rng.randrange(1, 8) * 4
            overlaps = any(offset < end and start < offset + n for start, end in taken)
            try:
                Inbox.claim(inbox, 0, 0, offset, n, "peer")
            except TransferError as e:
                assert overlaps and "again" in str(e)
            else:
                assert not overlaps
                taken.append((offset, offset + n))


def test_a_refused_message_names_its_link_from_sender_to_receiver():
    """Island b refusing island a's message named the 'link from island b to island a'."""
    import dataclasses

    from hetjax.config import HeteroConfig, IslandConfig, MeshConfig, load
    from hetjax.hetero.links import Links
    from hetjax.transfer import LinkConfig
    cfg = load("tiny.py", {})
    islands = tuple(IslandConfig(name=n, devices_per_process=2, mesh=MeshConfig(fsdp=2)) for n in "ab")
    cfg = dataclasses.replace(cfg, hetero=HeteroConfig(islands=islands, link=LinkConfig(backend="local", timeout_s=5)))
    la, lb = Links(cfg, 0), Links(cfg, 1)
    d = jax.devices()
    sa, sb = sharding(d[:2], ("x",), ("x",)), sharding(d[2:4], ("x",), ("x",))
    try:
        la.send(1, jax.device_put(np.zeros(8, np.float32), sa), "acts", sb)
        r = lb.recv(0, "acts", jax.ShapeDtypeStruct((8,), np.int32, sharding=sb), sa)
        with pytest.raises(TransferError, match="^link from island a to island b: .*expects int32"):
            lb.wait(r, 0)
    finally:
        la.close(), lb.close()


def test_a_send_cut_by_closing_its_own_endpoint_says_so_not_that_the_peer_was_lost():
    """It said 'lost peer ...: its process died or closed its endpoint' of a live peer
    (islands then reported that island lost)."""
    import time
    one = sharding(jax.devices()[:1], ("a",), ())
    x = jax.device_put(np.arange(16, dtype=np.float32), one)
    a, b = endpoints("host", timeout_s=10, busy_timeout_s=30)
    try:
        h = a.send(x, "never-posted", one, peers={0: b.addresses})  # b waits for its receive: no ACK
        time.sleep(0.5)
        a.close()
        with pytest.raises(TransferError, match="this endpoint was closed while the message was in flight") as e:
            h.wait()
        assert not isinstance(e.value, PeerLost)
    finally:
        a.close(), b.close()


def test_a_local_receive_owns_its_memory_refuses_a_twin_and_names_a_deleted_send():
    """On the same devices `local` handed the receiver the sender's own buffers: deleting or
    donating either array killed the other. A second receive of one tag raced the first for
    the message; an array deleted after its send failed the receive with a bare RuntimeError."""
    import time
    d = jax.devices()
    same = sharding(d[:4], ("x",), ("x",))
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), same)
    a, b = endpoints("local", timeout_s=2)
    try:
        out, _, _ = move(a, b, x, same)
        x.delete()
        np.testing.assert_array_equal(np.asarray(out), np.arange(32, dtype=np.float32).reshape(8, 4))
        like = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=same)
        r = b.recv("twin", like, same)
        with pytest.raises(TransferError, match="'twin': a receive with this tag is already posted"):
            b.recv("twin", like, same)
        y = jax.device_put(np.ones((8, 4), np.float32), same)
        a.send(y, "twin", same).wait()
        y.delete()
        with pytest.raises(TransferError, match="recv 'twin': leaf 0 was deleted or donated after its send"):
            r.wait()
    finally:
        a.close(), b.close()
    # host: a receive posted on a closed endpoint is refused, not waited for until busy_timeout_s.
    a, b = endpoints("host", timeout_s=2, busy_timeout_s=30)
    a.close(), b.close()
    start = time.monotonic()
    with pytest.raises(TransferError, match="recv 'late': this endpoint is closed"):
        b.recv("late", jax.ShapeDtypeStruct((8, 4), np.float32, sharding=same), same).wait()
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("backend", ["local", "direct"])
def test_closed_local_and_direct_endpoints_refuse_sends_and_receives_and_direct_refuses_a_twin(backend):
    """close() did nothing on these two backends: a receive waiting on a closed `local`
    endpoint waited out timeout_s, and later sends and receives were taken. `direct` took
    a second receive of a tag in flight, which pulled the first one's offer."""
    import time
    same = sharding(jax.devices()[:4], ("x",), ("x",))
    like = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=same)
    y = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), same)
    a, b = endpoints(backend, timeout_s=30)
    try:
        r = b.recv("twin", like, same, peers={0: a.addresses})
        with pytest.raises(TransferError, match="'twin': a receive with this tag is already posted"):
            b.recv("twin", like, same, peers={0: a.addresses})
        h = a.send(y, "twin", same, peers={0: b.addresses})
        np.testing.assert_array_equal(np.asarray(r.wait()), np.asarray(y))
        h.wait()
        out, _, _ = move(a, b, y, same, tag="twin")  # done, the tag is free again
        np.testing.assert_array_equal(np.asarray(out), np.asarray(y))
        if backend == "local":  # a waiting receive ends with its endpoint, not at timeout_s
            waiting = b.recv("waiting", like, same)
            threading.Timer(0.2, b.close).start()
            start = time.monotonic()
            with pytest.raises(TransferError, match="recv 'waiting': this endpoint was closed"):
                waiting.wait()
            assert time.monotonic() - start < 5
        b.close()
        with pytest.raises(TransferError, match="recv 'late': this endpoint is closed"):
            b.recv("late", like, same, peers={0: a.addresses})
        a.close()
        with pytest.raises(TransferError, match="send 'late': this endpoint is closed"):
            a.send(y, "late", same, peers={0: b.addresses})
    finally:
        a.close(), b.close()
