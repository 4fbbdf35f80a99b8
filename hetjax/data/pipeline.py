"""From the config to the global batch of every step, through grain.

The global batch of step s is global rows s*B .. s*B+B-1 of a PackedRows (see
packing.py): a function of (data seed, s, B, source) alone. Each process asks
grain only for the rows its own devices hold in the batch sharding, reads only
the documents under them, and builds the global jax.Arrays from them. The grain
pipeline is a MapDataset over step numbers, so `num_workers` worker processes
(grain's mp_prefetch) compute whole steps in parallel and deliver them in order:
any number of workers gives the same batches. Restarting at step s builds the
same pipeline from s: it costs what starting at 0 does.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import signal
from pathlib import Path

import grain
import jax
import numpy as np

from hetjax.errors import ConfigError
from hetjax import stop as stop_lib
from hetjax.data import mixture, packing, sources, synthetic, tokenizers
from hetjax.sharding import shards


def local_rows(shardings: dict, batch_size: int) -> np.ndarray:
    """The batch rows this process's devices hold (sorted, each once)."""
    assert len(set(shardings.values())) == 1, "every batch field is laid out alike"
    sharding = next(iter(shardings.values()))
    # As many columns as the length dimension has shards (sequence sharding): one column
    # would not divide over them.
    width = shards((tuple(sharding.spec) + (None, None))[1], sharding.mesh.shape)
    rows = set()
    for idx in sharding.addressable_devices_indices_map((batch_size, width)).values():
        rows.update(range(*idx[0].indices(batch_size)))
    return np.asarray(sorted(rows), np.int64)


def to_global(local: dict[str, np.ndarray], rows: np.ndarray, batch_size: int,
              shardings: dict) -> dict[str, jax.Array]:
    """Global arrays from this process's rows (`local[k][i]` is global row rows[i])."""
    where = {int(r): i for i, r in enumerate(rows)}

    def block(key, index):
        start, stop, step = index[0].indices(batch_size)
        return local[key][[where[r] for r in range(start, stop, step)]][:, index[1]]

    return {k: jax.make_array_from_callback((batch_size, local[k].shape[1]), s,
                                            lambda idx, k=k: block(k, idx))
            for k, s in shardings.items()}


def _worker_start(parent: int, worker_index: int, worker_count: int) -> None:
    """A terminal's Ctrl-C and SLURM's SIGTERM reach every process of the job: the workers
    leave them to the trainer, which saves and then closes them, instead of each dying
    (with a traceback, leaking its shared memory) while the trainer may still need
    batches. A trainer that dies without closing them takes them along."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop_lib.end_with_parent(signal.SIGKILL, parent)


@dataclasses.dataclass(frozen=True)
class StepRows:
    """grain map: step -> this process's rows of that step's global batch."""

    packed: packing.PackedRows
    batch_size: int
    rows: np.ndarray

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        return self.packed.rows(int(step) * self.batch_size + self.rows)


def check_saved_state(state: dict, fingerprint: str) -> None:
    """Refuses a saved iterator state (a checkpoint's `data` item) of other data than
    `fingerprint`'s: its step would point into another stream of batches."""
    if state.get("fingerprint") != fingerprint:
        raise ConfigError(
            f"the saved data iterator state is for data {state.get('fingerprint')!r} but this "
            f"run's data is {fingerprint!r} (config.data, seq_len or batch_size changed, or the files "
            f"did: text files with a CR inside a line read otherwise since lines end at LF only); "
            f"restore with the config and data the state was saved with, or start a new config.run_dir")


class DataIterator:
    """Global batches of steps start, start+1, ... as sharded jax.Arrays.

    `get_state()` is a small JSON-serialisable dict (the next step and a
    fingerprint of the data); `set_state()` continues exactly from it.
    `last_rows` is (global row ids, numpy rows) of the batch returned last.
    """

    def __init__(self, packed: packing.PackedRows, batch_size: int, shardings: dict, *,
                 fingerprint: str, start_step: int = 0, num_workers: int = 0, prefetch: int = 2,
                 share: tuple[int, int] | None = None):
        self.packed, self.batch_size, self.shardings = packed, batch_size, shardings
        self.fingerprint, self.num_workers, self.prefetch = fingerprint, num_workers, prefetch
        # share=(first, n): rows first..first+n-1 of each global batch (an island's share)
        self.first, self.n = share or (0, batch_size)
        self.rows = self.first + local_rows(shardings, self.n)
        self._it = None
        self.last_rows = None
        self._start(start_step)

    def _start(self, step: int) -> None:
        self.close()
        self.step = step
        ds = grain.MapDataset.range(step, 2**62).map(StepRows(self.packed, self.batch_size, self.rows))
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=self.prefetch))
        if self.num_workers:
            # grain 0.2.18's worker start reads absl flags, which a program that
            # never calls absl.app.run has not parsed: mark them parsed (defaults).
            from absl import flags
            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            it = it.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self.num_workers, per_worker_buffer_size=self.prefetch),
                worker_init_fn=functools.partial(_worker_start, os.getpid()))
        self._it = iter(it)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, jax.Array]:
        local = next(self._it)
        self.last_rows = (self.step * self.batch_size + self.rows, local)
        self.step += 1
        return to_global(local, self.rows - self.first, self.n, self.shardings)

    def get_state(self) -> dict:
        return {"step": self.step, "fingerprint": self.fingerprint}

    def set_state(self, state: dict) -> None:
        check_saved_state(state, self.fingerprint)
        if int(state["step"]) != self.step:  # an iterator already there is not built again
            self._start(int(state["step"]))

    def close(self) -> None:
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None


