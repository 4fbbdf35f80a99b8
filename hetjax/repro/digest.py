"""All of hetjax's hashing: exact, layout-independent digests of arrays.

The bits are hashed on the devices (`leaf_words`: two 32-bit wrapping sums per leaf
or row), so only a few words per tensor or row reach the host. Two things are built
from them, under distinct names:

  checksum     `leaf_checksums` / `params_checksum`: what a checkpoint saves and
               verifies (hetjax.checkpoint); one sha256 over every leaf.
  fingerprint  the reproducibility digests below, written to fingerprints.jsonl
               and compared across runs (hetjax.repro).

Both fingerprints are sums mod 2**64 of one 64-bit value per part, so they do not depend
on the mesh, the sharding, the number of processes or the order of reduction, and
digests of disjoint parts add up to the digest of the whole:

  batch      one part per (global row, field): a hash of the row's index in the global
             batch and of the bits of that row of `inputs`, `targets`, `loss_mask`, ...
             Data-parallel islands that each hold some rows add their digests.
  params     one part per tensor in the MODEL layout, and per layer of the stacked
             `blocks` leaves (named `blocks/attn/q_DNH[3]`): a hash of the name, the
             shape, the dtype and the exact bits. Pipeline islands that each hold a
             contiguous range of layers call `param_fingerprint(their_params,
             layer_offset=first_layer)` and add the results (`a + b`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from hetjax.pipeline.stages import BLOCKS, StageLayout, from_stages

MASK = 2**64 - 1


# ---------------------------------------------------------------------------
# Leaf words and the checkpoint checksum: exact, layout-independent hashes computed
# where the arrays live.


def mix32(x):
    # murmur3's finaliser: every input bit flips about half the output bits. lax, not jnp:
    # jnp's operators check types and promote on every call, and tracing a state's hashes
    # then took 0.65 s for 55 leaves, against 0.21 (the same bits; tests/test_repro.py).
    x = lax.bitwise_xor(x, lax.shift_right_logical(x, np.uint32(16)))
    x = lax.mul(x, np.uint32(0x85EBCA6B))
    x = lax.bitwise_xor(x, lax.shift_right_logical(x, np.uint32(13)))
    x = lax.mul(x, np.uint32(0xC2B2AE35))
    return lax.bitwise_xor(x, lax.shift_right_logical(x, np.uint32(16)))


def leaf_words(x: jax.Array) -> jax.Array:
    """Two uint32 words over the bits and positions of x. Sums of uint32 wrap, so
    the result is exact whatever the sharding or reduction order."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = x.dtype.itemsize
    if width == 8:
        bits = lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2)
    else:
        bits = lax.bitcast_convert_type(x, {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[width])
        bits = lax.convert_element_type(bits, jnp.uint32)
    # The row-major position mod 2**32, from one iota per axis (partitioned as x is).
    index = lax.full(bits.shape, np.uint32(0))
    stride = 1
    for axis in reversed(range(bits.ndim)):
        index = lax.add(index, lax.mul(lax.broadcasted_iota(jnp.uint32, bits.shape, axis), np.uint32(stride % 2**32)))
        stride *= bits.shape[axis]
    twice, axes = lax.mul(index, np.uint32(2)), tuple(range(bits.ndim))
    words = [lax.reduce_sum(mix32(lax.bitwise_xor(bits, mix32(lax.add(twice, np.uint32(salt))))), axes)
             for salt in (1, 0x9E3779B9)]
    return jnp.stack(words)


@jax.jit
def _tree_hashes(tree):
    return jax.tree.map(leaf_words, tree)


def path_name(keypath) -> str:
    """'blocks/attn/q_DNH' for a key path (an nnx.Variable's `value` level left out)."""
    parts = []
    for k in keypath:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if name != "value":  # nnx.Variable's single child
            parts.append(str(name))
    return "/".join(parts)


def words_hex(words) -> str:
    """16 hex digits for one leaf's two hash words."""
    return f"{int(words[0]):08x}{int(words[1]):08x}"


def format_checksums(tree, words) -> dict[str, str]:
    """'path/to/leaf' -> 16 hex digits, from `words` (leaf_words of each leaf of `tree`,
    in the same leaf order; fetched here if still on the devices)."""
    names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return {name: words_hex(w) for name, w in zip(names, jax.device_get(jax.tree.leaves(words)), strict=True)}


def leaf_checksums(tree) -> dict[str, str]:
    """'path/to/leaf' -> 16 hex digits, for every array leaf of `tree`: what a checkpoint
    saves to verify each leaf when it is read back."""
    return format_checksums(tree, _tree_hashes(jax.tree.leaves(tree)))


def params_checksum(params, hashes: dict[str, str] | None = None) -> str:
    """The checkpoint checksum: one sha256 hex digest of the parameters' names, shapes,
    dtypes and exact bits, independent of mesh, sharding and process count (saved with
    every checkpoint as meta["params_checksum"]). `hashes`: leaf_checksums(params), when
    already computed. Not the reproducibility digest (ParamFingerprint below), which is
    a sum of parts so that islands' parts add up."""
    hashes = leaf_checksums(params) if hashes is None else hashes
    leaves = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    h = hashlib.sha256()
    for name in sorted(leaves):
        x = leaves[name]
        h.update(f"{name}|{tuple(x.shape)}|{jnp.dtype(x.dtype).name}|{hashes[name]};".encode())
    return h.hexdigest()[:32]


def json_checksum(value) -> str:
    """A checksum of a JSON item (a checkpoint's data state or config) as its canonical
    text: the same for the value saved and the value read back (tuples read as lists)."""
    import json
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=16).hexdigest()


