"""What every backend shares: plans per leaf, cutting source pieces out of shards,
and building the destination array from received blocks (with the fan-out)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import queue
import threading
import time
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src.interpreters import pxla
from jax.experimental import layout as memory_layout
from jax.sharding import NamedSharding, PartitionSpec

from hetjax.transfer.buffers import aligned_empty
from hetjax.transfer.link import TransferError, TransferTimeout
from hetjax.transfer.plan import Layout, Plan, Region, extent, make_plan

log = logging.getLogger("hetjax.transfer")


class Handle:
    """A transfer in flight. `wait()` returns its result (the received pytree for a
    receive, None for a send) or raises; `wire_bytes` counts payload bytes that
    this process put on (send) or took off (receive) the link. A destination that
    spans processes fans out in `wait()`: a collective, so every one of its processes
    must wait for its receives in the same order (as for any jax collective)."""

    def __init__(self, future: futures.Future | None, describe: str):
        self._future, self._describe = future, describe
        self._idle, self._timeout_s = None, 0.0  # see watch()
        self._alive, self._busy_timeout_s, self._answered = None, 0.0, 0.0
        self._posted = time.monotonic()
        self._waiting_since: float | None = None  # when wait() was first called (see overdue)
        self.wire_bytes = 0
        self.first_byte: float | None = None  # perf_counter time the first byte arrived (when known)
        self._result = None
        self._spreading: futures.Future | None = None  # the fan-out's collective, once started
        self._lock = threading.Lock()  # one fan-out: a second would be a collective on this process only

    @property
    def future(self) -> futures.Future:
        return self._future

    @property
    def describe(self) -> str:
        return self._describe

    def run(self, fn, *args) -> Handle:
        """Runs fn(*args) in a daemon thread as this transfer (fn may add to wire_bytes)."""
        self._future = run_async(fn, *args)
        return self

    def watch(self, idle, timeout_s: float, alive=None, busy_timeout_s: float = 0.0) -> None:
        """wait() raises TransferTimeout once idle() (seconds since the peer last spoke)
        passes timeout_s. With `alive` (the peers' answer to a ping, None when one does not
        answer), a silent peer is pinged first, and one that answers is waited for again,
        up to busy_timeout_s without data: a peer that compiles or restores for longer than
        timeout_s is busy, not lost."""
        self._idle, self._timeout_s = idle, timeout_s
        self._alive, self._busy_timeout_s = alive, busy_timeout_s

    def done(self) -> bool:
        return self._future.done()

    def overdue(self, timeout_s: float) -> bool:
        """Whether the peer has been silent for timeout_s while someone waits for this
        transfer. A receive is posted early (a pipeline posts a step's receives when the
        step starts), so the time before its wait() is not the peer's silence. One never
        waited for gives up 10 x timeout_s after it was posted, freeing its thread."""
        now = time.monotonic()
        if self._waiting_since is None:
            return now - self._posted > 10 * timeout_s
        quiet = now - max(self._waiting_since, self._answered)  # a ping answered counts as life
        if self._idle is not None:  # bytes of this message count as life too
            quiet = min(quiet, self._idle())
        return quiet > timeout_s

    def _silence(self) -> str | None:
        """Why this overdue transfer is given up on, or None when its peer answered a ping
        and the wait goes on."""
        if self._alive is None:
            return (f"{self._describe}: no data for {self._timeout_s:g} s (LinkConfig.timeout_s); "
                    f"the peer stopped answering or never sent")
        answered, said = self._alive()
        if not answered:
            return f"{self._describe}: nothing for {self._timeout_s:g} s (LinkConfig.timeout_s), and {said}"
        no_data = time.monotonic() - self._waiting_since
        no_data = no_data if self._idle is None else min(no_data, self._idle())
        if no_data > self._busy_timeout_s:
            return (f"{self._describe}: the peer answers pings ({said}) but nothing moved for "
                    f"{self._busy_timeout_s:g} s (LinkConfig.busy_timeout_s); raise it if a compilation, restore "
                    f"or step takes longer")
        self._answered = time.monotonic()
        log.warning("%s: nothing for %.0f s, but the peer answers (%s); still waiting, up to "
                    "LinkConfig.busy_timeout_s=%g s", self._describe, no_data, said, self._busy_timeout_s)
        return None

    def arriving(self) -> None:
        """Marks the first byte's arrival (the first call counts)."""
        if self.first_byte is None:
            self.first_byte = time.perf_counter()

    def wait(self):
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        while True:
            # Not result(timeout=...): its TimeoutError is the builtin one, which a
            # TransferTimeout raised by the transfer would also match.
            if futures.wait([self._future], timeout=0.05).done:
                with self._lock:
                    if self._result is None:
                        self._result = (self._spread(self._future.result()),)
                return self._result[0]
            if (self._idle is not None or self._alive is not None) and self.overdue(self._timeout_s):
                why = self._silence()
                if why is None:
                    continue
                error = TransferTimeout(why)
                # Ends the transfer too: a receive given up on is withdrawn (its tag can be
                # posted again, its buffers go back), and a late message for it is refused.
                try:
                    self._future.set_exception(error)
                except futures.InvalidStateError:  # it finished meanwhile
                    continue
                raise error

    def _spread(self, tree):
        """Fans out the arrays whose replica groups span processes. The collective waits
        for every process of the destination; one that never joins (its receive failed,
        it died) gives a TransferTimeout after timeout_s, not a hang."""
        if not any(isinstance(x, Unspread) for x in jax.tree.leaves(tree)):
            return tree
        if self._spreading is None:  # a wait() after a timed-out one waits for the same collective
            self._spreading = run_async(lambda: jax.block_until_ready(
                jax.tree.map(lambda x: fan_out(x.array) if isinstance(x, Unspread) else x, tree)))
        future = self._spreading
        if not futures.wait([future], timeout=self._timeout_s or None).done:
            raise TransferTimeout(
                f"{self._describe}: the destination's other processes did not join its fan-out "
                f"within {self._timeout_s:g} s (LinkConfig.timeout_s); one of them failed or died")
        return future.result()


