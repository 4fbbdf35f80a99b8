"""The `local` backend: both meshes live in this process (virtual islands).

Pieces move with jax.device_put from their source device to the group's receiver,
so even here a replicated destination is copied once and fanned out after.
"""

from __future__ import annotations

import threading

import jax

from hetjax.transfer import core
from hetjax.transfer.api import Endpoint, check_leaf
from hetjax.transfer.link import TransferError, TransferTimeout

_mailbox: dict[str, tuple] = {}
_posted: set[str] = set()  # tags of receives waiting: a second would race the first for the message
_arrived = threading.Condition()


def drop(prefix: str, contains: str) -> None:
    """Forgets unreceived messages whose tag starts with `prefix` and contains `contains`
    (a job that stopped leaves nothing behind for the next one in this process)."""
    with _arrived:
        for tag in [t for t in _mailbox if t.startswith(prefix) and contains in t]:
            del _mailbox[tag]


class LocalEndpoint(Endpoint):
    def send(self, tree, tag, dst, peers=None):
        leaves, plans, _ = self.prepare_send(tree, tag, dst)
        self.check_open(f"send {tag!r}")
        with _arrived:
            if tag in _mailbox:  # it would replace the message not yet received
                raise TransferError(f"send {tag!r}: a message with this tag is still waiting for its receive; "
                                    f"tags must be unique in flight")
            _mailbox[tag] = (leaves, plans)
            _arrived.notify_all()
        handle = core.Handle(core.finished(), f"send {tag!r}")
        handle.wire_bytes = sum(p.wire_bytes for p in plans)
        return handle

    def recv(self, tag, like, src, peers=None):
        expect = self.prepare_recv(tag, like, src)
        self.check_open(f"recv {tag!r}")
        with _arrived:
            if tag in _posted:
                raise self.twin(tag)
            _posted.add(tag)
        handle = core.Handle(None, f"recv {tag!r}")
        return handle.run(self._receive, tag, expect, handle)

    def close(self) -> None:
        super().close()
        with _arrived:  # wakes this endpoint's waiting receives, which then fail
            _arrived.notify_all()

    def _receive(self, tag, expect, handle):
        with _arrived:
            try:
                while tag not in _mailbox:
                    _arrived.wait(timeout=0.05)
                    if tag not in _mailbox and self.closed:  # its waiter would wait out timeout_s
                        raise TransferError(f"recv {tag!r}: this endpoint was closed")
                    if tag not in _mailbox and handle.overdue(self.cfg.timeout_s):
                        raise TransferTimeout(f"recv {tag!r}: nothing was sent within {self.cfg.timeout_s:g} s "
                                              f"of waiting for it (LinkConfig.timeout_s)")
                leaves, plans = _mailbox.pop(tag)
            finally:
                _posted.discard(tag)
        if len(leaves) != len(expect.avals):
            raise TransferError(f"recv {tag!r}: the sender sent {len(leaves)} arrays but this receive expects "
                                f"{len(expect.avals)}; both islands must agree on the tree")
        received = []
        for i, (x, aval, plan) in enumerate(zip(leaves, expect.avals, expect.plans, strict=True)):
            check_leaf(tag, i, x.shape, x.dtype, aval)
            if x.is_deleted():  # read here, not when sent: a local send's handle is done at once
                raise TransferError(f"recv {tag!r}: leaf {i} was deleted or donated after its send; the local "
                                    f"backend reads a sent array when it is received: keep it alive until then")
            if plans[i] != plan:  # both sides plan from (shape, source layout, destination layout)
                raise TransferError(f"recv {tag!r}: leaf {i} was sent from or to another layout than this "
                                    f"receive's `src`/`like` say; the two islands disagree on the layouts")
            receivers = list(aval.sharding.mesh.devices.flat)
            # A copy even where source and receiver devices are one: the received array owns its
            # memory, as on the other backends (deleting or donating either would kill both).
            received += [(i, piece, jax.device_put(core.device_piece(x, plan, piece), receivers[piece.dst],
                                                   may_alias=False)) for piece in plan.pieces]
        return core.assemble(expect, self.process, received, handle)
