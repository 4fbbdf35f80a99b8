"""Transfers in one process: every backend moves random trees bit for bit; safety checks."""

import gc
import logging
import math
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.config import CHECKSUMS, ConfigError
from hetjax.transfer import LinkConfig, TransferError, TransferTimeout, open_endpoint
from hetjax.transfer import inbox as inbox_module
from hetjax.transfer import wire
from hetjax.transfer.plan import Layout
from tests.test_transfer_plan import cases

SECRET = "test-secret-0123456789abcdef"
DTYPES = {"float32": np.uint32, "bfloat16": np.uint16, "int32": np.uint32}


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("HETJAX_TRANSFER_SECRET", SECRET)


def sharding(layout: Layout, devices) -> NamedSharding:
    grid = np.array(devices[:math.prod(layout.mesh_shape)]).reshape(layout.mesh_shape)
    return NamedSharding(Mesh(grid, layout.axis_names), P(*layout.spec))


def random_array(shape, dtype, seed, sharding_):
    """Random bit patterns (NaNs included for floats): equality is checked on the bits."""
    bits = np.random.default_rng(seed).integers(0, 2**31, size=shape).astype(DTYPES[dtype])
    return jax.device_put(bits.view(jnp.dtype(dtype)), sharding_)


def bits(x):
    x = np.asarray(x)
    return x.view(DTYPES[x.dtype.name])


def endpoints(backend, **kw):
    cfg = LinkConfig(backend=backend, **{"timeout_s": 20, **kw})
    a, b = open_endpoint(cfg), open_endpoint(cfg)
    return a, b


def move(a, b, tree, dst_shardings, tag="t"):
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, dst_shardings)
    src = jax.tree.map(lambda x: x.sharding, tree)
    r = b.recv(tag, like, src, peers={0: a.addresses})
    h = a.send(tree, tag, dst_shardings, peers={0: b.addresses})
    out = r.wait()
    h.wait()
    return out, r, h


@pytest.mark.parametrize("backend,examples", [("local", 12), ("host", 8), ("direct", 6)])
def test_random_trees_arrive_bit_for_bit(backend, examples):
    devices = jax.devices()
    a, b = endpoints(backend, chunk_bytes=4096, streams=2)

    @settings(max_examples=examples, deadline=None)
    @given(cases(), st.sampled_from(sorted(DTYPES)), st.integers(0, 2**16))
    def check(case, dtype, seed):
        shape, _, src, dst = case
        src_sh, dst_sh = sharding(src, devices), sharding(dst, devices[::-1])  # other devices, other order
        x = random_array(shape, dtype, seed, src_sh)
        y = random_array(shape[::-1], "int32", seed + 1, NamedSharding(src_sh.mesh, P()))
        tag = f"case{seed}/{dtype}"
        out, r, _ = move(a, b, {"x": x, "y": [y]}, {"x": dst_sh, "y": [NamedSharding(dst_sh.mesh, P())]}, tag)
        assert out["x"].sharding == dst_sh and out["y"][0].sharding.spec == P()
        np.testing.assert_array_equal(bits(out["x"]), bits(x))
        np.testing.assert_array_equal(bits(out["y"][0]), bits(y))
        for shard in out["x"].addressable_shards:  # every replica holds its block
            np.testing.assert_array_equal(bits(shard.data), bits(np.asarray(x)[shard.index]))
        # The replica groups tile the array: one copy of each byte crossed, however replicated.
        assert r.wire_bytes == x.nbytes + y.nbytes

    try:
        check()
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int32"])
def test_pieces_landed_on_their_device_chunk_by_chunk_arrive_bit_for_bit(monkeypatch, dtype):
    """On a GPU, host puts each verified chunk of a large piece on its device while later
    chunks still arrive, and joins them there (inbox.LAND_BY_CHUNK; on CPU a whole piece
    goes at once, so the test turns it on for CPU). Chunks of two streams arrive in either
    order; NaN payloads and the piece's place in its block must survive the join."""
    import hetjax.transfer.stream
    monkeypatch.setattr(inbox_module, "LAND_BY_CHUNK", frozenset({"cpu"}))
    monkeypatch.setattr(inbox_module, "LAND_MIN_BYTES", 1024)
    monkeypatch.setattr(hetjax.transfer.stream, "_STREAM_BYTES", 1)  # both streams, however small the message
    joined, threads, held = [], set(), []
    real_join, real_arrived, real_finish = inbox_module._join, inbox_module.Inbox.arrived, inbox_module.Inbox.finish
    monkeypatch.setattr(inbox_module, "_join", lambda chunks, shape, dtype: joined.append(len(chunks))
                        or real_join(chunks, shape, dtype))
    monkeypatch.setattr(inbox_module.Inbox, "arrived", lambda self, *a: threads.add(threading.get_ident())
                        or real_arrived(self, *a))
    monkeypatch.setattr(inbox_module.Inbox, "finish", lambda self: held.append(len(self.landed))
                        or real_finish(self))
    d = jax.devices()
    x = random_array((96, 640), dtype, 3, NamedSharding(Mesh(np.array(d[:4]), ("a",)), P("a")))
    dst = NamedSharding(Mesh(np.array(d[4:8]).reshape(2, 2), ("p", "q")), P("q", "p"))  # 2 pieces a block
    a, b = endpoints("host", chunk_bytes=4096, streams=2)
    try:
        out, r, _ = move(a, b, x, dst)
        np.testing.assert_array_equal(bits(out), bits(x))
        for shard in out.addressable_shards:
            np.testing.assert_array_equal(bits(shard.data), bits(np.asarray(x)[shard.index]))
        assert r.wire_bytes == x.nbytes
        assert len(joined) == 8 and min(joined) > 1, joined  # each piece came in several chunks
        assert len(threads) == 2, threads  # from two streams, so in no set order
        assert held == [0]  # each block let its chunks go once joined
    finally:
        a.close(), b.close()


def test_a_block_lands_chunk_by_chunk_only_when_the_device_can_hold_its_words():
    """inbox._lands: GPU-class devices, pieces all large, words the device keeps whole."""
    from types import SimpleNamespace as NS
    gpu, cpu = NS(platform="gpu"), NS(platform="cpu")
    big, small = NS(nbytes=inbox_module.LAND_MIN_BYTES + 1), NS(nbytes=inbox_module.LAND_MIN_BYTES)
    f32, i64, flags = NS(dtype=np.dtype("float32")), NS(dtype=np.dtype("int64")), NS(dtype=np.dtype("bool"))
    assert inbox_module._lands(f32, gpu, [big, big])
    assert not inbox_module._lands(f32, cpu, [big])
    assert not inbox_module._lands(f32, gpu, [big, small])  # the block is joined on the host anyway
    assert not inbox_module._lands(flags, gpu, [big])
    with jax.enable_x64(False):
        assert not inbox_module._lands(i64, gpu, [big])  # device_put would narrow its words to 32 bits
    with jax.enable_x64(True):
        assert inbox_module._lands(i64, gpu, [big])


