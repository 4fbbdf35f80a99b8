"""The links of one island to the others: an endpoint per pair of islands, and the
exchanges every step needs (activations to a neighbour, gradients and scalars to all).

Pair (i, j), i < j, is link number `pair_index(i, j, n)`; neighbours (k, k+1) are
link k, and config.hetero.links[k] (else config.hetero.link) carries it. In
virtual mode every island of the job lives in this process and talks through the
`local` backend; otherwise each process listens on its island's addresses
(hetjax.hetero.runtime) and tags name the step, so a message never matches
another step's.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hetjax.hetero import runtime
from hetjax.hetero import timeline as timeline_lib
from hetjax.hetero.island import geometry, put
from hetjax.transfer import TransferError, TransferTimeout, local, open_endpoint
from hetjax.errors import IslandLost  # noqa: F401 - raised here, caught by callers


def pair_index(i: int, j: int, n: int) -> int:
    """Neighbours first (k, k+1) -> k, then the other pairs in order."""
    i, j = min(i, j), max(i, j)
    if j == i + 1:
        return i
    others = [p for p in itertools.combinations(range(n), 2) if p[1] != p[0] + 1]
    return n - 1 + others.index((i, j))


def link_config(cfg, i: int, j: int):
    h = cfg.hetero
    return h.links[min(i, j)] if h.links and abs(i - j) == 1 else h.link


class Links:
    """Island `k`'s endpoints to every other island, opened up front."""

    def __init__(self, cfg, k: int, settings=None, job_id: str = ""):
        self.cfg, self.k, self.n = cfg, k, len(cfg.hetero.islands)
        self.names = [i.name for i in cfg.hetero.islands]
        self.settings, self.job_id = settings, job_id
        self.endpoints, self.peers = {}, {}
        self.timeline = timeline_lib.Timeline(self.names[k], k)  # replaced by the island's own (observe)
        deadline = time.monotonic() + cfg.hetero.timeout_s  # one wait for every name to resolve

        def left():
            return max(deadline - time.monotonic(), 0.0)

        for j in range(self.n):
            if j == k:
                continue
            link = link_config(cfg, k, j)
            if settings is None:  # virtual: one process
                self.endpoints[j] = open_endpoint(link, process_index=0)
                continue
            number = pair_index(k, j, self.n)
            host, port = runtime.split_address(runtime.listen_address(settings, number, left()))
            self.endpoints[j] = open_endpoint(dataclasses.replace(link, bind_address=host, port=port))
            spec = cfg.hetero.islands[j]
            self.peers[j] = {p: (runtime.resolve(runtime.link_address(settings, self.names[j], p, number), left(),
                                                 f"island {self.names[j]} rank {p}'s transfer address"),)
                             for p in range(spec.num_processes)}

    def observe(self, timeline: timeline_lib.Timeline) -> None:
        """Counts this island's waits, messages and copies into `timeline`."""
        self.timeline = timeline
        for ep in self.endpoints.values():
            ep.observer = lambda tag, start, end: timeline.add("host_copy", f"copy {tag}", start, end, "copies")

    def status(self, text: str) -> None:
        """What this island is doing, told to a peer that pings it while waiting on us
        (LinkConfig.busy_timeout_s): a peer busy compiling is not a lost one."""
        for ep in self.endpoints.values():
            ep.status = f"island {self.names[self.k]}: {text}"

    def tag(self, src: int, dst: int, what: str) -> str:
        return f"{self.job_id}{self.names[src]}>{self.names[dst]}/{what}"

    def send(self, j: int, tree, what: str, dst_layouts):
        """Starts sending tree to island j (a Handle); dst_layouts: j's layouts of it."""
        handle = self.endpoints[j].send(tree, self.tag(self.k, j, what), dst_layouts, self.peers.get(j))
        self.timeline.message(f"send {what}", handle)
        return handle

    def recv(self, j: int, what: str, like, src_layouts):
        """Starts receiving from island j (a Handle): `like` has our shardings."""
        handle = self.endpoints[j].recv(self.tag(j, self.k, what), like, src_layouts, self.peers.get(j))
        self.timeline.message(f"recv {what}", handle)
        return handle

    def wait(self, handle, j: int, sent: bool = False):
        """handle.wait(), timed into the timeline (wait_sends for a send; for a receive,
        wait_peer until its first byte, then wait_bytes), with a lost peer named by
        island (and rank when known)."""
        self.timeline.settle()
        t = time.perf_counter()
        try:
            return handle.wait()
        except TransferTimeout as e:
            spec = self.cfg.hetero.islands[j]
            # With several processes, the transfer's own message names the one that fell silent.
            ranks = f"one of ranks 0..{spec.num_processes - 1}" if spec.num_processes > 1 else "rank 0"
            raise IslandLost(f"island {self.names[j]} ({ranks}) stopped answering island "
                             f"{self.names[self.k]}: {e}") from e
        except TransferError as e:
            src, dst = (self.k, j) if sent else (j, self.k)
            raise TransferError(f"link from island {self.names[src]} to island {self.names[dst]}: {e}") from e
        finally:
            self.timeline.waited(handle, t, sent)

    def all_to_all(self, tree, what: str, src_layouts_of, dst_layouts_of, like, among=None) -> list:
        """Every island's `tree`, in island order (ours included as given): we send ours to
        every other island (of `among`, default all) and receive theirs.
        *_layouts_of(j): island j's layouts of it."""
        return self.start_all_to_all(tree, what, src_layouts_of, dst_layouts_of, like, among)()

    def start_all_to_all(self, tree, what: str, src_layouts_of, dst_layouts_of, like, among=None):
        """all_to_all's sends and receives, started now; returns the wait for its result."""
        among = range(self.n) if among is None else among
        others = [j for j in among if j != self.k]
        sends = [(j, self.send(j, tree, what, dst_layouts_of(j))) for j in others]
        recvs = {j: self.recv(j, what, like, src_layouts_of(j)) for j in others}

        def finish() -> list:
            try:
                out = [tree if j == self.k else self.wait(recvs[j], j) for j in among]
            except IslandLost:
                self.raise_failed_sends(sends)
                raise
            for j, h in sends:
                self.wait(h, j, sent=True)
            return out
        return finish

    def raise_failed_sends(self, sends) -> None:
        """A receive that timed out may be our own send's fault: say so first (named as
        wait() names it: a lost peer as IslandLost)."""
        for j, h in sends:
            if h.done() and h.future.exception() is not None:
                self.wait(h, j, sent=True)

    def gather(self, values, what: str, mesh) -> np.ndarray:
        """(islands, *values.shape) on the host: every island's small array `values`
        (replicated on each island), bits unchanged, in island order."""
        return self.start_gather(values, what, mesh)()

    def start_gather(self, values, what: str, mesh):
        """gather, started now; returns the wait for its table. Read it a step later when
        nothing needs it sooner: a peer's message that is pulled (`direct`) while the peer
        runs its next step is copied off its devices only after that step on XLA:CPU, so a
        gather read at once between steps could wait a whole step for it."""
        replicated = NamedSharding(mesh, PartitionSpec())
        if isinstance(values, jax.Array) and values.committed:  # already a global array of the island
            mine = jax.device_put(values, replicated)
        else:  # host values: every process of the island holds them (the same everywhere)
            mine = put(values, mesh)

        def layout(j):
            return geometry(self.cfg, j).layout(PartitionSpec())

        like = jax.ShapeDtypeStruct(mine.shape, mine.dtype, sharding=replicated)
        finish = self.start_all_to_all(mine, what, layout, layout, like)
        return lambda: np.stack([np.asarray(jax.device_get(x)) for x in finish()])

    def totals(self, values, what: str, mesh) -> tuple[np.ndarray, np.ndarray]:
        """(every island's float32 `values` added in island order, the same on every island;
        the (islands, ...) table they were added from)."""
        table = self.gather(jnp.asarray(values, jnp.float32), what, mesh).astype(np.float64)
        return table.sum(0), table

    def close(self) -> None:
        for ep in self.endpoints.values():
            ep.close()
        if self.settings is None:  # virtual: drop what was sent to us and never received
            local.drop(f"{self.job_id}", f">{self.names[self.k]}/")
