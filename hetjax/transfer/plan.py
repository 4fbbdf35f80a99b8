"""The cross-mesh resharding plan: which block of which source shard goes where.

A pure function of (shape, dtype, source layout, destination layout). Layouts are
`Layout`s, plain descriptions of a NamedSharding (mesh shape, axis names, the
process of every mesh position, the PartitionSpec), so a receiver can plan for a
sender whose devices it cannot see, and both sides compute the same plan.

Destination devices that hold the same index form a replica group; each group
receives one copy over the link, on one of its devices (the group's receiver),
and the destination fans it out itself. Each copy is cut into pieces, one per
distinct source shard it overlaps; a piece comes from one holder of that shard,
picked so that the bytes sent per source process stay balanced.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Sequence

import numpy as np

Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension, global coordinates


@dataclasses.dataclass(frozen=True)
class Layout:
    """A NamedSharding described without devices: positions are mesh positions in
    row-major order; `processes[i]` is the process that owns mesh position i."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    processes: tuple[int, ...]
    spec: tuple  # one entry per array dimension: None, an axis name, or a tuple of names

    def __post_init__(self):
        # One spelling per layout: P('x'), P('x', None) and P(('x',), None) shard alike,
        # so they must compare (and be named, by the direct backend) alike.
        object.__setattr__(self, "spec", normal_spec(self.spec))
        if len(self.mesh_shape) != len(self.axis_names):
            raise ValueError(f"Layout: mesh_shape {self.mesh_shape} and axis_names {self.axis_names} differ in length")
        if len(self.processes) != math.prod(self.mesh_shape):
            raise ValueError(f"Layout: {len(self.processes)} processes for a mesh of {math.prod(self.mesh_shape)} positions")
        used = [a for entry in self.spec for a in _axes(entry)]
        for axis in used:
            if axis not in self.axis_names:
                raise ValueError(f"Layout: spec {self.spec} names {axis!r}, not a mesh axis of {self.axis_names}")
        if len(set(used)) != len(used):
            raise ValueError(f"Layout: spec {self.spec} uses a mesh axis twice")

    @classmethod
    def of(cls, sharding) -> "Layout":
        """The Layout of a live NamedSharding (processes from each device)."""
        return _layout_of(cls, sharding)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Layout":
        d = json.loads(text)
        spec = tuple(tuple(e) if isinstance(e, list) else e for e in d["spec"])
        return cls(tuple(d["mesh_shape"]), tuple(d["axis_names"]), tuple(d["processes"]), spec)

    @property
    def num_processes(self) -> int:
        return len(set(self.processes))


@functools.lru_cache(maxsize=1024)  # shardings are hashable, and every step reuses a few
def _layout_of(cls, sharding) -> Layout:
    mesh = sharding.mesh
    spec = tuple(_axes(e) if isinstance(e, (tuple, list)) else e for e in sharding.spec)
    return cls(tuple(mesh.devices.shape), tuple(mesh.axis_names),
               tuple(int(d.process_index) for d in mesh.devices.flat), spec)


def normal_spec(spec) -> tuple:
    """The spec with a one-axis entry as the axis name, no axes as None, and no
    trailing Nones."""
    out = [None if not _axes(e) else _axes(e)[0] if len(_axes(e)) == 1 else _axes(e) for e in spec]
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def regions(layout: Layout, shape: Sequence[int]) -> list[Region]:
    """The block of the array that each mesh position holds, as jax lays it out
    (jax requires every sharded dimension to divide evenly)."""
    if len(layout.spec) > len(shape):
        raise ValueError(f"spec {layout.spec} has more entries than the array has dimensions {tuple(shape)}")
    spec = tuple(layout.spec) + (None,) * (len(shape) - len(layout.spec))
    size = dict(zip(layout.axis_names, layout.mesh_shape))
    out = []
    for coords in np.ndindex(*layout.mesh_shape):
        coord = dict(zip(layout.axis_names, coords))
        region = []
        for dim, entry in zip(shape, spec):
            count, index = 1, 0
            for axis in _axes(entry):  # the first axis is the most significant
                count, index = count * size[axis], index * size[axis] + coord[axis]
            if dim % count:
                raise ValueError(
                    f"array dimension of size {dim} in shape {tuple(shape)} cannot be split "
                    f"{count} ways by spec entry {entry!r}: pick a spec whose mesh axes divide it")
            step = dim // count
            region.append((index * step, (index + 1) * step))
        out.append(tuple(region))
    return out


def intersect(a: Region, b: Region) -> Region | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def extent(region: Region) -> tuple[int, ...]:
    """The region's shape."""
    return tuple(hi - lo for lo, hi in region)


def volume(region: Region) -> int:
    return math.prod(extent(region))


@dataclasses.dataclass(frozen=True)
class Piece:
    """One hyper-rectangle that crosses the link: from a source mesh position to
    the receiver of a destination replica group."""

    region: Region
    src: int  # source mesh position that sends it
    src_process: int
    dst: int  # destination mesh position that receives it (the group's receiver)
    dst_process: int
    group: int  # index into Plan.groups
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Group:
    """Destination positions that hold the same block; `receiver` gets it over the link."""

    region: Region
    members: tuple[int, ...]
    receiver: int


