"""Cross-mesh transfer: move sharded arrays between islands' meshes (see api.py)."""

from hetjax.transfer.api import Endpoint, open_endpoint
from hetjax.transfer.core import Handle
from hetjax.transfer.link import LinkConfig, TransferError, TransferTimeout
from hetjax.transfer.plan import Layout, Plan, make_plan

__all__ = ["Endpoint", "Handle", "Layout", "LinkConfig", "Plan", "TransferError", "TransferTimeout",
           "make_plan", "open_endpoint"]
