"""The probe across two processes as two machines would run it: `--serve` in one,
`--peer` in another, one control connection that proves the job's secret."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetjax.transfer import TransferError, TransferTimeout, probe, wire

ROOT = Path(__file__).resolve().parents[1]
SECRET = "probe-test-secret-0123456789"


def _env(secret):
    env = dict(os.environ, HETJAX_TRANSFER_SECRET=secret, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # each side picks its own device count
    return env


def test_serve_and_peer_measure_every_backend_and_refuse_a_wrong_secret(monkeypatch):
    cmd = [sys.executable, "-m", "hetjax.transfer.probe", "--timeout", "20"]
    server = subprocess.Popen(cmd + ["--serve", "--bind", "127.0.0.1", "--port", "0"], cwd=ROOT, env=_env(SECRET),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().rsplit(" on ", 1)[1].strip()
        # A peer with another secret is refused at once, and the server keeps waiting.
        monkeypatch.setenv("HETJAX_TRANSFER_SECRET", "another-secret-0123456789")
        start = time.monotonic()
        with pytest.raises(TransferError, match=f"peer {address} refused the connection: the shared secrets differ"):
            probe.main(["--peer", address, "--timeout", "20"])
        assert time.monotonic() - start < 5
        peer = subprocess.run(cmd + ["--peer", address, "--mib", "1", "--iters", "1", "--streams", "2"],
                              cwd=ROOT, env=_env(SECRET), capture_output=True, text=True, timeout=60)
        assert peer.returncode == 0, peer.stderr
        rows = {line.split()[0]: line.split() for line in peer.stdout.splitlines()[1:]}
        assert sorted(rows) == ["direct", "host", "raw"], peer.stdout
        for backend, (_, streams, mib, gbps, latency_ms, cores) in rows.items():
            assert streams == "2" and mib == "1", (backend, peer.stdout)  # the server used the peer's parameters
            assert float(gbps) > 0 and float(latency_ms) > 0, (backend, peer.stdout)
            # one 1 MiB copy is too short to count cores, unless a loaded machine stretches it
            assert cores == "n/a" or float(cores) >= 0, (backend, peer.stdout)
        assert server.wait(timeout=30) == 0
        assert "did not prove the job's shared secret" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.parametrize("authenticates, message", [(False, "stopped answering"), (True, "sent nothing for 0.5 s")])
def test_a_silent_server_gives_a_timeout_naming_it(monkeypatch, authenticates, message):
    """Silent before the handshake, or after it (the control channel's own timeout)."""
    monkeypatch.setenv("HETJAX_TRANSFER_SECRET", SECRET)
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    held = []

    def server():  # accepts, maybe proves the secret, then never answers
        conn, addr = listener.accept()
        held.append(conn)
        if authenticates:
            wire.authenticate(conn, SECRET.encode(), str(addr))

    threading.Thread(target=server, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match=f"{address} {message}"):
        probe.main(["--peer", address, "--timeout", "0.5"])
    assert time.monotonic() - start < 5
    listener.close()


def test_busy_seconds_count_at_least_this_process_cpu_time():
    # The machine-wide busy time includes this process's CPU time (time.process_time,
    # an independent clock) and is at most every core busy for the whole wall time.
    if probe._busy_seconds() is None:
        pytest.skip("no /proc/stat here")
    jiffy = 1 / os.sysconf("SC_CLK_TCK")
    busy0, cpu0, wall0 = probe._busy_seconds(), time.process_time(), time.monotonic()
    while time.process_time() - cpu0 < 0.5:
        pass
    busy1, cpu1, wall1 = probe._busy_seconds(), time.process_time(), time.monotonic()
    assert busy1 - busy0 >= cpu1 - cpu0 - 2 * jiffy * os.cpu_count()
    assert busy1 - busy0 <= (wall1 - wall0) * os.cpu_count() + 2 * jiffy * os.cpu_count()


def test_a_raw_stream_that_fails_is_an_error_not_a_timing():
    """The raw baseline's streams run on threads of their own: an error in one used to be
    printed by the thread and lost, and the probe reported the time as a bandwidth."""
    a, b = socket.socketpair()
    b.close()  # the peer is gone
    with pytest.raises(Exception, match="closed the connection mid-message|connection lost"):
        probe._in_threads([(wire.recv_into, a, memoryview(bytearray(16)), "raw stream 0")])
    a.close()