def wait_overdue(handle: Handle, fs, timeout_s: float, first: bool = False) -> bool:
    """Waits for the futures `fs` (all, or the first with `first`); False once the handle
    is overdue (Handle.overdue) before they are done."""
    when = futures.FIRST_COMPLETED if first else futures.ALL_COMPLETED
    while True:
        done, _ = futures.wait(fs, timeout=0.05, return_when=when)
        if (done and first) or len(done) == len(fs):
            return True
        if handle.overdue(timeout_s):
            return False


def check_peers(peers, processes, what: str, role: str) -> None:
    """Refuses a transfer before it starts when a process it talks to has no address."""
    for p in processes:
        if not peers or not peers.get(p):
            raise TransferError(f"{what}: no address for {role} process {p}; pass "
                                f"peers={{{p}: endpoint.addresses of that process}}")
        if isinstance(peers[p], str) or not all(isinstance(a, str) and ":" in a for a in peers[p]):
            raise TransferError(f"{what}: peers[{p}]={peers[p]!r}; give a tuple of 'host:port' strings, "
                                f"the endpoint.addresses of that process (e.g. ({peers[p]!r},) for one)")


def settle(future: futures.Future, result=None, error: BaseException | None = None) -> bool:
    """Sets a transfer's outcome unless it has one: a waiter that timed out may have set
    it meanwhile, and a stream thread that raised on it would die with its stream's work
    still queued. True when this call set it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        return True
    except futures.InvalidStateError:
        return False


def finished(result=None) -> futures.Future:
    """A future that is already done (a transfer with nothing left to wait for)."""
    future: futures.Future = futures.Future()
    future.set_result(result)
    return future


_idle: queue.SimpleQueue = queue.SimpleQueue()  # inboxes of daemon threads waiting for work


def run_async(fn, *args) -> futures.Future:
    """Runs fn in a daemon thread (never blocks interpreter exit on a dead peer): an idle
    one of an earlier call, or a new one; starting a thread per message cost more than
    a small message's whole transfer."""
    future: futures.Future = futures.Future()

    def body():  # settle: close() may have failed the transfer already
        try:
            settle(future, fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            settle(future, error=e)

    try:
        inbox = _idle.get_nowait()
    except queue.Empty:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_worker, args=(inbox,), daemon=True, name="hetjax-async").start()
    inbox.put(body)
    return future


def _worker(inbox: queue.SimpleQueue) -> None:
    while True:
        inbox.get()()
        _idle.put(inbox)  # one that never returns (a pull from a dead peer) is never reused


def progress_idle(handle: Handle):
    """An idle() for Handle.watch: seconds since the handle's wire_bytes last grew (a
    send's progress), as seen by the waiter's checks."""
    seen = [handle.wire_bytes, time.monotonic()]

    def idle() -> float:
        if handle.wire_bytes != seen[0]:
            seen[:] = [handle.wire_bytes, time.monotonic()]
        return time.monotonic() - seen[1]
    return idle