@pytest.mark.parametrize("backend", ["local", "host", "direct"])
def test_replicated_destination_receives_one_copy(backend):
    d = jax.devices()
    x = random_array((16, 8), "float32", 0, NamedSharding(Mesh(np.array(d[:4]), ("a",)), P("a")))
    dst = NamedSharding(Mesh(np.array(d[4:]).reshape(2, 2), ("p", "q")), P())  # 4 replicas
    a, b = endpoints(backend)
    try:
        out, r, h = move(a, b, x, dst)
        np.testing.assert_array_equal(bits(out), bits(x))
        assert r.wire_bytes == h.wire_bytes == x.nbytes  # one copy, not four
        if backend == "host":
            assert b.bytes_received == x.nbytes
    finally:
        a.close(), b.close()


def test_fan_out_through_the_destination_collective_is_bit_exact():
    """Destinations spread over processes fan out with a psum of bits; check it here."""
    from hetjax.transfer.core import fan_out
    d = jax.devices()
    mesh = Mesh(np.array(d).reshape(2, 4), ("r", "s"))
    sh = NamedSharding(mesh, P(None, "s"))
    x = random_array((4, 8), "bfloat16", 3, sh)
    shards = [s.data if s.device in mesh.devices[0] else jnp.zeros_like(s.data) for s in x.addressable_shards]
    only_row0 = jax.make_array_from_single_device_arrays(x.shape, sh, shards)
    np.testing.assert_array_equal(bits(fan_out(only_row0)), bits(x))
    # bool has no bit cast; and the program is compiled once per (mesh, spec, dtype), not per message.
    from hetjax.transfer.core import _fan_out_program
    flags = jax.device_put(np.random.default_rng(4).integers(0, 2, (4, 8)).astype(bool), sh)
    shards = [s.data if s.device in mesh.devices[0] else jnp.zeros_like(s.data) for s in flags.addressable_shards]
    only_row0 = jax.make_array_from_single_device_arrays(flags.shape, sh, shards)
    hits = _fan_out_program.cache_info().hits
    for _ in range(2):
        out = fan_out(only_row0)
        assert out.dtype == jnp.bool_ and np.array_equal(np.asarray(out), np.asarray(flags))
        assert all(np.array_equal(np.asarray(s.data), np.asarray(flags)[s.index]) for s in out.addressable_shards)
    assert _fan_out_program.cache_info().hits == hits + 1


def test_wrong_secret_is_refused_and_logged(monkeypatch, caplog):
    b = open_endpoint(LinkConfig(timeout_s=5))
    monkeypatch.setenv("HETJAX_TRANSFER_SECRET", "another-secret-of-sufficient-size")
    a = open_endpoint(LinkConfig(timeout_s=5))
    x = jax.device_put(jnp.ones((4,)), jax.devices()[0])
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P())
    x = jax.device_put(x, sh)
    with caplog.at_level(logging.WARNING, logger="hetjax.transfer"):
        with pytest.raises(TransferError, match="refused the connection: the shared secrets differ"):
            a.send(x, "t", sh, peers={0: b.addresses}).wait()
    assert b.refused == 1 and "did not prove the job's shared secret" in caplog.text
    a.close(), b.close()


def test_a_refused_handshake_closes_its_socket():
    # A send's handle keeps its error, and the error's traceback the frames that held the
    # socket: a refused connection left it open for as long as the handle lived.
    b = open_endpoint(LinkConfig(timeout_s=5))
    try:
        with pytest.raises(TransferError, match="the shared secrets differ") as raised:
            wire.connect(b.addresses[0], b"another-secret-of-sufficient-size", 5)
        tb, socks = raised.value.__traceback__, []
        while tb is not None:
            socks += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, socket.socket)]
            tb = tb.tb_next
        assert socks and all(s.fileno() == -1 for s in socks)  # found, and closed
    finally:
        b.close()


def _corrupting_proxy(upstream: str, flip_at: int) -> str:
    """A TCP proxy that flips one bit of the client->server byte stream at flip_at."""
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = upstream.rsplit(":", 1)

    def pump(src, dst, flip):
        seen = 0
        try:
            while data := src.recv(65536):
                if flip and seen <= flip_at < seen + len(data):
                    data = bytearray(data)
                    data[flip_at - seen] ^= 0x10
                seen += len(data)
                dst.sendall(bytes(data))
        except OSError:
            pass
        finally:  # either side gone: hang up on both, as a router would
            src.close(), dst.close()

    def serve():
        client, _ = listener.accept()
        server = socket.create_connection((host, int(port)))
        threading.Thread(target=pump, args=(client, server, True), daemon=True).start()
        pump(server, client, False)

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("rows,chunk_bytes,flip", [(64, 4096, 4000), (512, 4096, 4000), (2048, 256 << 10, 4000),
                                                   (4096, 1 << 20, 700_000)],
                         ids=["one-batch-frame", "small-chunks-batched", "large-chunks", "a-later-slice"])
@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_corrupted_chunk_is_detected(checksum, rows, chunk_bytes, flip):
    a, b = endpoints("host", streams=1, chunk_bytes=chunk_bytes, timeout_s=3.0, checksum=checksum)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P())
    # 16 KiB goes as one frame, 128 KiB in small chunks written together, 512 KiB in chunks
    # larger than wire.SMALL (a write each), 1 MiB in one chunk of four wire.SLICEs
    x = random_array((rows, 64), "float32", 1, sh)
    r = b.recv("t", jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), sh)
    # 64 handshake bytes, then the header(s) (~300 bytes a chunk), then payload: byte
    # 4000 lies in the first chunk's payload of either frame kind, 700,000 in the third slice.
    h = a.send(x, "t", sh, peers={0: (_corrupting_proxy(b.addresses[0], 64 + flip),)})
    with pytest.raises(TransferError, match=f"failed its {checksum} check"):
        r.wait()
    with pytest.raises(TransferError):
        h.wait()
    a.close(), b.close()


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_a_chunk_summed_slice_by_slice_has_the_whole_chunks_checksum(checksum):
    """Both sides sum a chunk a slice at a time (wire.Sum); a small message's chunks are
    summed whole (wire.chunk_sum, the checksum function itself): the two must agree."""
    payload = np.random.default_rng(0).integers(0, 256, 3 * wire.SLICE + 1000, dtype=np.uint8).tobytes()
    total = wire.Sum(checksum, 3, 1, 2, 4096, len(payload))
    for at in range(0, len(payload), 77_777):  # slices of any size, in order
        total.update(payload[at:at + 77_777])
    assert total.value() == wire.chunk_sum(checksum, 3, 1, 2, 4096, payload)
    assert total.value() != wire.chunk_sum(checksum, 3, 1, 2, 0, payload)  # the offset is in the seed


