"""Packing documents into fixed-length rows, with random access to any row.

Epoch e lays the documents of a source end to end in the order of a seeded
permutation (`numpy` PCG64 keyed by (seed, e)), each as BOS, its tokens, then EOS
(either left out where the tokenizer's convention or config.data.bos/eos says so);
epochs follow each other into one endless stream. Global row g is the
stream's tokens [g*T, g*T + T + 1): inputs are the first T, targets the last T, so
consecutive rows share one token and every token is an input exactly once and a
target exactly once. Nothing is padded or dropped.

Finding the documents under row g takes the epoch's cumulative token counts
(computed once per epoch from the per-document lengths, vectorised) and a binary
search, so any row costs the same whatever its index: resuming at step s costs
what starting at step 0 does.

Within a row, segment ids count documents from 1 (a row that starts inside a
document gives that part segment 1) and positions count tokens from the start of
each segment. The model's attention stops at segment boundaries, and a target that
opens the next document (its BOS) is not scored: it is not predictable from the
previous document. An EOS is scored: the model learns where a document ends.
"""

from __future__ import annotations


import numpy as np

KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


class PackedRows:
    """Rows of length `seq_len` cut from the shuffled concatenation of `source`.

    `source[i]` returns document i's tokens (int32, no BOS); `lengths[i]` is its
    token count (known without reading it); `bos_id` starts every document and
    `eos_id` ends it (None: left out; at least one of them separates documents).
    """

    def __init__(self, source, lengths: np.ndarray, seq_len: int, *, seed: int, bos_id: int | None,
                 shuffle: bool = True, split: int = 0, eos_id: int | None = None):
        self.source, self.seq_len, self.seed = source, seq_len, seed
        self.bos_id, self.eos_id, self.shuffle, self.split = bos_id, eos_id, shuffle, split
        self.head = np.asarray([] if bos_id is None else [bos_id], np.int32)
        self.tail = np.asarray([] if eos_id is None else [eos_id], np.int32)
        self.extra = len(self.head) + len(self.tail)
        assert self.extra, "documents need a separator"
        self.lengths = np.asarray(lengths, np.int64)
        assert len(self.lengths) and (self.lengths >= 0).all()
        self.epoch_tokens = int(self.lengths.sum() + self.extra * len(self.lengths))
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getstate__(self):  # grain workers rebuild epoch indexes themselves
        return {**self.__dict__, "_epochs": {}}

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, end offset of each document in the epoch's stream)."""
        # Threads share it (islands in one process read their batches each in a thread of
        # its own): the entry found or made is what is returned, never read back.
        if (found := self._epochs.get(e)) is not None:
            return found
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.split, 0xE0C, e]).permutation(len(self.lengths))
        else:
            order = np.arange(len(self.lengths))
        made = (order, np.cumsum(self.lengths[order] + self.extra))
        for old in sorted(self._epochs)[:-1]:  # rows of a step touch at most two epochs
            self._epochs.pop(old, None)  # (None: another thread's eviction came first)
        self._epochs[e] = made
        return made

    def _pieces(self, start: int, stop: int):
        """(document id, first, last) token ranges (its first token at 0) covering stream [start, stop)."""
        pos = start
        while pos < stop:
            e, within = divmod(pos, self.epoch_tokens)
            order, ends = self.epoch(e)
            k = int(np.searchsorted(ends, within, side="right"))
            doc_start = int(ends[k] - self.lengths[order[k]] - self.extra)
            take = min(stop - pos, int(ends[k]) - within)
            yield int(order[k]), within - doc_start, within - doc_start + take
            pos += take

    def rows(self, row_ids) -> dict[str, np.ndarray]:
        """Global rows `row_ids` as arrays of shape (len(row_ids), seq_len)."""
        T = self.seq_len
        tokens = np.empty((len(row_ids), T + 1), np.int32)
        starts = np.zeros((len(row_ids), T + 1), bool)  # token opens a document
        docs: dict[int, np.ndarray] = {}  # neighbouring rows share documents
        for i, g in enumerate(row_ids):
            col = 0
            for doc, a, b in self._pieces(int(g) * T, int(g) * T + T + 1):
                if doc not in docs:
                    docs[doc] = np.concatenate([self.head, self.source[doc], self.tail]).astype(np.int32)
                    if len(docs[doc]) != self.lengths[doc] + self.extra:
                        raise ValueError(f"document {doc} has {len(docs[doc]) - self.extra} tokens but its "
                                         f"index says {self.lengths[doc]}: the data changed after "
                                         f"its index was built; delete the index to rebuild it")
                tokens[i, col:col + b - a] = docs[doc][a:b]
                starts[i, col] = a == 0
                col += b - a
        return rows_from_tokens(tokens, starts)


def rows_from_tokens(tokens: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
    """Model inputs from (rows, T+1) tokens and their document-start flags."""
    segments = np.cumsum(starts, axis=1) + (~starts[:, :1])  # the first segment is 1
    col = np.arange(tokens.shape[1])
    positions = col - np.maximum.accumulate(np.where(starts, col, 0), axis=1)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": positions[:, :-1].astype(np.int32),
        "segment_ids": segments[:, :-1].astype(np.int32),
        "loss_mask": (~starts[:, 1:]).astype(np.int32),
    }
