"""A synthetic language whose best achievable loss is known exactly.

Documents are emitted by a seeded *unifilar* hidden Markov model (a probabilistic
finite automaton): in hidden state s it emits token x with probability e_s(x), then
moves to the state next[s, x], a function of (s, x). Each state emits `branching`
tokens with Zipf-like probabilities (its own exponent), and a token is emitted by several states that
lead to different successors, so one token does not reveal the state; the whole
document prefix does (the automaton is deterministic given the tokens).

That makes the loss floor exact. A document is BOS then n >= 1 tokens, n geometric
with mean m; its walk starts in state 0. Given the document prefix, the best
possible prediction of token t is e_{s_t}, with expected loss h(s_t) = H(e_{s_t}).
With M[s, s'] = sum_x e_s(x) [next[s, x] = s'] and q = 1 - 1/m, averaged over every
scored token of an endless stream of documents:

    floor = E[sum_{t=1..n} h(s_t)] / E[n] = (1/m) * e_0 (I - qM)^{-1} h

(rows of the packed stream score every token except a BOS, see packing.py). The
entropy rate of one endless document, pi . h (pi the stationary law of M), is also
reported. Probabilities are multiples of 1/resolution, so the sampler draws token
slots uniformly from an integer table: exact, fast, and the same on every machine
(the slots of document i are a splitmix64 counter hash of (seed, split, i), integer
arithmetic only; no floating point decides a token).

The floor assumes the model sees each token's whole document prefix. A row of the
packed stream can start in the middle of a document, and its first tokens then see
less; the expected loss there is slightly higher than the floor.
"""

from __future__ import annotations

import numpy as np

BOS = 0
SPLITS = {"train": 0, "eval": 1}
_MASK = (1 << 64) - 1
_U64 = np.uint64


def _mix(z: int) -> int:
    """splitmix64's finaliser on a Python int: a bijection of 64-bit words."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniform_slots(key: int, n: int, resolution: int) -> list[int]:
    """n independent uniform draws from range(resolution), a pure function of key:
    splitmix64 over a counter. Creating a seeded numpy Generator per document
    costs more than the whole document, hence a counter-based hash."""
    z = _U64(key) + np.arange(1, n + 1, dtype=np.uint64) * _U64(0x9E3779B97F4A7C15)  # wraps mod 2^64
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    z ^= z >> _U64(31)
    return ((z >> _U64(32)) * _U64(resolution) >> _U64(32)).tolist()  # top 32 bits scaled


RESOLUTION = 1 << 12


def emission_counts(branching: int, exponent: float, resolution: int = RESOLUTION) -> np.ndarray:
    """A state's Zipf probabilities as integer counts out of `resolution` (each at least 1,
    the most likely token taking what the others leave: below 1 when they leave none)."""
    weights = 1.0 / np.arange(1, branching + 1) ** exponent
    counts = np.maximum(1, np.floor(weights / weights.sum() * resolution)).astype(np.int64)
    counts[0] += resolution - counts.sum()
    return counts


def fits_resolution(branching: int, zipf_exponent: float, resolution: int = RESOLUTION) -> bool:
    """Whether every state's probabilities (exponents 0.5 to 2 times zipf_exponent) are
    multiples of 1/resolution with the most likely token's still positive."""
    return all(emission_counts(branching, zipf_exponent * f, resolution)[0] >= 1 for f in np.linspace(0.5, 2.0, 16))