def test_wrong_shape_dtype_or_tag_is_refused():
    a, b = endpoints("host", timeout_s=2.0, busy_timeout_s=3.0)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    x = random_array((8, 4), "int32", 2, sh)
    for shape, dtype, match in [((8, 4), jnp.float32, "arrived as int32\\[8, 4\\] but the receiver expects float32"),
                                ((8, 2), jnp.int32, "expects int32\\[8, 2\\]")]:
        r = b.recv("t", jax.ShapeDtypeStruct(shape, dtype, sharding=sh), sh)
        h = a.send(x, "t", sh, peers={0: b.addresses})
        with pytest.raises(TransferError, match=match):
            r.wait()
        with pytest.raises(TransferError, match="refused the message: .*" + match):  # named, not "lost"
            h.wait()
    r = b.recv("expected", jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), sh)
    # The receiver, alive, waits busy_timeout_s for a receive of 'other' to be posted, as
    # long as the sender, pinging it, waits for its acknowledgement: which side gives up
    # first is a race, so the sender sees the receiver's refusal or one of its own timeouts.
    with pytest.raises(TransferError, match="sent tag 'other', but no receive for it was posted within 3 s|"
                                            "nothing moved for 3 s|"
                                            "neither read nor acknowledged the message within 3 s"):
        a.send(x, "other", sh, peers={0: b.addresses}).wait()
    with pytest.raises(TransferTimeout, match="recv 'expected' from source process 0"):
        r.wait()
    a.close(), b.close()


def test_a_large_message_refused_at_its_first_chunk_reports_why_however_long_the_rest_takes(monkeypatch):
    """The receiver refuses a large message at its first chunk and drains the rest only for
    a while (here 1 s). The sender, whose chunks come slowly (0.1 s each, 16 of them),
    used to find the connection reset and report a lost peer, without the reason."""
    from hetjax.transfer import stream
    real = stream._host_chunk

    def slow(job, k, endpoint):
        time.sleep(0.1)
        return real(job, k, endpoint)
    monkeypatch.setattr(stream, "_host_chunk", slow)
    a = open_endpoint(LinkConfig(backend="host", timeout_s=20, streams=1, chunk_bytes=1 << 20))
    b = open_endpoint(LinkConfig(backend="host", timeout_s=1, busy_timeout_s=1))
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P())
    x = random_array((4096, 1024), "float32", 6, sh)  # 16 MiB
    try:
        b.recv("t", jax.ShapeDtypeStruct(x.shape, jnp.int32, sharding=sh), sh, peers={0: a.addresses})
        with pytest.raises(TransferError, match="refused the message: .*arrived as float32"):
            a.send(x, "t", sh, peers={0: b.addresses}).wait()
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("backend", ["local", "host", "direct"])
def test_a_receive_posted_early_is_timed_from_its_wait_not_its_post(backend):
    """A pipeline posts a step's receives when the step starts and waits for the last ones
    much later: the time in between is not the peer's silence."""
    a, b = endpoints(backend, timeout_s=0.5, busy_timeout_s=1.0)  # host: `a` answers pings
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    x = random_array((8, 4), "int32", 8, sh)
    try:
        r = b.recv("late", jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), sh, peers={0: a.addresses})
        time.sleep(1.5)  # three timeouts of compute; the message leaves just after the wait starts
        sent = []
        timer = threading.Timer(0.2, lambda: sent.append(a.send(x, "late", sh, peers={0: b.addresses})))
        timer.start()
        np.testing.assert_array_equal(bits(r.wait()), bits(x))
        timer.join()
        sent[0].wait()
        r = b.recv("never", jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), sh, peers={0: a.addresses})
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            r.wait()
        assert 0.4 < time.monotonic() - t0 < 10
    finally:
        a.close(), b.close()


def test_a_busy_peer_is_waited_for_until_busy_timeout_s(caplog):
    """A peer that sends nothing for longer than timeout_s but answers pings (an island
    compiling, restoring or in a long step) is waited for, both ways: a receive whose
    sender is late, and a send whose receiver posts its receive late. Up to busy_timeout_s."""
    a, b = endpoints("host", timeout_s=0.5, busy_timeout_s=30)
    a.status = "compiling"
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    x = random_array((64, 4), "int32", 3, sh)
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    try:
        with caplog.at_level(logging.WARNING, logger="hetjax.transfer"):
            r = b.recv("late send", like, sh, peers={0: a.addresses})
            sent = []
            timer = threading.Timer(2.0, lambda: sent.append(a.send(x, "late send", sh, peers={0: b.addresses})))
            timer.start()
            np.testing.assert_array_equal(bits(r.wait()), bits(x))  # four timeouts of silence
            timer.join()
            sent[0].wait()
        assert "but the peer answers (process 0: compiling)" in caplog.text, caplog.text

        h = a.send(x, "late receive", sh, peers={0: b.addresses})
        received = []
        timer = threading.Timer(2.0, lambda: received.append(b.recv("late receive", like, sh, peers={0: a.addresses})))
        timer.start()
        h.wait()  # the receiver takes four timeouts to post its receive
        timer.join()
        np.testing.assert_array_equal(bits(received[0].wait()), bits(x))
    finally:
        a.close(), b.close()

    a, b = endpoints("host", timeout_s=0.5, busy_timeout_s=1.5)
    try:
        r = b.recv("never", like, sh, peers={0: a.addresses})
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"answers pings \(process 0: running\) but nothing moved for 1.5 s \(LinkConfig.busy_timeout_s\)"):
            r.wait()
        assert 1.5 < time.monotonic() - t0 < 6
    finally:
        a.close(), b.close()

    a, b, c = endpoints("host", timeout_s=0.5, busy_timeout_s=0.5) + (open_endpoint(LinkConfig(timeout_s=0.5)),)
    try:
        r = b.recv("closed", like, sh, peers={0: a.addresses})
        threading.Timer(0.1, b.close).start()  # our own endpoint closed under a wait ends it, pings or not
        with pytest.raises(TransferError, match="recv 'closed': this endpoint was closed"):
            r.wait()
        a.close()  # a peer gone is named as one, not as busy (even with busy_timeout_s == timeout_s)
        r = c.recv("gone", like, sh, peers={0: a.addresses})
        with pytest.raises(TransferTimeout, match=r"nothing for 0.5 s \(LinkConfig.timeout_s\), and process 0 at "
                                                  r"127.0.0.1:\d+ did not answer a ping \(.*refused"):
            r.wait()
    finally:
        a.close(), b.close(), c.close()


