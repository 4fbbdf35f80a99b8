"""How one link between islands is carried: its config (LinkConfig, composed into
config.hetero by hetjax.config), addresses and errors."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from hetjax.errors import ConfigError
from hetjax.errors import TransferError, TransferTimeout  # noqa: F401 - raised here, caught by callers

__all__ = ["BACKENDS", "CHECKSUMS", "LinkConfig", "TransferError", "TransferTimeout", "address"]

BACKENDS = ("local", "host", "direct")  # transfer backends (hetjax/transfer)
CHECKSUMS = ("xxh3", "crc32", "adler32")
MAX_TIMEOUT_S = 1e7  # about 4 months


@dataclasses.dataclass(frozen=True)
class LinkConfig:
    """One link between two islands (both ends use equal configs)."""

    backend: str = "host"  # local | host | direct
    streams: int = 2  # parallel TCP streams per pair of processes (host)
    # This process's NIC addresses: the endpoint listens on each, and stream i of a
    # peer goes to the peer's address i % len. Empty: bind_address only.
    nic_addresses: tuple = ()
    bind_address: str = "127.0.0.1"  # loopback by default: say so to open a link
    port: int = 0  # 0: any free port (the endpoint reports its addresses)
    secret_env: str = "HETJAX_TRANSFER_SECRET"  # the job's shared secret, from this variable...
    secret_file: str = ""  # ...or from this file when set
    # TransferTimeout once a receive's wait() has heard nothing this long (host: no byte;
    # local, direct: no message); the time between posting a receive and waiting is not counted
    timeout_s: float = 60.0
    # host: a peer silent for timeout_s is pinged; one that answers (alive, but compiling,
    # restoring or in a long step) is waited for, up to this long without data
    busy_timeout_s: float = 900.0
    chunk_bytes: int = 8 << 20  # unit of checksums and of copy/transfer overlap
    checksum: str = "xxh3"  # xxh3 (64-bit, 24-35 GB/s in cache here) | crc32 (~7) | adler32 (~4), per chunk

    def validate(self, prefix: str = "link") -> None:
        """Raises ConfigError naming the field, the value and the fix."""
        if self.backend not in BACKENDS:
            raise ConfigError(f"{prefix}.backend={self.backend!r}: choose one of {BACKENDS}")
        if self.checksum not in CHECKSUMS:
            raise ConfigError(f"{prefix}.checksum={self.checksum!r}: choose one of {CHECKSUMS}")
        if not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise ConfigError(f"{prefix}.streams={self.streams!r}: use 1 to 64 parallel TCP streams")
        for field in ("timeout_s", "busy_timeout_s"):
            value = getattr(self, field)
            # a socket's timeout must fit its time_t: inf or 1e10 failed every send (OverflowError)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
                raise ConfigError(f"{prefix}.{field}={value!r}: give seconds, more than 0 and at most "
                                  f"{MAX_TIMEOUT_S:g} (for a peer that may be busy for long, e.g. 86400)")
        if self.backend == "host" and not self.busy_timeout_s >= self.timeout_s:
            raise ConfigError(f"{prefix}.busy_timeout_s={self.busy_timeout_s!r} is below {prefix}.timeout_s="
                              f"{self.timeout_s!r}: the wait for a busy peer that still answers must be at least "
                              f"the wait for a silent one")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 4096:
            raise ConfigError(f"{prefix}.chunk_bytes={self.chunk_bytes!r}: use at least 4096 (e.g. 8 << 20)")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"{prefix}.port={self.port!r}: use 0 (any free port) or 1..65535")
        if not isinstance(self.nic_addresses, tuple) or not all(isinstance(a, str) and a for a in self.nic_addresses):
            raise ConfigError(f"{prefix}.nic_addresses={self.nic_addresses!r}: a tuple of IP addresses, e.g. ('10.0.0.1', '10.0.1.1')")
        if not self.bind_address:
            raise ConfigError(f"{prefix}.bind_address is empty: give an IP address, e.g. '127.0.0.1'")

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        """The addresses this end listens on."""
        return self.nic_addresses or (self.bind_address,)

    def secret(self, prefix: str = "link") -> bytes:
        """The job's shared secret; an empty or missing one is a ConfigError."""
        if self.secret_file:
            path = Path(self.secret_file)
            if not path.is_file():
                raise ConfigError(f"{prefix}.secret_file={self.secret_file!r}: no such file")
            value = path.read_bytes().strip()
            where = f"{prefix}.secret_file={self.secret_file!r}"
        else:
            value = os.environ.get(self.secret_env, "").encode()
            where = f"environment variable {self.secret_env} ({prefix}.secret_env)"
        if len(value) < 16:
            raise ConfigError(
                f"{where} holds no shared secret of at least 16 bytes; every process of the job "
                f"needs the same one, e.g. export {self.secret_env}=$(openssl rand -hex 32)")
        return value


def address(host: str, port: int) -> str:
    """"host:port", with an IPv6 host in brackets ("[::1]:port")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def retry(attempt, timeout_s: float, pause_s: float, fail, stop=None):
    """attempt()'s result, tried again every pause_s while it raises OSError (a peer or a
    name that is not there yet); after timeout_s, or once stop() says so (an endpoint
    closing), raises fail(the last OSError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return attempt()
        except OSError as e:
            if stop is not None and stop():  # not the peer's doing
                raise TransferError(f"this endpoint was closed while it connected ({e})") from None
            if time.monotonic() > deadline:
                raise fail(e) from None
            time.sleep(pause_s)