class Activity:
    """Seconds since the last sign of life from a peer."""

    def __init__(self):
        self.last = time.monotonic()

    def touch(self):
        self.last = time.monotonic()

    def idle(self) -> float:
        return time.monotonic() - self.last


def layouts(tree) -> list[Layout]:
    """Flat list of Layouts from a pytree of Layouts or NamedShardings."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (Layout, NamedSharding)))
    return [x if isinstance(x, Layout) else Layout.of(x) for x in leaves]


def leaf_plans(avals, src: list[Layout], dst: list[Layout], what: str) -> list[Plan]:
    if not (len(avals) == len(src) == len(dst)):
        raise TransferError(f"{what}: {len(avals)} arrays but {len(src)} source and {len(dst)} destination layouts")
    return [make_plan(a.shape, np.dtype(a.dtype).itemsize, s, d) for a, s, d in zip(avals, src, dst)]


def local_slices(region: Region, within: Region) -> tuple[slice, ...]:
    return tuple(slice(lo - base, hi - base) for (lo, hi), (base, _) in zip(region, within))


def shards_by_position(array: jax.Array) -> dict[int, jax.Array]:
    """Mesh position -> the data of `array`'s addressable shard there, in one walk."""
    position = {device: p for p, device in enumerate(array.sharding.mesh.devices.flat)}
    return {position[shard.device]: shard.data for shard in array.addressable_shards}


def shard_on(array: jax.Array, position: int, shards: dict | None = None):
    """The addressable shard of `array` at mesh position `position`; `shards`: its
    shards_by_position, when a caller looks up several."""
    shards = shards_by_position(array) if shards is None else shards
    if position not in shards:
        device = array.sharding.mesh.devices.flat[position]
        raise TransferError(f"mesh position {position} ({device}) is not addressable in this process")
    return shards[position]


def _uint(dtype):
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(dtype).itemsize]


def as_bits(x: jax.Array) -> jax.Array:
    """Moves data as unsigned integers: XLA may compute bf16 via f32, which would quiet
    signalling NaNs, and the transfer must be bit for bit."""
    return x if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, _uint(x.dtype))


def row_major(array: jax.Array) -> bool:
    """Whether the array's shards lie in memory row-major (a program may choose another
    layout for its outputs: a jax.experimental.layout.Format)."""
    layout = getattr(array.format, "layout", None)
    return layout is None or tuple(layout.major_to_minor) == tuple(range(array.ndim))


def device_piece(array: jax.Array, plan: Plan, piece, to_row_major: bool = False) -> jax.Array:
    """The piece as a single-device array on its source device (a device-side slice);
    with to_row_major, a whole shard is copied to row-major (see row_major)."""
    data = shard_on(array, piece.src)
    within = plan.src_regions[piece.src]
    if piece.region == within:
        if to_row_major:
            order = memory_layout.Layout(major_to_minor=tuple(range(data.ndim)))
            data = jax.device_put(data, memory_layout.Format(order, data.sharding))
        return data
    return jax.lax.bitcast_convert_type(as_bits(data)[local_slices(piece.region, within)], data.dtype)


def block_from_device_pieces(group, pieces: list[tuple[object, jax.Array]], dtype) -> jax.Array:
    """Puts a group's pieces (arrays on the receiver device) together on that device."""
    if len(pieces) == 1 and pieces[0][0].region == group.region:
        return pieces[0][1]
    shape = extent(group.region)
    device = next(iter(pieces[0][1].devices()))
    block = jax.device_put(jnp.zeros(shape, _uint(dtype) if dtype != jnp.bool_ else dtype), device)
    for piece, data in pieces:
        start = tuple(lo - base for (lo, _), (base, _) in zip(piece.region, group.region))
        block = jax.lax.dynamic_update_slice(block, as_bits(data), start)
    return jax.lax.bitcast_convert_type(block, dtype)


def block_from_host_pieces(group, pieces: list[tuple[object, np.ndarray]], dtype) -> np.ndarray:
    if len(pieces) == 1 and pieces[0][0].region == group.region:
        return pieces[0][1]
    block = aligned_empty(extent(group.region), dtype)
    for piece, data in pieces:
        block[local_slices(piece.region, group.region)] = data
    return block