@dataclasses.dataclass
class Data:
    """The train and eval splits of the configured source, packed for this run."""

    train: packing.PackedRows
    eval: packing.PackedRows
    description: str
    fingerprint: str
    floor: float | None  # the best achievable loss where it is known (synthetic)
    batch_size: int
    num_workers: int

    def iterator(self, shardings: dict, start_step: int = 0, share=None) -> DataIterator:
        """share=(first, n): only rows first..first+n-1 of every global batch."""
        return DataIterator(self.train, self.batch_size, shardings, fingerprint=self.fingerprint,
                            start_step=start_step, num_workers=self.num_workers, share=share)

    def batch(self, step: int, shardings: dict, split: str = "train", share=None) -> dict[str, jax.Array]:
        """The global batch of `step` (or its rows `share`) read directly (no grain, no
        prefetch); eval batch i is the same at every evaluation."""
        first, n = share or (0, self.batch_size)
        rows = local_rows(shardings, n)
        local = getattr(self, split).rows(step * self.batch_size + first + rows)
        return to_global(local, rows, n, shardings)

    def eval_batch(self, i: int, shardings: dict, share=None) -> dict[str, jax.Array]:
        return self.batch(i, shardings, "eval", share)


def build(cfg) -> Data:
    """Opens and checks the configured source (reads indexes, no documents)."""
    d = cfg.data
    floor = None
    if d.mixture:
        return _build_mixture(cfg)
    if d.source == "synthetic":
        lang = synthetic.SyntheticLanguage.from_config(cfg)
        train, held_out = lang.source("train"), lang.source("eval")
        description, floor = lang.describe(), lang.floor()
        fingerprint = lang.describe()
    else:
        tokenizer = tokenizers.load(d.tokenizer)  # once: train and eval share it
        train, held_out, fingerprint = _open_split(cfg, tokenizer, d.source, d.path, "config.data.path")
        description = f"{d.source} {d.path} ({len(train):,} train / {len(held_out):,} eval documents)"
    bos, eos = (train.bos_id, None) if d.source == "synthetic" else _specials(train, d)
    # the key of a run without EOS is what it was before EOS existed (saved states stay valid)
    key = json.dumps([fingerprint, d.seed, d.shuffle, cfg.seq_len, cfg.batch_size]
                     + ([] if (bos, eos) == (train.bos_id, None) else [bos, eos]))
    packed = [packing.PackedRows(src, src.lengths, cfg.seq_len, seed=d.seed, bos_id=bos, eos_id=eos,
                                 shuffle=d.shuffle, split=i) for i, src in enumerate((train, held_out))]
    return Data(packed[0], packed[1], description, hashlib.sha256(key.encode()).hexdigest()[:16],
                floor, cfg.batch_size, d.num_workers)