@dataclasses.dataclass(frozen=True)
class Plan:
    shape: tuple[int, ...]
    itemsize: int
    groups: tuple[Group, ...]
    pieces: tuple[Piece, ...]
    src_regions: tuple[Region, ...]  # per source mesh position
    dst_regions: tuple[Region, ...]  # per destination mesh position

    @functools.cached_property  # plans are cached (make_plan): made once, read by every chunk received
    def wire_regions(self) -> tuple[list, ...]:
        """Each piece's region as a chunk header gives it (JSON lists)."""
        return tuple([list(r) for r in p.region] for p in self.pieces)

    @functools.cached_property
    def group_of(self) -> tuple[int, ...]:
        """The group of each destination mesh position."""
        of = {m: gi for gi, g in enumerate(self.groups) for m in g.members}
        return tuple(of[pos] for pos in range(len(self.dst_regions)))

    @property
    def wire_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def sent_by(self, process: int) -> list[Piece]:
        return [p for p in self.pieces if p.src_process == process]

    def received_by(self, process: int) -> list[Piece]:
        return [p for p in self.pieces if p.dst_process == process]


def make_plan(shape: Sequence[int], itemsize: int, src: Layout, dst: Layout) -> Plan:
    """For every destination replica group, the pieces of source shards it needs."""
    return _make_plan(tuple(int(s) for s in shape), int(itemsize), src, dst)


@functools.lru_cache(maxsize=4096)  # a step sends the same shapes and layouts every time
def _make_plan(shape: tuple[int, ...], itemsize: int, src: Layout, dst: Layout) -> Plan:
    src_regions, dst_regions = regions(src, shape), regions(dst, shape)
    holders: dict[Region, list[int]] = {}  # distinct source block -> positions holding it
    for pos, r in enumerate(src_regions):
        holders.setdefault(r, []).append(pos)
    members: dict[Region, list[int]] = {}
    for pos, r in enumerate(dst_regions):
        members.setdefault(r, []).append(pos)

    sent = {p: 0 for p in sorted(set(src.processes))}
    received = {p: 0 for p in sorted(set(dst.processes))}
    groups, pieces = [], []
    for region, group_members in members.items():
        nbytes = volume(region) * itemsize
        # The receiver: the group member whose process has received least so far.
        receiver = min(group_members, key=lambda m: (received[dst.processes[m]], m))
        received[dst.processes[receiver]] += nbytes
        gi = len(groups)
        groups.append(Group(region, tuple(group_members), receiver))
        for src_region, positions in holders.items():
            part = intersect(region, src_region)
            if part is None:
                continue
            part_bytes = volume(part) * itemsize
            # A replicated source block is sent by its least-loaded holder process;
            # a holder in the receiver's own process is a tie-breaker nobody needs.
            sender = min(positions, key=lambda s: (sent[src.processes[s]], s))
            sent[src.processes[sender]] += part_bytes
            pieces.append(Piece(part, sender, src.processes[sender], receiver,
                                dst.processes[receiver], gi, part_bytes))
    _rebalance(pieces, [holders[src_regions[p.src]] for p in pieces], src.processes, sent)
    return Plan(shape, itemsize, tuple(groups), tuple(pieces), tuple(src_regions), tuple(dst_regions))


def _rebalance(pieces: list[Piece], holders: list[list[int]], processes, sent: dict) -> None:
    """Moves pieces between the processes that hold them until no move would lower the
    larger of the two loads. The greedy pass above decides before it knows the blocks
    only one process holds; this fixes that. Each move lowers the sum of squared loads,
    so it ends; every process runs the same moves, so every process gets the same plan."""
    moved = True
    while moved:
        moved = False
        for i, piece in enumerate(pieces):
            best = min(holders[i], key=lambda s: (sent[processes[s]], s))
            if sent[processes[best]] + piece.nbytes < sent[piece.src_process]:
                sent[piece.src_process] -= piece.nbytes
                sent[processes[best]] += piece.nbytes
                pieces[i] = dataclasses.replace(piece, src=best, src_process=processes[best])
                moved = True


def split(region: Region, itemsize: int, limit: int) -> list[tuple[Region, int]]:
    """Cuts a region into sub-regions of at most `limit` bytes where possible, each
    contiguous in the region's row-major buffer; returns (sub-region, byte offset)."""
    extents = extent(region)
    # d: the outermost dimension along which whole rows (all later dims) fit in limit.
    d, row = len(region), itemsize
    while d > 0 and row * extents[d - 1] <= limit:
        d -= 1
        row *= extents[d]
    if d == 0:
        return [(region, 0)]
    d -= 1  # split along d in runs of `rows` rows; every index of the dims before d separately
    rows = max(1, limit // row)
    out, offset = [], 0
    for outer in np.ndindex(*extents[:d]):
        head = tuple((lo + i, lo + i + 1) for (lo, _), i in zip(region[:d], outer))
        for start in range(0, extents[d], rows):
            n = min(rows, extents[d] - start)
            lo = region[d][0] + start
            out.append((head + ((lo, lo + n),) + tuple(region[d + 1:]), offset))
            offset += n * row
    return out
