"""How one link between islands is carried: its config (LinkConfig lives with the other
config sections in hetjax.config), addresses and errors."""

from __future__ import annotations

import time

from hetjax.config import BACKENDS, CHECKSUMS, LinkConfig
from hetjax.errors import TransferError, TransferTimeout  # noqa: F401 - raised here, caught by callers

__all__ = ["BACKENDS", "CHECKSUMS", "LinkConfig", "TransferError", "TransferTimeout", "address"]



def address(host: str, port: int) -> str:
    """"host:port", with an IPv6 host in brackets ("[::1]:port")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def retry(attempt, timeout_s: float, pause_s: float, fail):
    """attempt()'s result, tried again every pause_s while it raises OSError (a peer or a
    name that is not there yet); after timeout_s, raises fail(the last OSError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return attempt()
        except OSError as e:
            if time.monotonic() > deadline:
                raise fail(e) from None
            time.sleep(pause_s)


