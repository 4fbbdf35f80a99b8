"""How one link between islands is carried: its config (LinkConfig lives with the other
config sections in hetjax.config), addresses and errors."""

from __future__ import annotations

from hetjax.config import BACKENDS, CHECKSUMS, LinkConfig

__all__ = ["BACKENDS", "CHECKSUMS", "LinkConfig", "TransferError", "TransferTimeout", "address"]



def address(host: str, port: int) -> str:
    """"host:port", with an IPv6 host in brackets ("[::1]:port")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TransferError(RuntimeError):
    """A transfer failed: bad data, a refused connection, a mismatched message."""


class TransferTimeout(TransferError, TimeoutError):
    """A peer did not answer within LinkConfig.timeout_s."""