def test_a_silent_receive_pings_only_the_senders_that_still_owe_data(caplog):
    """A receive from two sender processes: process 0 delivered its rows and exited (its
    port refuses), process 1 is busy. The receive waits for process 1 instead of naming
    process 0, which owes nothing, lost (a sender island that finished may exit)."""
    gone, busy, b = (open_endpoint(LinkConfig(timeout_s=0.5, busy_timeout_s=2.5)) for _ in range(3))
    busy.status = "compiling"
    gone_address = gone.addresses
    gone.close()
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    src = Layout((4,), ("a",), (0, 0, 1, 1), ("a", None))  # rows 0..3 from process 0, 4..7 from 1
    like = jax.ShapeDtypeStruct((8, 4), "int32", sharding=sh)
    try:
        with caplog.at_level(logging.WARNING, logger="hetjax.transfer"):
            r = b.recv("two senders", like, src, peers={0: gone_address, 1: busy.addresses})
            inbox = b._inboxes["two senders"]
            owing = inbox.owing()
            assert owing() == [0, 1]
            for (i, j), n in list(inbox.left.items()):  # process 0's rows, as its stream lands them
                if inbox.expect.plans[i].pieces[j].src_process == 0:
                    inbox.claim(i, j, 0, n, "process 0")
                    inbox.arrived(i, j, 0, n)
            assert owing() == [1]
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match=r"answers pings \(process 1: compiling\) but nothing moved "
                                                      r"for 2.5 s \(LinkConfig.busy_timeout_s\)"):
                r.wait()
            assert 2.0 < time.monotonic() - t0 < 10
        assert "did not answer a ping" not in caplog.text, caplog.text
    finally:
        busy.close(), b.close()


def test_a_finished_receive_gives_its_buffers_back_without_a_garbage_collection():
    """Received pieces land in the endpoint's buffer pool, taken again by the next receive
    of the same size once nothing holds them: a finished receive must not sit in a
    reference cycle (its handle -> its pinger -> its inbox -> its buffers), or each
    receive writes fresh memory until a collection (page faults: a third of host's
    bandwidth once)."""
    a, b = endpoints("host")
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    x = random_array((512, 1024), "float32", 3, sh)  # 1 MiB per device: blocks over wire.SMALL
    gc.collect()
    gc.disable()
    try:
        for tag in ("t0", "t1", "t2", "t3", "t4", "t5"):
            out, _, _ = move(a, b, x, sh, tag)
            np.testing.assert_array_equal(bits(out), bits(x))
            del out
        held = {n: len(bufs) for n, bufs in b.buffers._held.items()}
        # A buffer per device's piece: two receives' worth at most (a stream's reader lets go of
        # the last one at its next message), not a new pair for each of the six.
        assert list(held) == [x.nbytes // 2] and held[x.nbytes // 2] <= 4, held
    finally:
        gc.enable()
        a.close(), b.close()


def test_a_peer_is_pinged_on_each_of_its_addresses_until_one_answers():
    """A peer with two NICs, the first one down: its ping answers on the second, so it is
    busy, not lost; with both down it is lost, both addresses and reasons named."""
    dead, busy, b = (open_endpoint(LinkConfig(timeout_s=0.5, busy_timeout_s=2.0)) for _ in range(3))
    busy.status = "restoring"
    down = dead.addresses[0]
    dead.close()
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    like = jax.ShapeDtypeStruct((8, 4), "int32", sharding=sh)
    try:
        r = b.recv("nics", like, sh, peers={0: (down, *busy.addresses)})
        with pytest.raises(TransferTimeout, match=r"answers pings \(process 0: restoring\) but nothing moved"):
            r.wait()
        busy.close()
        r = b.recv("nics down", like, sh, peers={0: (down, *busy.addresses)})
        with pytest.raises(TransferTimeout, match=rf"process 0 at {down},{busy.addresses[0]} did not answer a ping "
                                                  rf"\({down}: .*refused.*; {busy.addresses[0]}: .*refused"):
            r.wait()
    finally:
        busy.close(), b.close()


@pytest.mark.parametrize("backend", ["local", "host"])
def test_a_second_send_of_a_tag_in_flight_is_refused_and_the_first_arrives(backend):
    """Two sends of one tag before its receive: the second is refused at once (local used
    to replace the first message silently; host interleaved the two at the receiver),
    the first arrives intact, and the tag is free again once its send is done."""
    a, b = endpoints(backend)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    x, y = random_array((64, 4), "int32", 3, sh), random_array((64, 4), "int32", 4, sh)
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    try:
        first = a.send(x, "t", sh, peers={0: b.addresses})
        with pytest.raises(TransferError, match="send 't': a .* with this tag is still .*; tags must be unique in flight"):
            a.send(y, "t", sh, peers={0: b.addresses})
        np.testing.assert_array_equal(bits(b.recv("t", like, sh, peers={0: a.addresses}).wait()), bits(x))
        first.wait()
        out, _, _ = move(a, b, y, sh)  # the same tag again, once the first is through
        np.testing.assert_array_equal(bits(out), bits(y))
    finally:
        a.close(), b.close()


def test_a_failed_send_holds_its_tag_until_its_last_part_is_off_the_streams():
    """A message split over two streams, one of them held up behind another message: the
    receiver refuses the part that arrives, so the send fails while its other part still
    waits on the held stream. That part is then never written, and the tag stays taken
    until it is dropped: a second message of the tag sent meanwhile would have met it at
    the receiver ("bytes ... again")."""
    cfg = LinkConfig(backend="host", timeout_s=20, busy_timeout_s=20, streams=2)
    a, b = open_endpoint(cfg), open_endpoint(cfg)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    small = random_array((8, 4), "int32", 1, sh)
    x, y = random_array((1024, 1024), "float32", 2, sh), random_array((1024, 1024), "float32", 3, sh)
    try:
        blocker = a.send(small, "blocker", sh, peers={0: b.addresses})  # not received yet: holds a stream
        b.recv("t", jax.ShapeDtypeStruct(x.shape, "int32", sharding=sh), sh, peers={0: a.addresses})  # refuses
        with pytest.raises(TransferError, match="refused the message"):
            a.send(x, "t", sh, peers={0: b.addresses}).wait()  # 4 MiB: a part on each stream
        with pytest.raises(TransferError, match="a send with this tag is still in flight"):
            a.send(y, "t", sh, peers={0: b.addresses})
        got = b.recv("blocker", jax.ShapeDtypeStruct(small.shape, small.dtype, sharding=sh), sh, peers={0: a.addresses})
        np.testing.assert_array_equal(bits(got.wait()), bits(small))
        blocker.wait()
        deadline = time.monotonic() + 10
        while "t" in a._sending and time.monotonic() < deadline:  # the held part, dropped unwritten
            time.sleep(0.01)
        out, _, _ = move(a, b, y, sh, "t")
        np.testing.assert_array_equal(bits(out), bits(y))
    finally:
        a.close(), b.close()


def test_a_message_cut_off_between_chunks_fails_its_receive_at_once(monkeypatch):
    """The sender's stream ends between two chunks of a message (its send failed there):
    the receive fails then, naming the peer, not after waiting out its timeouts."""
    from hetjax.transfer import stream
    real = stream._host_chunk

    def failing(job, k, endpoint):
        if job.tag == "cut" and k == 2:
            raise RuntimeError("the copy off the device failed")
        return real(job, k, endpoint)
    monkeypatch.setattr(stream, "_host_chunk", failing)
    a, b = endpoints("host", timeout_s=20, busy_timeout_s=60, chunk_bytes=1 << 20, streams=1)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    x = random_array((1024, 1024), "float32", 4, sh)  # 4 MiB: 4 chunks of 1 MiB
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    try:
        r = b.recv("cut", like, sh, peers={0: a.addresses})
        with pytest.raises(RuntimeError, match="the copy off the device failed"):
            a.send(x, "cut", sh, peers={0: b.addresses}).wait()
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="closed its stream in the middle of the message"):
            r.wait()
        assert time.monotonic() - start < 10  # not timeout_s (20 s) nor busy_timeout_s (60 s)
        out, _, _ = move(a, b, x, sh, "after")
        np.testing.assert_array_equal(bits(out), bits(x))
    finally:
        a.close(), b.close()