class SyntheticLanguage:
    """The automaton, its exact floors, and its documents as random-access sources."""

    def __init__(self, vocab_size: int, *, seed: int, num_states: int = 32, branching: int = 8,
                 zipf_exponent: float = 1.0, mean_doc_length: int = 48,
                 num_documents: int = 100_000, resolution: int = RESOLUTION):
        if vocab_size - 1 < branching:
            raise ValueError(f"vocab_size={vocab_size} leaves fewer than branching={branching} tokens")
        self.vocab_size, self.seed, self.num_states = vocab_size, seed, num_states
        self.mean_doc_length, self.num_documents = mean_doc_length, num_documents
        self.resolution, self.branching, self.zipf_exponent = resolution, branching, zipf_exponent
        rng = np.random.default_rng([seed, 0x5EED])
        self.emit = np.zeros((num_states, vocab_size), np.float64)  # e_s(x)
        self.next = np.full((num_states, vocab_size), -1, np.int64)
        slots = []
        for s in range(num_states):
            # Each state its own Zipf exponent, so states differ in entropy.
            counts = emission_counts(branching, zipf_exponent * rng.uniform(0.5, 2.0), resolution)
            support = rng.choice(np.arange(1, vocab_size), size=branching, replace=False)
            self.emit[s, support] = counts / resolution
            self.next[s, support] = rng.integers(0, num_states, size=branching)
            slots.append(np.repeat(support, counts))
        self.slots = np.stack(slots)  # (states, resolution): slot -> token
        # Lists of Python ints: the per-token walk runs in pure Python, much
        # faster than numpy scalar indexing.
        self._slots = self.slots.tolist()
        self._next = self.next.tolist()

    @classmethod
    def from_config(cls, cfg) -> "SyntheticLanguage":
        d = cfg.data
        return cls(cfg.model.vocab_size, seed=d.seed, num_states=d.num_states,
                   branching=d.branching, zipf_exponent=d.zipf_exponent,
                   mean_doc_length=d.mean_doc_length, num_documents=d.num_documents)

    # -- exact quantities ---------------------------------------------------

    def state_entropies(self) -> np.ndarray:
        """h(s) = H(e_s) in nats."""
        e = self.emit
        return -np.sum(np.where(e > 0, e * np.log(np.where(e > 0, e, 1.0)), 0.0), axis=1)

    def transition_matrix(self) -> np.ndarray:
        """M[s, s'] = P(next state s' | state s)."""
        M = np.zeros((self.num_states, self.num_states))
        s, x = np.nonzero(self.next >= 0)
        np.add.at(M, (s, self.next[s, x]), self.emit[s, x])
        return M

    def floor(self) -> float:
        """The expected loss per scored token of the best predictor that sees each
        token's document prefix (exact, see the module docstring)."""
        q = 1.0 - 1.0 / self.mean_doc_length
        M = self.transition_matrix()
        start = np.zeros(self.num_states)
        start[0] = 1.0
        visits = np.linalg.solve((np.eye(self.num_states) - q * M).T, start)  # e_0 (I - qM)^-1
        return float(visits @ self.state_entropies() / self.mean_doc_length)

    def entropy_rate(self) -> float:
        """pi . h: the loss floor deep inside an endless document."""
        w, v = np.linalg.eig(self.transition_matrix().T)
        pi = np.real(v[:, np.argmin(np.abs(w - 1.0))])
        return float(pi / pi.sum() @ self.state_entropies())

    # -- documents ----------------------------------------------------------

    def lengths(self, split: str) -> np.ndarray:
        """Token count of every document of a split (BOS not counted), drawn at once."""
        rng = np.random.default_rng([self.seed, SPLITS[split], 0x1E9])
        return rng.geometric(1.0 / self.mean_doc_length, self.num_documents).astype(np.int64)

    def document(self, split: str, index: int, length: int) -> np.ndarray:
        """Tokens of document `index` (no BOS): a walk of the automaton from state 0."""
        key = _mix(_mix(_mix(self.seed & _MASK) ^ (0xD0C0 + SPLITS[split])) ^ (index & _MASK))
        out, s, slots, nxt = [], 0, self._slots, self._next
        for r in uniform_slots(key, length, self.resolution):
            x = slots[s][r]
            out.append(x)
            s = nxt[s][x]
        return np.asarray(out, np.int32)

    def source(self, split: str) -> "SyntheticSource":
        return SyntheticSource(self, split)

    def describe(self) -> str:
        return (f"synthetic(seed={self.seed}, vocab={self.vocab_size}, states={self.num_states}, "
                f"branching={self.branching}, zipf={self.zipf_exponent}, "
                f"mean_doc_length={self.mean_doc_length}, documents={self.num_documents})")


class SyntheticSource:
    """One split of the language as a random-access document source."""

    bos_id = BOS

    def __init__(self, language: SyntheticLanguage, split: str):
        self.language, self.split = language, split
        self.lengths = language.lengths(split)
        self.fingerprint = f"{language.describe()}/{split}"

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.language.document(self.split, int(index), int(self.lengths[index]))