def part_hash(*fields) -> int:
    """A 64-bit value for one part: blake2b of its fields' text."""
    text = "|".join(map(str, fields)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def hex64(value: int) -> str:
    return f"{value & MASK:016x}"


def _replicated(tree):
    """A replicated sharding on the mesh of the first NamedSharding-placed leaf (so that
    every process can read the result), or None (jit's default) for unplaced arrays."""
    for x in jax.tree.leaves(tree):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding):
            return NamedSharding(s.mesh, PartitionSpec())
    return None


# ---------------------------------------------------------------------------
# Batches


def _row_words(batch: dict) -> dict:
    # (rows, 2) uint32 per field: each row hashed on its own, so the row's global index
    # can be mixed in on the host (and parts of a batch held elsewhere add up).
    return {k: jax.vmap(leaf_words)(v) for k, v in batch.items()}


_row_words_jit = {}


def batch_words(batch: dict) -> dict:
    """Starts the device side of `batch_digest` and returns its (unfetched) result."""
    out = _replicated(batch)
    if out not in _row_words_jit:
        _row_words_jit[out] = jax.jit(_row_words, out_shardings=out)
    return _row_words_jit[out](batch)


def combine_rows(words: dict, rows=None) -> int:
    """The batch digest from fetched `batch_words`; `rows`: the global row index of each
    row (default 0, 1, ...; an int is the first row's index)."""
    words = {k: np.asarray(v) for k, v in jax.device_get(words).items()}
    n = len(next(iter(words.values())))
    rows = np.arange(n) + (rows or 0) if rows is None or np.isscalar(rows) else np.asarray(rows)
    rows, total, blake2b = rows.tolist(), 0, hashlib.blake2b
    for key in sorted(words):
        # part_hash("row", r, key, words_hex(row's words)), spelled out: a training loop
        # calls this every step, and the generic calls cost 2.5x as much.
        for r, (w0, w1) in zip(rows, words[key].tolist()):
            total += int.from_bytes(blake2b(f"row|{r}|{key}|{w0:08x}{w1:08x}".encode(), digest_size=8).digest(), "little")
    return total & MASK


def batch_digest(batch: dict, rows=None) -> int:
    """Digest of a batch (dict of (rows, length) arrays, any sharding); `rows` as in
    combine_rows. Digests of disjoint row sets add up mod 2**64 to the whole batch's."""
    return combine_rows(batch_words(batch), rows)


# ---------------------------------------------------------------------------
# Parameters


def _is_blocks(path) -> bool:
    return bool(path) and str(getattr(path[0], "key", getattr(path[0], "name", ""))) == BLOCKS