def test_a_receive_that_fails_as_its_first_chunk_is_taken_in_refuses_the_rest_of_that_message():
    """The window between finding the posted receive and noting the message in it: a
    receive failing there (its wait timed out) and posted again took the rest of the stale
    message (8 KiB of old bytes, then the real message's chunks refused as repeats)."""
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P())
    like = jax.ShapeDtypeStruct((3072,), jnp.int32, sharding=one)
    a, b = endpoints("host", timeout_s=20, busy_timeout_s=30, chunk_bytes=4096)
    stale = np.full(3072, -1, np.int32).view(np.uint8)
    meta = {"tag": "t", "leaves": 1, "leaf": 0, "piece": 0, "shape": [3072], "dtype": "int32",
            "region": [[0, 3072]], "n": 4096, "msg": 7}

    def chunk(k):
        payload = memoryview(stale[4096 * k:4096 * (k + 1)])
        return (wire.frame(wire.CHUNK, dict(meta, offset=4096 * k)) + payload.tobytes()
                + wire.TRAILER.pack(wire.chunk_sum(b.checksum, 1, 0, 0, 4096 * k, payload)))
    found, again = b._inbox, []

    def failing_as_found(*args):
        inbox = found(*args)
        if not again:  # the waiter gives up just as the stream found its receive
            inbox.fail(TransferTimeout("nothing moved"))
            again.append(b.recv("t", like, one))
        return inbox
    b._inbox = failing_as_found
    try:
        b.recv("t", like, one)
        sock = wire.connect(b.addresses[0], LinkConfig().secret(), 5)
        wire.sendall(sock, chunk(0), "b")
        time.sleep(0.3)
        wire.sendall(sock, chunk(1) + chunk(2) + wire.frame(wire.END, {"tag": "t"}), "b")
        kind, said = wire.read_frame(sock, "b", False, 5)
        assert kind == wire.REFUSE and "was withdrawn" in said["reason"]
        sock.close()
        assert dict(b._inboxes["t"].left) == {(0, 0): 12288}  # untouched by the old message
        x = jax.device_put(jnp.arange(3072, dtype=jnp.int32), one)
        h = a.send(x, "t", one, peers={0: b.addresses})
        np.testing.assert_array_equal(np.asarray(again[0].wait()), np.asarray(x))
        h.wait()
    finally:
        a.close(), b.close()


def test_a_garbled_frame_header_between_two_chunks_fails_its_receive_at_once():
    """A header that is not a JSON object (bad JSON, or a list) after a message's first
    chunk left its receive waiting busy_timeout_s: the sender still answers pings."""
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P())
    like = jax.ShapeDtypeStruct((2048,), jnp.int32, sharding=one)
    a, b = endpoints("host", timeout_s=30, busy_timeout_s=60, chunk_bytes=4096)
    payload = memoryview(np.zeros(1024, np.int32).view(np.uint8))

    def first(msg):  # a message's first chunk
        return (wire.frame(wire.CHUNK, {"tag": "t", "msg": msg, "leaves": 1, "leaf": 0, "piece": 0, "shape": [2048],
                                        "dtype": "int32", "region": [[0, 2048]], "offset": 0, "n": 4096})
                + payload.tobytes() + wire.TRAILER.pack(wire.chunk_sum(b.checksum, 1, 0, 0, 0, payload)))
    try:
        for msg, garbled in enumerate((b'{"tag": "t', b'["t"]')):
            r = b.recv("t", like, one, peers={0: a.addresses})
            sock = wire.connect(b.addresses[0], LinkConfig().secret(), 5)
            wire.sendall(sock, first(msg) + wire.FRAME.pack(wire.MAGIC, wire.CHUNK, len(garbled)) + garbled, "b")
            start = time.monotonic()
            with pytest.raises(TransferError, match=r"between two chunks: peer .* sent a frame header that is not"):
                r.wait()
            assert time.monotonic() - start < 10
            sock.close()
        with pytest.raises(TransferError, match=r"recv 'p': peers\[0\]='127.0.0.1:9'; give a tuple"):
            b.recv("p", like, one, peers={0: "127.0.0.1:9"})  # its characters were pinged one by one
    finally:
        a.close(), b.close()


def test_a_timed_out_receive_is_withdrawn_and_its_tag_can_be_posted_again():
    a, b = endpoints("host", timeout_s=0.5, busy_timeout_s=0.5)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    x = random_array((8, 4), "int32", 5, sh)
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    try:
        r = b.recv("t", like, sh, peers={0: a.addresses})
        with pytest.raises(TransferTimeout, match="nothing moved for 0.5 s"):
            r.wait()
        assert r.done() and isinstance(r.future.exception(), TransferTimeout)
        out, _, _ = move(a, b, x, sh)  # the same tag, posted again, receives the message
        np.testing.assert_array_equal(bits(out), bits(x))
    finally:
        a.close(), b.close()


def test_the_rest_of_a_message_whose_receive_was_withdrawn_is_refused_not_landed_in_a_new_one():
    """A receive that timed out mid-message is withdrawn and its tag may be posted again.
    The old message's later chunks, still on their stream, once landed in the new receive
    and broke it (bytes counted twice, or stale bytes in a fresh array)."""
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P())
    x = jax.device_put(jnp.arange(3072, dtype=jnp.int32), one)  # three chunks of 4096 bytes
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
    a, b = endpoints("host", timeout_s=0.5, busy_timeout_s=5, chunk_bytes=4096)
    stale = np.full(3072, -1, np.int32).view(np.uint8)  # the old message: other bytes
    meta = {"tag": "t", "leaves": 1, "leaf": 0, "piece": 0, "shape": [3072], "dtype": "int32",
            "region": [[0, 3072]], "n": 4096}

    def chunk(k):
        payload = memoryview(stale[4096 * k:4096 * (k + 1)])
        return (wire.frame(wire.CHUNK, dict(meta, offset=4096 * k, msg=7)) + payload.tobytes()
                + wire.TRAILER.pack(wire.chunk_sum(b.checksum, 1, 0, 0, 4096 * k, payload)))
    try:
        r = b.recv("t", like, one)
        sock = wire.connect(b.addresses[0], LinkConfig().secret(), 5)
        wire.sendall(sock, chunk(0), "b")
        with pytest.raises(TransferTimeout):
            r.wait()
        r = b.recv("t", like, one)  # posted again; the old message goes on
        wire.sendall(sock, chunk(1) + chunk(2) + wire.frame(wire.END, {"tag": "t"}), "b")
        kind, said = wire.read_frame(sock, "b", False, 5)
        assert kind == wire.REFUSE and "was withdrawn" in said["reason"]
        sock.close()
        assert not r.done()  # untouched by the old message
        # Its rest on another stream, one that had not begun to write it: the same message id.
        other = wire.connect(b.addresses[0], LinkConfig().secret(), 5)
        wire.sendall(other, chunk(1), "b")
        kind, said = wire.read_frame(other, "b", False, 5)
        assert kind == wire.REFUSE and "was withdrawn" in said["reason"]
        other.close()
        assert not r.done()
        h = a.send(x, "t", one, peers={0: b.addresses})
        np.testing.assert_array_equal(np.asarray(r.wait()), np.asarray(x))
        h.wait()
    finally:
        a.close(), b.close()


