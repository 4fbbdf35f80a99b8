"""The resharding plan, checked against jax's own layouts and counted element by element."""

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.transfer.plan import Layout, make_plan, regions, split, volume


@st.composite
def layouts(draw, ndim, max_devices=8, names="abc"):
    """A random mesh (its own axis names), process assignment and PartitionSpec."""
    n_axes = draw(st.integers(1, 3))
    sizes = []
    for _ in range(n_axes):
        sizes.append(draw(st.sampled_from([s for s in (1, 2, 3, 4) if math.prod(sizes) * s <= max_devices])))
    axes = tuple(f"{names[i]}{i}" for i in range(n_axes))
    total = math.prod(sizes)
    nproc = draw(st.sampled_from([p for p in (1, 2, 3, 4) if total % p == 0]))
    processes = tuple(i * nproc // total for i in range(total))  # contiguous, like jax's
    free, spec = list(axes), []
    for _ in range(ndim):
        take = draw(st.lists(st.sampled_from(free), unique=True, max_size=2)) if free else []
        free = [a for a in free if a not in take]
        spec.append(None if not take else take[0] if len(take) == 1 else tuple(take))
    return Layout(tuple(sizes), axes, processes, tuple(spec))


def split_count(layout, d):
    entry = layout.spec[d] if d < len(layout.spec) else None  # trailing Nones are dropped
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    size = dict(zip(layout.axis_names, layout.mesh_shape))
    return math.prod(size[a] for a in names)


@st.composite
def cases(draw, src_devices=8, dst_devices=8):
    ndim = draw(st.integers(1, 3))
    src = draw(layouts(ndim, src_devices, names="pqr"))
    dst = draw(layouts(ndim, dst_devices, names="xyz"))
    shape = tuple(math.lcm(split_count(src, d), split_count(dst, d)) * draw(st.integers(1, 2)) for d in range(ndim))
    return shape, draw(st.sampled_from([2, 4])), src, dst


@settings(max_examples=150, deadline=None)
@given(cases())
def test_every_destination_element_arrives_once_per_replica_group(case):
    shape, itemsize, src, dst = case
    plan = make_plan(shape, itemsize, src, dst)
    src_regions, dst_regions = regions(src, shape), regions(dst, shape)
    unique_dst = {r for r in dst_regions}
    assert plan.wire_bytes == sum(volume(r) for r in unique_dst) * itemsize
    assert len(plan.groups) == len(unique_dst)
    for gi, group in enumerate(plan.groups):
        assert group.receiver in group.members
        assert all(dst_regions[m] == group.region for m in group.members)
        covered = np.zeros(shape, np.int32)
        for piece in plan.pieces:
            if piece.group != gi:
                continue
            assert piece.dst == group.receiver and piece.dst_process == dst.processes[group.receiver]
            assert piece.src_process == src.processes[piece.src]
            inside = [lo >= a and hi <= b for (lo, hi), (a, b) in zip(piece.region, src_regions[piece.src])]
            assert all(inside), "a piece must come from a shard that holds it"
            assert piece.nbytes == volume(piece.region) * itemsize
            covered[tuple(slice(lo, hi) for lo, hi in piece.region)] += 1
        expect = np.zeros(shape, np.int32)
        expect[tuple(slice(lo, hi) for lo, hi in group.region)] = 1
        np.testing.assert_array_equal(covered, expect)


@settings(max_examples=100, deadline=None)
@given(cases())
def test_replicated_source_blocks_spread_over_sender_processes(case):
    shape, itemsize, src, dst = case
    plan = make_plan(shape, itemsize, src, dst)
    load = {p: 0 for p in set(src.processes)}
    for piece in plan.pieces:
        load[piece.src_process] += piece.nbytes
    # Balance: no piece could move to another process holding it and lower the larger of
    # the two loads, so no holder of a piece ends up more than that piece above another.
    src_regions = regions(src, shape)
    for piece in plan.pieces:
        holders = {src.processes[i] for i, r in enumerate(src_regions) if r == src_regions[piece.src]}
        assert load[piece.src_process] - min(load[h] for h in holders) <= piece.nbytes
    if all(e is None for e in src.spec) and src.num_processes > 1:  # fully replicated source
        assert max(load.values()) - min(load.values()) <= max(p.nbytes for p in plan.pieces)


def test_a_block_two_processes_hold_goes_to_the_one_left_lighter():
    # Blocks 0 and 2 have one holder process each (0 and 1), block 1 has both: found by
    # hypothesis, where greedy order gave all of block 1 to process 0 (16 bytes against 8).
    src = Layout((1, 3, 2), ("p0", "q1", "r2"), (0, 0, 0, 1, 1, 1), (("p0", "q1"),))
    dst = Layout((4,), ("x0",), (0, 0, 0, 0), ("x0",))
    plan = make_plan((12,), 2, src, dst)
    assert sorted(sum(p.nbytes for p in plan.pieces if p.src_process == q) for q in (0, 1)) == [12, 12]


@settings(max_examples=60, deadline=None)
@given(cases())
def test_regions_match_jax_devices_indices_map(case):
    shape, _, src, _ = case
    devices = np.array(jax.devices()[:math.prod(src.mesh_shape)]).reshape(src.mesh_shape)
    sharding = NamedSharding(Mesh(devices, src.axis_names), P(*src.spec))
    by_device = sharding.devices_indices_map(shape)
    for device, region in zip(devices.flat, regions(src, shape)):
        want = tuple((s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(by_device[device]))
        assert region == want
    assert Layout.of(sharding) == Layout(src.mesh_shape, src.axis_names, (0,) * devices.size, src.spec)


def test_replicated_destination_receives_one_copy_from_the_least_loaded_holders():
    src = Layout((2, 2), ("a", "b"), (0, 0, 1, 1), ("b",))  # each block held by processes 0 and 1
    dst = Layout((4,), ("x",), (0, 1, 2, 3), (None,))  # fully replicated over 4 processes
    plan = make_plan((8, 4), 4, src, dst)
    assert len(plan.groups) == 1 and plan.wire_bytes == 8 * 4 * 4
    assert sorted(p.src_process for p in plan.pieces) == [0, 1]  # one block from each process


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(1, 300))
def test_split_tiles_the_region_in_contiguous_chunks(extents, limit):
    region = tuple((2, 2 + e) for e in extents)
    buf = np.arange(math.prod(extents)).reshape(extents)
    seen = []
    for sub, offset in split(region, 1, limit):
        part = buf[tuple(slice(lo - 2, hi - 2) for lo, hi in sub)].ravel()
        np.testing.assert_array_equal(part, buf.ravel()[offset:offset + part.size])  # contiguous at offset
        seen.extend(part)
        if volume(sub) > limit:  # only when one innermost row exceeds the limit
            assert all(hi - lo == 1 for lo, hi in sub[:-1])
    assert sorted(seen) == list(range(buf.size))


def test_indivisible_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot be split 4 ways"):
        make_plan((6,), 4, Layout((4,), ("a",), (0,) * 4, ("a",)), Layout((1,), ("x",), (0,), (None,)))
