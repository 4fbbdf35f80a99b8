"""A posted `host` receive: the buffers for the pieces this process expects, which of
them are still missing (and from which sender), and the blocks built from them."""

from __future__ import annotations

import bisect
import collections
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.transfer import core, wire
from hetjax.transfer.api import check_leaf
from hetjax.transfer.link import TransferError
from hetjax.transfer.plan import extent


# Devices where host -> device is a copy: there a large piece lands chunk by chunk as
# its bytes are verified, so that the copy overlaps the stream instead of following its
# last byte (an H200 took host's 256 MiB at 0.26 of raw TCP with one device_put per
# block). jax on CPU adopts a whole block without a copy, which chunks would turn into one.
LAND_BY_CHUNK = frozenset({"gpu", "cuda", "rocm", "tpu"})
LAND_MIN_BYTES = wire.SMALL  # smaller pieces go with the message's one batched device_put


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _join(chunks, shape, dtype):
    """A piece from its chunks (unsigned words on its device, in order), on that device."""
    return jax.lax.bitcast_convert_type(jnp.concatenate(chunks).reshape(shape), dtype)


def _lands(aval, device, pieces) -> bool:
    """Whether a block's pieces go to its device chunk by chunk as they arrive."""
    words_fit = np.dtype(aval.dtype).itemsize < 8 or jax.config.jax_enable_x64  # else device_put narrows the words
    return (device.platform in LAND_BY_CHUNK and aval.dtype != jnp.bool_ and words_fit
            and all(p.nbytes > LAND_MIN_BYTES for p in pieces))


class Withdrawn:
    """The ids of the messages that receives which have ended took chunks of (the last
    KEEP): the rest of such a message, on a stream that had not begun to write it when its
    receive timed out, must not land in the receive posted since for the same tag."""

    KEEP = 4096

    def __init__(self):
        self._ids: collections.OrderedDict = collections.OrderedDict()

    def add(self, messages) -> None:
        for m in messages - {None}:  # None: a sender that names no message
            self._ids[m] = None
        while len(self._ids) > self.KEEP:
            self._ids.popitem(last=False)

    def check(self, tag, message, peer) -> None:
        if message in self._ids:
            raise TransferError(f"recv {tag!r}: the receive that peer {peer}'s message began in was withdrawn "
                                f"(its wait timed out); the rest of that message is refused, and the receive "
                                f"posted since waits for a message of its own")