def test_a_closed_endpoint_lets_go_of_its_port():
    """close() wakes the threads blocked in accept() and recv() (a bare close() of their
    sockets does not, on Linux): the port is free again and nothing answers on it."""
    a, b = endpoints("host")
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    move(a, b, random_array((8, 4), "int32", 6, sh), sh)  # b now has a stream in its idle read
    port = int(b.addresses[0].rsplit(":", 1)[1])
    a.close(), b.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    again = open_endpoint(LinkConfig(backend="host", port=port))
    assert again.addresses == b.addresses
    again.close()
    with pytest.raises(TransferError, match="the endpoint is closed"):
        a.send(random_array((8, 4), "int32", 7, sh), "late", sh, peers={0: ("127.0.0.1:9",)})


def test_close_ends_a_stream_still_waiting_for_its_peer_to_listen():
    """A stream retrying its connection (the receiver not up) kept retrying for timeout_s
    after close(): close() waited its 5 s grace and returned with the thread alive."""
    a = open_endpoint(LinkConfig(backend="host", timeout_s=30))
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P("a"))
    h = a.send(jax.device_put(jnp.arange(1024, dtype=jnp.float32), sh), "t", sh, peers={0: ("127.0.0.1:9",)})
    time.sleep(0.5)
    start = time.monotonic()
    a.close()
    assert time.monotonic() - start < 3
    assert not [t.name for t in threading.enumerate() if t.name.startswith("hetjax-send")]
    with pytest.raises(TransferError, match="this endpoint was closed while"):
        h.wait()
    assert time.monotonic() - start < 5


def test_closing_a_direct_endpoint_ends_its_receives_at_once():
    """A receive waiting on a closed direct endpoint ran out its timeout_s, then blamed the
    peer ("sent nothing matching"); local and host end theirs at once."""
    a, b = endpoints("direct", timeout_s=30)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P("a"))
    r = b.recv("w", jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sh), sh, peers={0: a.addresses})
    time.sleep(0.3)
    start = time.monotonic()
    b.close()
    with pytest.raises(TransferError, match="recv 'w': this endpoint was closed"):
        r.wait()
    assert time.monotonic() - start < 5
    a.close()


def test_close_returns_once_the_endpoints_threads_have_ended():
    """A thread of a closed endpoint still running as the interpreter finalizes can abort
    the process ("FATAL: exception not rethrown"); close() waits for its accepting,
    receiving and sending threads (each named after its endpoint's or peer's address)."""
    a, b = endpoints("host", streams=2)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    for k in range(3):  # both ways: each side has sending and receiving threads
        move(a, b, random_array((8, 4), "int32", k, sh), sh, tag=f"ab{k}")
        move(b, a, random_array((8, 4), "int32", k, sh), sh, tag=f"ba{k}")
    ours = lambda: [t.name for t in threading.enumerate()  # noqa: E731
                    if t.name.startswith("hetjax-") and t.name.endswith(a.addresses + b.addresses)]
    assert len(ours()) >= 6  # accepting (2), receiving (2) and sending (2) at least
    a.close(), b.close()
    assert ours() == []


def test_complex_arrays_are_refused_naming_the_leaf():
    a, b = endpoints("host")
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    z = jax.device_put(jnp.ones((8, 4), jnp.complex64), sh)
    try:
        with pytest.raises(TransferError, match="leaf 0 is complex64; complex arrays are not transferred"):
            a.send({"w": z}, "z", sh, peers={0: b.addresses})
        with pytest.raises(TransferError, match="recv 'z': leaf 0 is complex64"):
            b.recv("z", jax.ShapeDtypeStruct(z.shape, z.dtype, sharding=sh), sh)
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("backend", ["local", "host", "direct"])
def test_a_deleted_or_donated_array_is_refused_naming_the_leaf_and_the_link_still_works(backend):
    # Asked whether a deleted array is ready, jax 0.10 ends the process (a segfault): a
    # host stream that is connected and idle asks that before writing a small message.
    a, b = endpoints(backend)
    sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
    x = jax.device_put(jnp.arange(8.0), sh)
    try:
        move(a, b, {"x": x}, {"x": sh}, tag="first")  # the stream is now connected and idle
        gone = jax.device_put(jnp.ones(8), sh)
        gone.delete()
        with pytest.raises(TransferError, match="send 'second': leaf 1 was deleted, or donated"):
            a.send([x, gone], "second", sh, peers={0: b.addresses})
        out, _, _ = move(a, b, {"x": x}, {"x": sh}, tag="third")
        assert np.array_equal(np.asarray(out["x"]), np.arange(8.0))
    finally:
        a.close(), b.close()


def test_bad_link_config_names_the_field(monkeypatch):
    with pytest.raises(ConfigError, match=r"link.streams=0"):
        LinkConfig(streams=0).validate()
    with pytest.raises(ConfigError, match=r"link.backend='nccl'"):
        LinkConfig(backend="nccl").validate()
    with pytest.raises(ConfigError, match=r"link.chunk_bytes=10"):
        LinkConfig(chunk_bytes=10).validate()
    with pytest.raises(ConfigError, match=r"link.busy_timeout_s=5 is below link.timeout_s=60"):
        LinkConfig(busy_timeout_s=5).validate()
    # inf and 1e10 passed, then every host send failed (OverflowError: a socket's time_t)
    for field, value in (("busy_timeout_s", float("inf")), ("busy_timeout_s", 1e10), ("timeout_s", "60"),
                         ("timeout_s", 0)):
        with pytest.raises(ConfigError, match=rf"link.{field}={value!r}: give seconds, more than 0 and at most 1e\+07"):
            LinkConfig(**{field: value}).validate()
    with pytest.raises(ConfigError, match=r"link.port='5000': use 0"):
        LinkConfig(port="5000").validate()
    monkeypatch.delenv("HETJAX_TRANSFER_SECRET")
    with pytest.raises(ConfigError, match="HETJAX_TRANSFER_SECRET"):
        open_endpoint(LinkConfig(backend="host"))
    with pytest.raises(ConfigError, match="secret_file='/nonexistent'"):
        open_endpoint(LinkConfig(secret_file="/nonexistent"))