def assemble(expect: Expect, process: int, received, handle: Handle):
    """The received pytree from (leaf index, piece, array on the piece's receiver
    device) triples; counts each piece's bytes into handle.wire_bytes."""
    by_leaf: list[dict[int, list]] = [{} for _ in expect.avals]
    for i, piece, data in received:
        by_leaf[i].setdefault(piece.group, []).append((piece, data))
        handle.wire_bytes += piece.nbytes
    out = []
    for aval, plan, dst, groups in zip(expect.avals, expect.plans, expect.dst, by_leaf):
        blocks = {gi: block_from_device_pieces(plan.groups[gi], ps, aval.dtype) for gi, ps in groups.items()}
        out.append(build(aval, plan, dst, process, blocks))
    return jax.tree.unflatten(expect.treedef, out)


def build(aval, plan: Plan, dst: Layout, process: int, blocks: dict[int, object]) -> jax.Array | Unspread:
    """The destination jax.Array from the blocks this process received (group index ->
    host or device array), copied to every replica in this process. When a replica
    group spans processes, an Unspread whose fan-out Handle.wait runs."""
    sharding = aval.sharding
    if not math.prod(aval.shape):  # a zero-size array: no piece crossed the link, nothing to fill in
        empty = np.empty(aval.shape, aval.dtype)
        return jax.make_array_from_callback(tuple(aval.shape), sharding, lambda index: empty[index])
    devices = sharding._device_assignment  # the mesh's devices, flat (a tuple jax keeps)
    group_of = plan.group_of
    if (len(blocks) == len(plan.groups) and set(dst.processes) == {process}
            and all(isinstance(b, np.ndarray) for b in blocks.values())):
        # Every block is (small) host memory and every device is ours: one call places each
        # device's block (jax's own device_put of the whole array spends 50 us more on a
        # small message, in checks whose answers the plan already holds).
        return pxla.batched_device_put(_shaped(tuple(aval.shape), np.dtype(aval.dtype)), sharding,
                                       [blocks[g] for g in group_of], list(devices))
    spans = any(len({dst.processes[m] for m in g.members}) > 1 for g in plan.groups)
    order = list(blocks)  # one device_put for all blocks (those already there stay)
    placed = jax.device_put([blocks[gi] for gi in order], [devices[plan.groups[gi].receiver] for gi in order])
    on_receiver = dict(zip(order, placed))
    shards = []
    for pos, device in enumerate(devices):
        if dst.processes[pos] != process:
            continue
        gi = group_of[pos]
        group = plan.groups[gi]
        if pos == group.receiver:
            shards.append(on_receiver[gi])
        elif not spans and gi in on_receiver:  # the copy stays inside this process
            shards.append(jax.device_put(on_receiver[gi], device))
        else:  # filled in by the collective below
            shape = extent(group.region)
            shards.append(jax.device_put(jnp.zeros(shape, aval.dtype), device))
    out = jax.make_array_from_single_device_arrays(tuple(aval.shape), sharding, shards)
    return Unspread(out) if spans else out


@functools.lru_cache(maxsize=1024)
def _shaped(shape: tuple[int, ...], dtype: np.dtype) -> jax_core.ShapedArray:
    return jax_core.ShapedArray(shape, dtype)


@dataclasses.dataclass
class Unspread:
    """A received array whose replicas in other processes still hold zeros. Its fan-out
    runs in Handle.wait, in program order, never in a transfer thread: those finish in
    the network's order, which differs between processes, and a collective that the
    processes enter in different orders deadlocks."""

    array: jax.Array


def fan_out(x: jax.Array) -> jax.Array:
    """Copies each replica group's one received block to the rest of the group with the
    destination's own collective: a psum over the replicated mesh axes of the bits
    (every member but the receiver holds zeros, so the sum is the block, bit for bit)."""
    sharding = x.sharding
    spec = PartitionSpec(*sharding.spec)
    fn = _fan_out_program(sharding.mesh, spec, np.dtype(x.dtype))
    return x if fn is None else fn(x)


@functools.lru_cache(maxsize=256)  # one program per (mesh, spec, dtype): a job receives the same every step
def _fan_out_program(mesh, spec: PartitionSpec, dtype: np.dtype):
    used = {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}
    free = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    if not free:
        return None

    def body(block):
        if dtype == np.bool_:  # no bit cast for bool: the receiver's True is the only 1 in the sum
            return jax.lax.psum(block.astype(jnp.uint8), free) != 0
        bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[dtype.itemsize]  # no x64
        u = jax.lax.bitcast_convert_type(block, bits)
        return jax.lax.bitcast_convert_type(jax.lax.psum(u, free), dtype)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


@dataclasses.dataclass
class Expect:
    """What a receive waits for: per leaf its aval, plan and destination layout."""

    avals: list
    plans: list[Plan]
    dst: list[Layout]
    treedef: object
