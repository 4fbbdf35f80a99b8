"""The transfer API: an Endpoint per process and link; asynchronous send and recv.

Each backend subclasses Endpoint; open_endpoint (in hetjax.transfer) picks one.

    ep = open_endpoint(LinkConfig(backend="host"))       # one per process and link
    h = ep.send(tree, tag="act/3", dst=dst_layouts, peers={0: ("10.0.0.2:4711",)})
    ...                                                  # overlap with compute
    h.wait()
    # on the other island:
    tree = ep.recv("act/3", like=abstract_tree, src=src_layouts, peers=...).wait()

`dst` / `src` are pytrees (matching the arrays) of `Layout`s or NamedShardings: each
side describes the other's sharding, so both compute the same plan. `like` holds the
destination's shapes, dtypes and shardings (ShapeDtypeStructs or arrays). `peers`
maps the other island's process index to its endpoint addresses (`ep.addresses`).
Each process sends and receives only the pieces of its addressable shards.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from hetjax.transfer import core
from hetjax.transfer.link import LinkConfig, TransferError
from hetjax.transfer.plan import Layout


class Endpoint:
    """This process's end of one link. Subclasses implement one backend."""

    addresses: tuple[str, ...] = ()
    # observer(tag, start, end): told of every copy between device and host memory that
    # this endpoint's threads make (perf_counter times); hetjax.hetero.timeline counts them.
    observer = None
    # What this process is doing (e.g. "compiling", "step 12"), told to a peer that pings
    # it (host) while it sends nothing; its owner keeps it current.
    status = "running"
    closed = False

    def __init__(self, cfg: LinkConfig, process_index: int | None = None):
        cfg.validate()
        self.cfg = cfg
        self.process = jax.process_index() if process_index is None else process_index

    def send(self, tree, tag: str, dst, peers=None) -> core.Handle:
        raise NotImplementedError

    def recv(self, tag: str, like, src, peers=None) -> core.Handle:
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True

    def check_open(self, what: str) -> None:
        """Refuses a send or receive on a closed endpoint: no peer's message would land."""
        if self.closed:
            raise TransferError(f"{what}: this endpoint is closed")

    @staticmethod
    def twin(tag: str) -> TransferError:
        """The error for a second receive of a tag in flight: it would race the first for the message."""
        return TransferError(f"recv {tag!r}: a receive with this tag is already posted; tags must be unique in flight")

    def copied(self, tag: str, start: float) -> None:
        """Reports a copy from `start` until now to the observer, if any."""
        if self.observer is not None:
            self.observer(tag, start, time.perf_counter())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- shared checks ---------------------------------------------------------------

    def prepare_send(self, tree, tag: str, dst):
        """(leaves, plans, dst layouts) with every user mistake raised up front."""
        _check_tag(tag)
        leaves = jax.tree.leaves(tree)
        for i, x in enumerate(leaves):
            if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
                raise TransferError(
                    f"send {tag!r}: leaf {i} is a {type(x).__name__} with sharding "
                    f"{getattr(x, 'sharding', None)}; send jax.Arrays with a NamedSharding")
            if x.is_deleted():  # asked whether it is ready, jax 0.10 crashes the process
                raise TransferError(
                    f"send {tag!r}: leaf {i} was deleted, or donated to a jitted call, before it was sent; "
                    f"send an array that is still alive (the sender keeps it until the send is done)")
            _check_dtype(f"send {tag!r}", i, x.dtype)
        dst_layouts = core.layouts(dst)
        src_layouts = [Layout.of(x.sharding) for x in leaves]
        plans = core.leaf_plans(leaves, src_layouts, dst_layouts, f"send {tag!r}")
        return leaves, plans, dst_layouts

    def prepare_recv(self, tag: str, like, src) -> core.Expect:
        _check_tag(tag)
        avals, treedef = jax.tree.flatten(like)
        for i, a in enumerate(avals):
            if not isinstance(getattr(a, "sharding", None), NamedSharding):
                raise TransferError(
                    f"recv {tag!r}: leaf {i} of `like` has sharding {getattr(a, 'sharding', None)}; give "
                    f"jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(...)) for every leaf")
            _check_dtype(f"recv {tag!r}", i, a.dtype)
        dst_layouts = [Layout.of(a.sharding) for a in avals]
        plans = core.leaf_plans(avals, core.layouts(src), dst_layouts, f"recv {tag!r}")
        return core.Expect(avals, plans, dst_layouts, treedef)


def _check_tag(tag) -> None:
    if not isinstance(tag, str) or not tag or len(tag.encode()) > 1024:
        raise TransferError(f"tag={tag!r}: use a non-empty string of at most 1024 bytes, e.g. 'act/step3/stage1'")


def _check_dtype(what: str, i: int, dtype) -> None:
    problem = _dtype_problem(np.dtype(dtype))
    if problem:
        raise TransferError(f"{what}: leaf {i} is {np.dtype(dtype).name}{problem}")


@functools.cache  # asked of every leaf of every message; ml_dtypes answers by raising, 10 us a leaf
def _dtype_problem(dtype: np.dtype) -> str:
    """Why arrays of `dtype` are not transferred, or ''."""
    # Transfers move bits (core.as_bits), and XLA bit-casts no complex type.
    if dtype.kind == "c":
        return ("; complex arrays are not transferred, send their real and imaginary parts (jnp.real, jnp.imag) "
                "as two arrays")
    if _bits(dtype) < 8:  # int4, uint4, float4_e2m1fn
        return (f", {_bits(dtype)} bits an element; XLA bit-casts nothing narrower than a byte, so such arrays "
                f"are not transferred: send them packed two to a byte (uint8) or as int8")
    return ""


def _bits(dtype) -> int:
    """Bits of one element (numpy stores an int4 in a whole byte)."""
    import ml_dtypes
    try:
        return ml_dtypes.iinfo(dtype).bits
    except ValueError:
        try:
            return ml_dtypes.finfo(dtype).bits
        except ValueError:
            return np.dtype(dtype).itemsize * 8


def check_leaf(tag: str, i: int, got_shape, got_dtype, aval) -> None:
    """A message whose shape or dtype differs from what the receiver expects is refused."""
    if tuple(got_shape) != tuple(aval.shape) or np.dtype(got_dtype) != np.dtype(aval.dtype):
        raise TransferError(
            f"recv {tag!r}: leaf {i} arrived as {np.dtype(got_dtype).name}{list(got_shape)} but the receiver "
            f"expects {np.dtype(aval.dtype).name}{list(aval.shape)}; both islands must agree on the tree")
