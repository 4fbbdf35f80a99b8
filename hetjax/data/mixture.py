"""config.data.mixture: named sources with weights, mixed row by row.

Global row g (of step g // B) comes from source k where k is drawn by a counter
hash of (seed, g) against the normalised cumulative weights: integer arithmetic
(splitmix64), no state, so the batch of a step is a pure function of the step
whatever the processes, grain workers or mesh. Each source keeps its own packed
stream (packing.py) and row g of a mixture is row g of the chosen source's stream:
a source with weight w contributes a random share w of its rows, never the same
row twice within one pass over its stream, and resuming at step s costs what
starting at 0 does (no count of earlier choices is needed).
"""

from __future__ import annotations

import numpy as np

from hetjax.errors import ConfigError

_U64 = np.uint64


def parse(mixture, where: str = "config.data.mixture") -> list[tuple[str, float, str, str]]:
    """Checks entries (name, weight, source, path); returns them with float weights."""
    out = []
    for entry in mixture:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 4):
            raise ConfigError(f"{where} entry {entry!r}: give (name, weight, source, path), e.g. "
                              f"('web', 0.7, 'array_record', 'data/web')")
        name, weight, source, path = entry
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight < 0:
            raise ConfigError(f"{where} entry {name!r}: weight {weight!r} must be a finite number >= 0")
        if source not in ("text", "jsonl", "array_record"):
            raise ConfigError(f"{where} entry {name!r}: source {source!r}: choose text, jsonl or array_record")
        if not path:
            raise ConfigError(f"{where} entry {name!r}: give the path of its files or prepared directory")
        out.append((str(name), float(weight), source, str(path)))
    names = [e[0] for e in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: names {names} repeat; give each source its own name")
    if out and sum(e[1] for e in out) <= 0:
        raise ConfigError(f"{where}: the weights {[e[1] for e in out]} sum to zero; give at least "
                          f"one source a positive weight")
    return out


def choose(seed: int, split: int, row_ids, weights) -> np.ndarray:
    """The source index of every global row: a splitmix64 hash of (seed, split, row)."""
    g = np.asarray(row_ids, np.int64).astype(_U64)
    key = _U64((seed * 0x9E3779B97F4A7C15 + split * 0xD1B54A32D192ED03 + 0x5EED) % 2**64)
    with np.errstate(over="ignore"):
        z = key + (g + _U64(1)) * _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        z ^= z >> _U64(31)
    u = (z >> _U64(11)).astype(np.float64) / 2.0**53  # uniform in [0, 1), exact
    edges = np.cumsum(np.asarray(weights, np.float64))
    return np.minimum(np.searchsorted(edges / edges[-1], u, side="right"), len(edges) - 1)


class MixedRows:
    """Rows of several PackedRows, each global row from the source `choose` names."""

    def __init__(self, parts: list, weights: list[float], seed: int, split: int):
        self.parts, self.weights, self.seed, self.split = parts, weights, seed, split
        self.seq_len = parts[0].seq_len
        assert all(p.seq_len == self.seq_len for p in parts)

    def rows(self, row_ids) -> dict[str, np.ndarray]:
        row_ids = np.asarray(row_ids, np.int64)
        which = choose(self.seed, self.split, row_ids, self.weights)
        out = None
        for k, part in enumerate(self.parts):
            mask = which == k
            if not mask.any():
                continue
            got = part.rows(row_ids[mask])
            if out is None:
                out = {key: np.empty((len(row_ids),) + v.shape[1:], v.dtype) for key, v in got.items()}
            for key, v in got.items():
                out[key][mask] = v
        return out
