"""What a checkpoint save takes off the devices, in one dispatch that the loop does not wait for.

One jitted program copies the whole state to host memory (laid out as on the devices)
and hashes every leaf (hetjax.repro.digest.leaf_words, the checkpoint checksums' bits).
Dispatching it is all the training loop does: the next step may donate the state at
once, since the runtime lets a donating step overwrite a buffer only after every read
already dispatched from it (this copy, these hashes) is done. Naming the leaves,
formatting the checksums and waiting for the copy happen in the checkpoint's
background thread (hetjax.checkpoint). One program instead of a copy per leaf, waited
for, and a second program for the hashes: the loop's part of a save is one dispatch
(bench/checkpoint_cost.py; figures in the README).
"""

from __future__ import annotations

from typing import Callable

import jax

from hetjax.repro.digest import format_checksums, leaf_words

_programs: dict = {}  # (tree structure, shardings) -> the jitted copy-and-hash


def _hash_and_copy(tree):
    return tree, jax.tree.map(leaf_words, tree)


def _copy_and_hash(tree):
    # The host copies' shardings are pinned to the devices' (in host memory), so jit can
    # neither reshard the copy nor gather it into one process's memory; the hashes' are left
    # to jit (a few words a leaf).
    leaves, structure = jax.tree.flatten(tree)
    key = (structure, tuple(x.sharding for x in leaves))
    if key not in _programs:
        host = jax.tree.unflatten(structure, [s.with_memory_kind("pinned_host") for s in key[1]])
        _programs[key] = jax.jit(_hash_and_copy, out_shardings=(host, None))
    return _programs[key](tree)


def start(arrays) -> tuple[object, Callable[[], dict[str, str]]]:
    """(host copies of `arrays`, a function giving their leaf checksums): the copies and
    hashes are dispatched now, in program order; the function waits for the hashes and
    formats them on any thread, with the same values as digest.leaf_checksums(arrays)."""
    host, words = _copy_and_hash(arrays)
    return host, lambda: format_checksums(host, words)
