"""The `local` backend: both meshes live in this process (virtual islands).

Pieces move with jax.device_put from their source device to the group's receiver,
so even here a replicated destination is copied once and fanned out after.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np

from hetjax.transfer import core
from hetjax.transfer.api import Endpoint, check_leaf
from hetjax.transfer.link import TransferTimeout

_mailbox: dict[str, tuple] = {}
_arrived = threading.Condition()


class LocalEndpoint(Endpoint):
    def send(self, tree, tag, dst, peers=None):
        leaves, plans, _ = self.prepare_send(tree, tag, dst)
        with _arrived:
            _mailbox[tag] = (leaves, plans)
            _arrived.notify_all()
        done = core.run_async(lambda: None)
        handle = core.Handle(done, f"send {tag!r}")
        handle.wire_bytes = sum(p.wire_bytes for p in plans)
        return handle

    def recv(self, tag, like, src, peers=None):
        expect = self.prepare_recv(tag, like, src)
        handle = core.Handle(None, f"recv {tag!r}")
        handle._future = core.run_async(self._receive, tag, expect, handle)
        return handle

    def _receive(self, tag, expect, handle):
        deadline = time.monotonic() + self.cfg.timeout_s
        with _arrived:
            while tag not in _mailbox:
                if not _arrived.wait(timeout=deadline - time.monotonic()):
                    raise TransferTimeout(f"recv {tag!r}: nothing was sent within {self.cfg.timeout_s:g} s "
                                          f"(LinkConfig.timeout_s)")
            leaves, _ = _mailbox.pop(tag)
        out = []
        for i, (x, aval, plan, dst) in enumerate(zip(leaves, expect.avals, expect.plans, expect.dst)):
            check_leaf(tag, i, x.shape, x.dtype, aval)
            receivers = list(aval.sharding.mesh.devices.flat)
            by_group: dict[int, list] = {}
            for piece in plan.pieces:
                data = jax.device_put(core.device_piece(x, plan, piece), receivers[piece.dst])
                by_group.setdefault(piece.group, []).append((piece, data))
                handle.wire_bytes += piece.nbytes
            blocks = {gi: core.block_from_device_pieces(plan.groups[gi], ps, np.dtype(aval.dtype))
                      for gi, ps in by_group.items()}
            out.append(core.build(aval, plan, dst, self.process, blocks))
        return jax.tree.unflatten(expect.treedef, out)