def _specials(src, d):
    """(BOS, EOS) per config.data.bos/eos and the convention of the tokenizer that made `src`."""
    return tokenizers.specials(getattr(src, "conventions", src), d.bos, d.eos)


def _open_split(cfg, tokenizer, source: str, path: str, what: str):
    """(train, eval, fingerprint); a mixture's sources hold out config.data.eval_fraction."""
    d = cfg.data
    if d.eval_path and what == "config.data.path":
        _check_held_out(source, path, d.eval_path)
    train = _open(d, tokenizer, source, path, what)
    if d.eval_path and what == "config.data.path":
        held_out = _open(d, tokenizer, source, d.eval_path, "config.data.eval_path")
    else:
        train, held_out = _split(train, d.eval_fraction, d.seed, mixture=what != "config.data.path")
    tokenizers.check_vocab(train, cfg.model.vocab_size, f"the data of {what}={path!r}")
    return train, held_out, train.fingerprint


def _build_mixture(cfg) -> Data:
    """config.data.mixture: each named source packed on its own, rows mixed by mixture.choose."""
    d = cfg.data
    tokenizer = tokenizers.load(d.tokenizer)
    entries = mixture.parse(d.mixture)
    _check_mixture_files(entries)
    parts, keys, described = ([], []), [], []
    for name, weight, source, path in entries:
        train, held_out, fp = _open_split(cfg, tokenizer, source, path, f"config.data.mixture[{name!r}]")
        bos, eos = _specials(train, d)
        for i, src in enumerate((train, held_out)):
            parts[i].append(packing.PackedRows(src, src.lengths, cfg.seq_len, seed=d.seed, bos_id=bos,
                                               eos_id=eos, shuffle=d.shuffle, split=i))
        keys.append([name, weight, fp, bos, eos])
        described.append(f"{name} {weight:g} ({source} {path}, {len(train):,} documents)")
    weights = [e[1] for e in entries]
    key = json.dumps(["mixture", keys, d.seed, d.shuffle, cfg.seq_len, cfg.batch_size])
    train, held_out = (mixture.MixedRows(p, weights, d.seed, i) for i, p in enumerate(parts))
    return Data(train, held_out, "mixture: " + ", ".join(described),
                hashlib.sha256(key.encode()).hexdigest()[:16], None, cfg.batch_size, d.num_workers)


def _check_mixture_files(entries) -> None:
    """Refuses a file (or prepared directory) in two mixture entries: each entry holds out
    its own eval_fraction by its own document numbers, so the documents one entry holds
    out the other trains on."""
    owner: dict[str, str] = {}
    prepared: dict[tuple[int, str], tuple[str, str]] = {}  # a prepared dir's inputs: (bytes, sha256) -> (entry, dir)
    for name, _, source, path in entries:
        what = f"config.data.mixture[{name!r}]"
        files = [Path(path)] if source == "array_record" else sources.expand(path, what)
        for f in files:
            real = os.path.realpath(f)
            if owner.setdefault(real, name) != name:
                raise ConfigError(f"config.data.mixture entries {owner[real]!r} and {name!r} both hold {real}: "
                                  f"each holds out its own eval documents, so the eval documents of one would "
                                  f"be trained on by the other; give each file to one entry (narrow the "
                                  f"path of one so that it leaves the file out)")
        if source == "array_record":
            for key, file in sources.prepared_contents(path).items():
                theirs = prepared.setdefault(key, (name, path))
                if theirs[0] != name:
                    raise ConfigError(f"config.data.mixture entries {theirs[0]!r} and {name!r} both hold "
                                      f"{file}: {theirs[1]} and {path} were both prepared "
                                      f"from it, so the eval documents of one would be trained on by the "
                                      f"other; give its documents to one entry")
    # A file and a directory prepared from it, in two entries: matched by size, then by content
    # (prepare recorded each input's sha256; its path may be relative to another directory).
    sizes = {b for b, _ in prepared}
    for real, name in owner.items():
        if Path(real).is_file() and (size := Path(real).stat().st_size) in sizes:
            theirs = prepared.get((size, sources.sha256(real)))
            if theirs is not None and theirs[0] != name:
                raise ConfigError(f"config.data.mixture entries {theirs[0]!r} and {name!r} both hold {real}: "
                                  f"{theirs[1]} was prepared from it, so the eval documents of one would be "
                                  f"trained on by the other; give its documents to one entry")