def test_a_fan_out_that_other_processes_never_join_times_out(monkeypatch):
    """A destination process whose partners never enter the fan-out's collective (they
    failed or died) gets a TransferTimeout after timeout_s, not a hang. The collective
    is stood in for by a call that never returns; a joined one runs exactly once."""
    from concurrent import futures

    from hetjax.transfer import core
    never = threading.Event()
    monkeypatch.setattr(core, "fan_out", lambda x: never.wait())
    done = futures.Future()
    done.set_result({"w": core.Unspread(jnp.zeros(4))})
    handle = core.Handle(done, "recv 'w'")
    handle.watch(None, 0.3)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="did not join its fan-out within 0.3 s"):
        handle.wait()
    assert time.monotonic() - t0 < 5
    never.set()

    calls = []
    monkeypatch.setattr(core, "fan_out", lambda x: calls.append(x) or time.sleep(0.2) or x + 1)
    handle = core.Handle(done, "recv 'w'")
    handle.watch(None, 5.0)
    waits = [threading.Thread(target=handle.wait) for _ in range(4)]
    [t.start() for t in waits]
    [t.join() for t in waits]
    assert len(calls) == 1 and np.all(np.asarray(handle.wait()["w"]) == 1)


def test_silent_connections_are_capped_cut_off_and_logged_at_a_bounded_rate(monkeypatch, caplog):
    """Connections that never prove the secret: each is closed after the handshake's own
    deadline (not timeout_s), those over the cap at once, every one counted, few logged;
    a real message still goes through meanwhile."""
    from hetjax.transfer import host
    monkeypatch.setattr(host, "HANDSHAKE_S", 1.0)
    a, b = endpoints("host", timeout_s=60)
    ip, port = b.addresses[0].rsplit(":", 1)
    n = host.MAX_UNAUTHENTICATED + 20
    with caplog.at_level(logging.WARNING, logger="hetjax.transfer"):
        silent = [socket.create_connection((ip, int(port)), timeout=10) for _ in range(n)]
        t0 = time.monotonic()
        sh = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("a",)), P("a"))
        x = random_array((8, 4), "int32", 5, sh)
        out, _, _ = move(a, b, x, sh)
        np.testing.assert_array_equal(bits(out), bits(x))
        for s in silent:  # each one is hung up on: over the cap at once, the rest after 1 s
            while s.recv(64):
                pass
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 10
        while b.refused < n and time.monotonic() < deadline:
            time.sleep(0.05)
    assert b.refused >= n  # and the real sender's tries while the cap was full
    assert len(b._conns) <= 2  # closed connections are forgotten: the sender's streams at most
    lines = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    [s.close() for s in silent]
    a.close(), b.close()


def test_a_peer_that_hangs_up_is_named_lost_not_a_refusal():
    """A receiver that proves the secret, takes the message and hangs up without an ACK
    (as a process that died does): the sender raises PeerLost naming it."""
    from hetjax.errors import PeerLost
    from hetjax.transfer import wire
    listener = socket.create_server(("127.0.0.1", 0))

    def dies():
        conn, _ = listener.accept()
        assert wire.authenticate(conn, SECRET.encode(), "test")
        conn.recv(1 << 16)
        conn.close()

    threading.Thread(target=dies, daemon=True).start()
    a = open_endpoint(LinkConfig(timeout_s=20))
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P())
    x = jax.device_put(jnp.ones((4,)), sh)
    with pytest.raises(PeerLost, match=r"send 't': lost peer 127\.0\.0\.1:\d+"):
        a.send(x, "t", sh, peers={0: (f"127.0.0.1:{listener.getsockname()[1]}",)}).wait()
    a.close(), listener.close()


@pytest.mark.parametrize("backend", ["local", "host", "direct"])
def test_zero_size_arrays_move_and_equal_specs_spelled_differently_match(backend):
    a, b = endpoints(backend, timeout_s=10)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    tree = {"rows": jnp.zeros((0, 6), jnp.float32), "cols": jnp.zeros((4, 0), jnp.int32),
            "x": random_array((8, 6), "float32", 9, NamedSharding(mesh, P("x")))}
    tree = {k: jax.device_put(v, NamedSharding(mesh, P("x") if k != "rows" else P())) for k, v in tree.items()}
    # The receiver spells the same layouts otherwise than the sender does.
    dst = {"rows": NamedSharding(mesh, P(None, None)), "cols": NamedSharding(mesh, P(("x",), None)),
           "x": NamedSharding(mesh, P("x", None))}
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, dst)
    src = {"rows": NamedSharding(mesh, P(())), "cols": NamedSharding(mesh, P(("x",))),
           "x": NamedSharding(mesh, P(("x",), None))}
    r = b.recv("z", like, src, peers={0: a.addresses})
    h = a.send(tree, "z", {k: NamedSharding(mesh, P("x")) if k != "rows" else NamedSharding(mesh, P())
                           for k in tree}, peers={0: b.addresses})
    out = r.wait()
    h.wait()
    assert out["rows"].shape == (0, 6) and out["cols"].shape == (4, 0) and out["cols"].dtype == jnp.int32
    np.testing.assert_array_equal(bits(out["x"]), bits(tree["x"]))
    a.close(), b.close()


def test_direct_names_a_disagreement_at_once():
    """A receive that expects another dtype, shape or layout than the send: the direct
    receiver names the leaf and both descriptions long before timeout_s."""
    a, b = endpoints("direct", timeout_s=30)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x = random_array((8, 4), "int32", 4, NamedSharding(mesh, P("x")))
    for k, (shape, dtype, spec, match) in enumerate([
            ((8, 4), jnp.float32, P("x"), r"leaf 0 is sent as int32\[8, 4\].* expects float32\[8, 4\]"),
            ((8, 2), jnp.int32, P("x"), r"expects int32\[8, 2\]"),
            ((8, 4), jnp.int32, P(None, "x"), r"to mesh \{'x': 2\} spec \[None, 'x'\]")]):
        sh = NamedSharding(mesh, spec)
        r = b.recv(f"t{k}", jax.ShapeDtypeStruct(shape, dtype, sharding=sh), x.sharding, peers={0: a.addresses})
        a.send(x, f"t{k}", NamedSharding(mesh, P("x")), peers={0: b.addresses})
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=match):
            r.wait()
        assert time.monotonic() - t0 < 10
        # The receiver's data pull is still waiting for its match (jax's pulls cannot be
        # cancelled); give it one, or this process would abort at exit (docs/DESIGN.md).
        a.send(jax.device_put(jnp.zeros(shape, dtype), x.sharding), f"t{k}", sh, peers={0: b.addresses})
    a.close(), b.close()