class Inbox:
    """One posted receive: buffers for the pieces this process expects, and progress."""

    def __init__(self, endpoint, tag, expect, handle):
        self.tag, self.expect, self.handle, self.endpoint = tag, expect, handle, endpoint
        self.messages: set = set()  # the ids of the messages whose chunks came in (host.send's)
        self.lock = threading.Lock()
        self.activity = core.Activity()
        self.future = handle.future
        self.buffers, self.left, self.group_left, self.blocks, self.ranges = {}, {}, {}, [], {}
        self.landed: dict[tuple[int, int], list] = {}  # pieces that go to their device chunk by chunk
        for i, (aval, plan) in enumerate(zip(expect.avals, expect.plans)):
            self.blocks.append({})
            mine: dict[int, list[int]] = {}
            for j, piece in enumerate(plan.pieces):
                if piece.dst_process == endpoint.process:
                    self.buffers[i, j] = endpoint.buffers.take(extent(piece.region), aval.dtype)
                    self.left[i, j] = piece.nbytes
                    mine.setdefault(piece.group, []).append(j)
            for g, js in mine.items():
                self.group_left[i, g] = len(js)
                # A whole block lands chunk by chunk or not at all: a block with one small
                # piece is joined on the host anyway, and its landed chunks would be copied twice.
                if _lands(aval, aval.sharding.mesh.devices.flat[plan.groups[g].receiver], [plan.pieces[j] for j in js]):
                    self.landed.update({(i, j): [] for j in js})
        self.groups_left = len(self.group_left)
        self.process = endpoint.process

    def owing(self):
        """A function naming the sender processes whose pieces have not all arrived: the
        ones a silent receive pings (a sender that delivered its part may have exited since).
        It holds the counts, not the inbox: the receive's handle keeps it, and a handle
        holding its inbox is a cycle that keeps the buffers from the pool until a collection."""
        lock, left, plans = self.lock, self.left, self.expect.plans

        def owing() -> list[int]:
            with lock:
                return sorted({plans[i].pieces[j].src_process for (i, j), n in left.items() if n})
        return owing

    def place(self, peer, meta: dict) -> tuple:
        """(leaf, piece, offset, length, where the bytes go) of a chunk whose header
        matches this receive's plan (to claim before the bytes are written there)."""
        tag, i, j = self.tag, meta["leaf"], meta["piece"]
        if not isinstance(i, int) or not isinstance(j, int):
            raise TransferError(f"recv {tag!r}: peer {peer} sent a chunk header without leaf and piece numbers")
        avals, plans = self.expect.avals, self.expect.plans
        if meta.get("leaves") != len(avals):
            raise TransferError(f"recv {tag!r}: peer {peer} sends {meta.get('leaves')} arrays but this receive "
                                f"expects {len(avals)}; both islands must agree on the tree")
        if not 0 <= i < len(avals):
            raise TransferError(f"recv {tag!r}: peer {peer} sent leaf {i}, but the receiver expects {len(avals)} leaves")
        if meta["shape"] != list(avals[i].shape) or meta["dtype"] != wire.dtype_name(avals[i].dtype):
            check_leaf(tag, i, meta["shape"], jnp.dtype(meta["dtype"]), avals[i])
        if (i, j) not in self.buffers or plans[i].wire_regions[j] != meta["region"]:
            raise TransferError(f"recv {tag!r}: peer {peer} sent piece {j} {meta['region']} of leaf {i}, which this "
                                f"process's plan does not expect here; the two islands disagree on the layouts")
        buf = self.buffers[i, j].reshape(-1).view(np.uint8)
        offset, n, word = meta["offset"], meta["n"], self.buffers[i, j].itemsize
        # An empty chunk would count a piece complete twice, and one that splits a word
        # would land half-written words on the device (inbox.arrived).
        if not (type(offset) is int and type(n) is int and 0 <= offset and 0 < n and offset + n <= buf.size
                and offset % word == n % word == 0):
            raise TransferError(f"recv {tag!r}: peer {peer} sent bytes {offset}..{offset}+{n} of a {buf.size}-byte "
                                f"piece of {word}-byte words; a chunk is whole words inside its piece")
        return i, j, offset, n, memoryview(buf)[offset:offset + n]

    def verify(self, peer, meta: dict, n: int, computed: int, sent) -> None:
        """Refuses a chunk of n bytes whose checksum, computed here, is not the one sent."""
        if computed != sent:
            i, j, offset = meta["leaf"], meta["piece"], meta["offset"]
            raise TransferError(f"recv {self.tag!r}: a chunk from peer {peer} (leaf {i}, piece {j}, bytes "
                                f"{offset}..{offset + n}) failed its {self.endpoint.cfg.checksum} "
                                f"check: the data was corrupted")

    def cut(self, error: TransferError, i: int, j: int) -> TransferError:
        """A stream that went silent or ended inside piece j of leaf i: the same error,
        naming this receive and the process sending (its stream's port names none)."""
        src = self.expect.plans[i].pieces[j].src_process
        return type(error)(f"recv {self.tag!r} from source process {src}: {error}")

    def claim(self, i: int, j: int, offset: int, n: int, peer) -> None:
        """Refuses bytes of a piece that already arrived: counted twice, they would finish
        the receive with other bytes never written (a repeated or stale chunk)."""
        with self.lock:
            ranges = self.ranges.setdefault((i, j), [])  # (start, end), sorted and disjoint
            k = bisect.bisect(ranges, (offset, offset + n))
            if (k and ranges[k - 1][1] > offset) or (k < len(ranges) and ranges[k][0] < offset + n):
                raise TransferError(f"recv {self.tag!r}: peer {peer} sent bytes {offset}..{offset + n} of leaf {i}, "
                                    f"piece {j} again; a message's bytes arrive once")
            ranges.insert(k, (offset, offset + n))

    def arrived(self, i: int, j: int, offset: int, n: int) -> None:
        """Counts n verified bytes of piece j of leaf i; finishes blocks and the receive."""
        if (i, j) in self.landed:  # on its way to the device while later chunks still arrive
            t = time.perf_counter()
            words = self.buffers[i, j].reshape(-1).view(core._uint(self.expect.avals[i].dtype))
            size = words.itemsize
            plan = self.expect.plans[i]
            device = self.expect.avals[i].sharding.mesh.devices.flat[plan.groups[plan.pieces[j].group].receiver]
            chunk = jax.device_put(words[offset // size:(offset + n) // size], device)
            self.endpoint.copied(self.tag, t)
            with self.lock:
                self.landed[i, j].append((offset, chunk))
        with self.lock:
            self.handle.wire_bytes += n
            self.left[i, j] -= n
            if self.left[i, j]:
                return
            plan = self.expect.plans[i]
            gi = plan.pieces[j].group
            self.group_left[i, gi] -= 1
            if self.group_left[i, gi]:
                return
        # The block is complete. A large one goes host -> device now, while other chunks
        # still arrive; small ones, and every one on CPU (where jax adopts the host block,
        # so there is no copy to overlap, only 150 us of dispatch a block), go together
        # when the message is in (build: one call).
        t = time.perf_counter()
        group, dtype = plan.groups[gi], self.expect.avals[i].dtype
        mine = [k for k, p in enumerate(plan.pieces) if (i, k) in self.buffers and p.group == gi]
        if all((i, k) in self.landed for k in mine):
            with self.lock:  # the chunks go once joined: kept, a receive would hold its bytes twice on the device
                chunks = {k: sorted(self.landed.pop((i, k)), key=lambda oc: oc[0]) for k in mine}
            parts = [(plan.pieces[k], _join(tuple(c for _, c in chunks[k]), extent(plan.pieces[k].region), np.dtype(dtype)))
                     for k in mine]
            block = core.block_from_device_pieces(group, parts, dtype)
            self.endpoint.copied(self.tag, t)
        else:
            block = core.block_from_host_pieces(group, [(plan.pieces[k], self.buffers[i, k]) for k in mine], dtype)
            device = self.expect.avals[i].sharding.mesh.devices.flat[group.receiver]
            if block.nbytes > wire.SMALL and device.platform in LAND_BY_CHUNK:
                block = jax.device_put(block, device)
                self.endpoint.copied(self.tag, t)
        with self.lock:
            self.blocks[i][gi] = block
            self.groups_left -= 1
            finished = self.groups_left == 0
        if finished:
            self.finish()

    def finish(self):
        try:
            out = [core.build(a, p, d, self.process, b)
                   for a, p, d, b in zip(self.expect.avals, self.expect.plans, self.expect.dst, self.blocks)]
        except Exception as e:  # noqa: BLE001 - handed to the waiter
            self.fail(e)
            return
        core.settle(self.future, jax.tree.unflatten(self.expect.treedef, out))

    def fail(self, error: Exception) -> None:
        core.settle(self.future, error=error)