def _check_held_out(source: str, path: str, eval_path: str) -> None:
    """Refuses eval files that the training files include (a glob over a folder that holds both)."""
    if source == "array_record":
        train, held = {Path(path).resolve()}, {Path(eval_path).resolve()}
        # Two directories prepared from one file (matched by content).
        inputs = sources.prepared_contents(path)
        shared = [inputs[k] for k in sources.prepared_contents(eval_path) if k in inputs]
        if shared and not train & held:
            raise ConfigError(f"config.data.eval_path={eval_path!r} and config.data.path={path!r} were both "
                              f"prepared from {', '.join(map(str, shared[:3]))}{' ...' if len(shared) > 3 else ''}: "
                              f"the eval documents would be trained on; prepare the training directory "
                              f"without the eval files")
    else:
        train = {f.resolve() for f in sources.expand(path)}
        held = {f.resolve() for f in sources.expand(eval_path, "config.data.eval_path")}
    if both := sorted(map(str, train & held)):
        raise ConfigError(f"config.data.eval_path={eval_path!r} and config.data.path={path!r} both hold "
                          f"{', '.join(both[:3])}{' ...' if len(both) > 3 else ''}: the eval documents would be "
                          f"trained on; narrow config.data.path so that it leaves them out")


def _open(d, tokenizer, source: str, path: str, what: str):
    if source == "array_record":
        src = sources.ArrayRecordSource(path, what)
        if src.tokenizer_fingerprint != tokenizer.fingerprint:
            raise ConfigError(f"{what}={path!r} was prepared with tokenizer {src.tokenizer_fingerprint} "
                              f"but config.data.tokenizer={d.tokenizer!r}; use the same tokenizer")
        return src
    return sources.TextSource(path, source, tokenizer, field=d.text_field,
                              skip_bad=d.skip_bad_records, index_dir=d.index_dir, what=what)


def _split(source, fraction: float, seed: int, mixture: bool = False):
    """(train, eval): a seeded random `fraction` of the documents (at least one) held out."""
    held = np.random.default_rng([seed, 0xE7A1]).random(len(source)) < fraction
    if not held.any():
        held[np.random.default_rng([seed, 0xE7A1]).integers(len(source))] = True
    if held.all() and len(source) == 1:  # (at least one is held out, whatever the fraction)
        raise ConfigError(f"config.data.eval_fraction={fraction}: the data{' (a mixture entry)' if mixture else ''} "
                          f"holds a single document, held out for eval whatever the fraction; split it into several"
                          + ("" if mixture else ", or give the eval documents as config.data.eval_path"))
    elif held.all():
        raise ConfigError(f"config.data.eval_fraction={fraction}: nothing is left to train on; "
                          f"lower it" + ("" if mixture else " or set config.data.eval_path"))
    ids = np.arange(len(source))
    train, ev = sources.Subset(source, ids[~held]), sources.Subset(source, ids[held])
    train.fingerprint = f"{source.fingerprint}/train{fraction}"
    return train, ev