def test_a_damaged_header_or_a_repeated_chunk_is_refused(monkeypatch):
    """The checksum covers where a chunk lands, not only its bytes; and a piece's bytes
    count once. Before, a bit flipped in a header's offset, or chunk 0 sent twice and
    chunk 1 never, each completed the receive with wrong or unwritten elements."""
    from hetjax.transfer import wire
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P())
    x = jax.device_put(jnp.arange(3072, dtype=jnp.int32), one)  # three chunks of 4096 bytes
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
    sendall = wire.sendall

    def damaging(sock, data, peer):  # 4096 -> 4100 in the second chunk's offset: one bit, whole words
        return sendall(sock, bytes(data).replace(b'"offset": 4096', b'"offset": 4100', 1), peer)

    a, b = endpoints("host", timeout_s=5, chunk_bytes=4096)
    try:
        monkeypatch.setattr(wire, "sendall", damaging)
        r = b.recv("t", like, one)
        h = a.send(x, "t", one, peers={0: b.addresses})
        with pytest.raises(TransferError, match="failed its xxh3 check: the data was corrupted"):
            r.wait()
        with pytest.raises(TransferError, match="refused the message"):
            h.wait()
        monkeypatch.setattr(wire, "sendall", sendall)
        r = b.recv("u", like, one)
        sock = wire.connect(b.addresses[0], LinkConfig().secret(), 5)
        first = memoryview(np.arange(1024, dtype=np.int32).view(np.uint8))
        meta = {"tag": "u", "leaves": 1, "leaf": 0, "piece": 0, "shape": [3072], "dtype": "int32",
                "region": [[0, 3072]], "offset": 0, "n": 4096}
        trailer = wire.TRAILER.pack(wire.chunk_sum(b.checksum, 1, 0, 0, 0, first))
        for _ in range(3):  # chunk 0 three times, chunks 1 and 2 never
            wire.sendall(sock, wire.frame(wire.CHUNK, meta) + first.tobytes() + trailer, "b")
        wire.sendall(sock, wire.frame(wire.END, {"tag": "u"}), "b")
        with pytest.raises(TransferError, match=r"sent bytes 0\.\.4096 of leaf 0, piece 0 again"):
            r.wait()
        assert wire.read_frame(sock, "b", False, 5)[0] == wire.REFUSE
        sock.close()
        # An empty chunk once counted its piece complete a second time (finishing a block
        # with a piece unwritten); half a word would land unwritten bytes on a device.
        for k, (offset, n) in enumerate([(4096, 0), (4096, -4), (4098, 4), (4096, 6), (0, 4096.0)]):
            r = b.recv(f"w{k}", like, one)
            sock = wire.connect(b.addresses[0], LinkConfig().secret(), 5)
            wire.sendall(sock, wire.frame(wire.CHUNK, dict(meta, tag=f"w{k}", offset=offset, n=n)), "b")
            with pytest.raises(TransferError, match=rf"sent bytes {offset}\.\.{offset}\+{n} of a 12288-byte piece of "
                                                    r"4-byte words"):
                r.wait()
            sock.close()
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("backend", ["local", "host"])
def test_a_tree_or_layout_the_two_sides_disagree_on_is_named_not_moved(backend):
    """Before, `local` cut a mis-declared source into the receiver's pieces and returned
    wrong data, and dropped (or failed on) a leaf count that differed; `host` made a
    receive of more leaves than sent wait out its timeout while the send succeeded."""
    a, b = endpoints(backend, timeout_s=10)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sent, claimed = NamedSharding(mesh, P("a", "b")), NamedSharding(mesh, P("b", "a"))
    x = jax.device_put(jnp.arange(16, dtype=jnp.int32).reshape(4, 4), sent)
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sent)
    try:
        if backend == "local":  # host and direct already named it (tested above)
            r = b.recv("t", like, claimed, peers={0: a.addresses})
            a.send(x, "t", sent, peers={0: b.addresses})
            with pytest.raises(TransferError, match="leaf 0 was sent from or to another layout"):
                r.wait()
        for k, (ours, theirs) in enumerate([([like, like], [x]), ([like], [x, x])]):
            r = b.recv(f"n{k}", ours, [sent] * len(ours), peers={0: a.addresses})
            h = a.send(theirs, f"n{k}", [sent] * len(theirs), peers={0: b.addresses})
            t0 = time.monotonic()
            with pytest.raises(TransferError, match=f"sen(t|ds) {len(theirs)} arrays but this receive expects "
                                                    f"{len(ours)}"):
                r.wait()
            assert time.monotonic() - t0 < 5  # named at once, not after timeout_s
            if backend == "host":
                with pytest.raises(TransferError, match="refused the message"):
                    h.wait()
    finally:
        a.close(), b.close()


def test_sub_byte_dtypes_and_an_address_string_for_peers_are_refused_up_front():
    a, b = endpoints("host")
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("a",)), P())
    try:
        for dtype in (jnp.int4, jnp.uint4):
            with pytest.raises(TransferError, match=f"leaf 0 is {np.dtype(dtype).name}, 4 bits an element"):
                a.send(jax.device_put(jnp.ones((8,), dtype), sh), "q", sh, peers={0: b.addresses})
        x = jax.device_put(jnp.ones((8,)), sh)
        with pytest.raises(TransferError, match=r"peers\[0\]='127.0.0.1:1'; give a tuple of 'host:port' strings"):
            a.send(x, "q", sh, peers={0: "127.0.0.1:1"})
    finally:
        a.close(), b.close()


def test_a_kept_route_is_kept_per_plans_dtypes_and_peers():
    """A sender keeps each message's route (its parts, chunk headers and destinations)
    across messages. Arrays of one shape and layout but another dtype share a plan, and
    the same plan sent to another peer shares everything else: each must still arrive
    as itself, where it was sent."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    src, dst = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, "x"))
    a, b, c = open_endpoint(LinkConfig(backend="host", timeout_s=20)), *endpoints("host")
    try:
        for k, (dtype, to) in enumerate([("float32", b), ("int32", b), ("float32", c), ("bfloat16", c)]):
            x = random_array((8, 8), dtype, k, src)
            like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dst)
            r = to.recv(f"m{k}", like, src, peers={0: a.addresses})
            h = a.send(x, f"m{k}", dst, peers={0: to.addresses})
            out = r.wait()
            h.wait()
            assert out.dtype == x.dtype and out.sharding == dst
            np.testing.assert_array_equal(bits(out), bits(x))
        assert len(a._routes) == 4
    finally:
        a.close(), b.close(), c.close()


def test_a_peers_entry_for_a_process_the_message_skips_may_be_anything():
    """peers may name processes a message does not go to; their entries are not looked at."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    sh = NamedSharding(mesh, P("x"))
    a, b = endpoints("host")
    try:
        x = random_array((4, 2), "int32", 1, sh)
        r = b.recv("t", jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), sh, peers={0: a.addresses})
        h = a.send(x, "t", sh, peers={0: b.addresses, 3: None, 4: [["unhashable"]]})
        np.testing.assert_array_equal(bits(r.wait()), bits(x))
        h.wait()
    finally:
        a.close(), b.close()
