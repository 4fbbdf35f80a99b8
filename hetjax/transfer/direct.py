"""The `direct` backend: jax.experimental.transfer pulls arrays into device memory.

That API does no resharding: pulling with a sharding other than the offered one
returns wrong data without an error. So nothing but single-device pieces cross it:
the sender offers each planned piece as an array on its source device, the receiver
pulls exactly those shapes onto each group's receiver device, and the destination
array is put together from them here.

Safety: the transfer server has no authentication of its own, so every offer's id is
an HMAC of (tag, processes, shapes, dtypes, layouts) under the job's secret: a peer
without the secret cannot name an offer, and a receive whose tag, shape, dtype or
layout differs from the send matches no offer and times out naming the peer. The
transport is TCP; there is no per-chunk checksum on this path (use `host` for one).
Pulls have no working deadline in jax (a dead sender blocks them forever), so each
pull runs in a daemon thread that we stop waiting for after timeout_s. Here timeout_s
bounds each source's whole transfer, data included (`host` times out on silence).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading

import jax
import numpy as np
from jax.experimental import transfer as jax_transfer
from jax.sharding import SingleDeviceSharding

from hetjax.transfer import core
from hetjax.transfer.api import Endpoint
from hetjax.transfer.link import TransferTimeout, address
from hetjax.transfer.plan import extent


class DirectEndpoint(Endpoint):
    def __init__(self, cfg, process_index=None):
        super().__init__(cfg, process_index)
        self._secret = cfg.secret()
        hosts = cfg.listen_addresses
        client = jax.local_devices()[0].client
        self._server = jax_transfer.start_transfer_server(
            client, address(hosts[0], cfg.port), [address(h, 0) for h in hosts])
        self.addresses = (self._server.address(),)
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()

    def _uuid(self, tag, p, q, avals, src, dst) -> int:
        what = json.dumps([tag, p, q] + [[list(a.shape), np.dtype(a.dtype).name, s.to_json(), d.to_json()]
                                         for a, s, d in zip(avals, src, dst)])
        return int.from_bytes(hmac.new(self._secret, what.encode(), hashlib.sha256).digest()[:8], "little") >> 1

    def send(self, tree, tag, dst, peers=None):
        leaves, plans, dst_layouts = self.prepare_send(tree, tag, dst)
        src_layouts = core.layouts([x.sharding for x in leaves])
        by_dst: dict[int, list] = {}
        for i, plan in enumerate(plans):
            for piece in plan.sent_by(self.process):
                by_dst.setdefault(piece.dst_process, []).append(core.device_piece(leaves[i], plan, piece))
        handle = core.Handle(core.finished(), f"send {tag!r}")
        for q, arrays in sorted(by_dst.items()):
            self._server.await_pull(self._uuid(tag, self.process, q, leaves, src_layouts, dst_layouts), arrays)
            handle.wire_bytes += sum(a.nbytes for a in arrays)
        return handle

    def recv(self, tag, like, src, peers=None):
        expect = self.prepare_recv(tag, like, src)
        src_layouts = core.layouts(src)
        wanted: dict[int, list] = {}
        for i, (aval, plan) in enumerate(zip(expect.avals, expect.plans)):
            receivers = list(aval.sharding.mesh.devices.flat)
            for piece in plan.received_by(self.process):
                shape = extent(piece.region)
                sds = jax.ShapeDtypeStruct(shape, aval.dtype, sharding=SingleDeviceSharding(receivers[piece.dst]))
                wanted.setdefault(piece.src_process, []).append((i, piece, sds))
        core.check_peers(peers, wanted, f"recv {tag!r}", "source")
        handle = core.Handle(None, f"recv {tag!r}")
        handle.watch(None, self.cfg.timeout_s)  # bounds the fan-out; pulls have their own wait
        return handle.run(self._receive, tag, expect, src_layouts, wanted, peers, handle)

    def _connection(self, address):
        with self._lock:
            if address not in self._conns:
                self._conns[address] = self._server.connect(address)
            return self._conns[address]

    def _receive(self, tag, expect, src_layouts, wanted, peers, handle):
        pulls = {}
        for p, items in sorted(wanted.items()):
            uuid = self._uuid(tag, p, self.process, expect.avals, src_layouts, expect.dst)
            address = peers[p][0]
            # pull() returns at once, its arrays become ready when the data is in: wait for that
            # here, under the timeout, since an op on them would block their device until then.
            pulls[p] = (address, core.run_async(lambda a=address, u=uuid, s=[sds for _, _, sds in items]:
                                                jax.block_until_ready(self._connection(a).pull(u, s))))
        received = []
        for p, (address, future) in pulls.items():
            if not core.futures.wait([future], timeout=self.cfg.timeout_s).done:
                raise TransferTimeout(
                    f"recv {tag!r}: source process {p} at {address} sent nothing matching, or not all "
                    f"of it, within {self.cfg.timeout_s:g} s (LinkConfig.timeout_s, which bounds the whole "
                    f"transfer on this backend): it is gone, too slow for the limit, or its tag, shapes, "
                    f"dtypes or layouts differ from this receive's")
            try:
                arrays = future.result()
            except jax.errors.JaxRuntimeError as e:
                # The sender died mid-pull: reported as the timeout a silent sender gives,
                # so callers catch one error for a lost peer on every backend.
                raise TransferTimeout(f"recv {tag!r}: lost source process {p} at {address} ({e})") from None
            received += [(i, piece, data) for (i, piece, _), data in zip(wanted[p], arrays)]
        return core.assemble(expect, self.process, received, handle)