def _param_stats(params):
    """Per leaf: (hash words, sum of squares), per layer for `blocks` leaves."""
    def one(path, x):
        x = jnp.asarray(x)
        if _is_blocks(path):
            return jax.vmap(leaf_words)(x), jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1), 1)
        return leaf_words(x), jnp.sum(jnp.square(x.astype(jnp.float32)))
    return jax.tree_util.tree_map_with_path(one, params)


_stats_jit = {}


def param_stats(params, layout: StageLayout | None = None):
    """Starts the device side of `param_fingerprint` and returns (unfetched stats, the
    model-layout shapes). `layout`: the pipeline's stage layout when `params` are in its
    padded layout; they are converted with from_stages first."""
    def convert(p):
        return p if layout is None else from_stages(p, layout)

    key = (_replicated(params), layout)
    if key not in _stats_jit:
        _stats_jit[key] = jax.jit(lambda p: _param_stats(convert(p)), out_shardings=key[0])
    leaves = jax.tree_util.tree_flatten_with_path(jax.eval_shape(convert, params))[0]
    shapes = {path_name(p): (tuple(x.shape), jnp.dtype(x.dtype).name, _is_blocks(p)) for p, x in leaves}
    return _stats_jit[key](params), shapes


@dataclasses.dataclass(frozen=True)
class TensorPrint:
    hash: int  # 64-bit part of the digest
    norm: float  # L2 norm (fp32 sums: close, not exact, across layouts)


@dataclasses.dataclass(frozen=True)
class ParamFingerprint:
    """Per-tensor (per-layer for `blocks`) hashes and norms; `digest` is their sum mod 2**64."""

    tensors: dict[str, TensorPrint]

    @property
    def digest(self) -> int:
        return sum(t.hash for t in self.tensors.values()) & MASK

    @property
    def norm(self) -> float:
        return math.sqrt(sum(t.norm**2 for t in self.tensors.values()))

    def __add__(self, other: ParamFingerprint) -> ParamFingerprint:
        """Fingerprint of the union of two disjoint parts (e.g. two islands' layers)."""
        both = sorted(set(self.tensors) & set(other.tensors))
        if both:
            raise ValueError(f"fingerprints of overlapping parts cannot be added: both hold {both[:3]}")
        return ParamFingerprint({**self.tensors, **other.tensors})

    def to_json(self) -> dict:
        return {"params": hex64(self.digest), "norm": self.norm,
                "hashes": {k: hex64(t.hash) for k, t in sorted(self.tensors.items())},
                "norms": {k: t.norm for k, t in sorted(self.tensors.items())}}


def fingerprint_from_stats(stats, shapes, layer_offset: int = 0) -> ParamFingerprint:
    """Fetches `param_stats` and builds the fingerprint (layers numbered from layer_offset)."""
    stats = jax.device_get(stats)
    leaves = {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(
        stats, is_leaf=lambda x: isinstance(x, tuple))[0]}
    tensors = {}
    for name, (words, sumsq) in leaves.items():
        shape, dtype, stacked = shapes[name]
        if stacked:
            for i, (w, s) in enumerate(zip(np.asarray(words), np.asarray(sumsq))):
                part = f"{name}[{layer_offset + i}]"
                tensors[part] = _tensor(part, shape[1:], dtype, w, s)
        else:
            tensors[name] = _tensor(name, shape, dtype, np.asarray(words), sumsq)
    return ParamFingerprint(tensors)


def _tensor(name, shape, dtype, words, sumsq) -> TensorPrint:
    return TensorPrint(part_hash("tensor", name, shape, dtype, words_hex(words)),
                       math.sqrt(float(sumsq)))


def param_fingerprint(params, layer_offset: int = 0, layout: StageLayout | None = None) -> ParamFingerprint:
    """Fingerprint of `params` (an nnx.State or pytree, any sharding, model layout unless
    `layout` says it is a pipeline's padded one). A part holding layers a..b of the model
    passes layer_offset=a; parts add with `+`. Blocks until the values are on the host."""
    return fingerprint_from_stats(*param_stats(params, layout), layer_offset=layer_offset)
