"""Cross-mesh transfer: move sharded arrays between islands' meshes (see api.py).

Backends: local.py (one process), host.py (TCP; wire.py, stream.py), direct.py (jax's transfer server)."""

from hetjax.errors import ConfigError
from hetjax.transfer.api import Endpoint
from hetjax.transfer.core import Handle
from hetjax.transfer.link import LinkConfig, TransferError, TransferTimeout
from hetjax.transfer.plan import Layout, Plan, make_plan

__all__ = ["Endpoint", "Handle", "Layout", "LinkConfig", "Plan", "TransferError", "TransferTimeout",
           "make_plan", "open_endpoint"]


def open_endpoint(cfg: LinkConfig, process_index: int | None = None) -> Endpoint:
    """Starts this process's end of a link with the backend `cfg.backend`."""
    # Here, not in api.py, so that the backends import api and nothing imports them back;
    # each is imported on first use (direct needs jax.experimental.transfer, host xxhash).
    if not isinstance(cfg, LinkConfig):
        raise ConfigError(f"open_endpoint: expected a LinkConfig, got {type(cfg).__name__}")
    if cfg.backend == "local":
        from hetjax.transfer.local import LocalEndpoint
        return LocalEndpoint(cfg, process_index)
    if cfg.backend == "host":
        from hetjax.transfer.host import HostEndpoint
        return HostEndpoint(cfg, process_index)
    from hetjax.transfer.direct import DirectEndpoint
    return DirectEndpoint(cfg, process_index)
