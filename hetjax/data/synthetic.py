"""A seeded synthetic token stream: the batch of step s depends only on (seed, s).

Documents are walks of a sparse Markov chain (every token has `branching`
equally likely successors), packed back to back into rows with segment ids and
per-document positions. The chain has learnable structure, and a known floor:
inside a document the best possible loss is log(branching) nats per token.
"""

from __future__ import annotations

import math

import jax
import numpy as np

BOS = 0


class SyntheticStream:
    def __init__(self, vocab_size: int, seq_len: int, *, seed: int, branching: int = 4,
                 mean_doc_length: int = 48):
        if vocab_size < 2:
            raise ValueError(f"config.model.vocab_size={vocab_size}: the synthetic stream needs >= 2")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.mean_doc_length = mean_doc_length
        table_rng = np.random.default_rng([seed, 0xC4A1])
        # successors[v] = the tokens that may follow v (never BOS).
        self.successors = table_rng.integers(1, vocab_size, size=(vocab_size, branching))
        self.entropy_floor = math.log(branching)

    @classmethod
    def from_config(cls, cfg) -> "SyntheticStream":
        return cls(cfg.model.vocab_size, cfg.seq_len, seed=cfg.data.seed,
                   branching=cfg.data.branching, mean_doc_length=cfg.data.mean_doc_length)

    def rows(self, step: int, start: int, stop: int, split: int = 0) -> dict[str, np.ndarray]:
        """Rows [start, stop) of the global batch of `step`; `split` tells train (0) from eval."""
        T = self.seq_len + 1  # one extra token: targets are inputs shifted by one
        n = stop - start
        rngs = [np.random.default_rng([self.seed, split, step, r]) for r in range(start, stop)]
        choice = np.stack([g.integers(0, self.successors.shape[1], T) for g in rngs])
        first = np.stack([g.integers(1, self.vocab_size, T) for g in rngs])
        new_doc = np.stack([g.random(T) < 1.0 / self.mean_doc_length for g in rngs])
        new_doc[:, 0] = True
        tokens = np.empty((n, T), np.int32)
        after_bos = np.zeros(n, bool)
        for t in range(T):
            nxt = self.successors[tokens[:, t - 1], choice[:, t]] if t else first[:, 0]
            nxt = np.where(after_bos, first[:, t], nxt)
            tokens[:, t] = np.where(new_doc[:, t], BOS, nxt)
            after_bos = new_doc[:, t]
        segments = np.cumsum(new_doc, axis=1).astype(np.int32)
        starts = np.maximum.accumulate(np.where(new_doc, np.arange(T), 0), axis=1)
        positions = (np.arange(T) - starts).astype(np.int32)
        return {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": positions[:, :-1],
            "segment_ids": segments[:, :-1],
            # A target that opens the next document is not predictable from this one.
            "loss_mask": (segments[:, 1:] == segments[:, :-1]).astype(np.int32),
        }


def global_batch(stream: SyntheticStream, step: int, batch_size: int, shardings: dict,
                 split: int = 0) -> dict[str, jax.Array]:
    """The global batch of `step` as sharded arrays. This process generates only
    the rows its own devices hold, each contiguous run of them in one call."""
    shape = (batch_size, stream.seq_len)
    assert len(set(shardings.values())) == 1, "every batch field is laid out alike"
    any_sharding = next(iter(shardings.values()))
    ranges = sorted({idx[0].indices(batch_size)[:2]
                     for idx in any_sharding.addressable_devices_indices_map(shape).values()})
    spans: list[list[int]] = []
    for start, stop in ranges:
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], stop)
        else:
            spans.append([start, stop])
    blocks = [(a, stream.rows(step, a, b, split)) for a, b in spans]

    def rows(key, index):
        start, stop, _ = index[0].indices(batch_size)
        first, block = next((a, blk) for a, blk in blocks if a <= start and stop <= a + len(blk[key]))
        return block[key][start - first:stop - first, index[1]]

    return {k: jax.make_array_from_callback(shape, s, lambda idx, k=k: rows(k, idx))
            for k, s in shardings.items()}
