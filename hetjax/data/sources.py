"""Random-access document sources: text and JSONL files, and ArrayRecord shards.

A source has `__len__`, `__getitem__(i) -> int32 tokens` (no BOS), `lengths` (the
token count of every document, known without reading the documents), `bos_id`,
`vocab_size` and a `fingerprint`.

Text and JSONL: every non-blank line is one document (JSONL: the string in
`field`). Their index (file, byte offset, byte length, token count per document)
is built once by reading and tokenizing every file, and cached in `index_dir`
keyed by each file's path, size and mtime and by the tokenizer; afterwards a
document is read with one seek. ArrayRecord shards written by
`python -m hetjax.data.prepare` carry their token counts in `lengths.npy`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from hetjax.errors import ConfigError
from hetjax.errors import DataError  # noqa: F401 - raised here, caught by callers

FORMATS = ("text", "jsonl")


def expand(patterns: str, field: str = "config.data.path") -> list[Path]:
    """Comma-separated paths or globs -> existing, non-empty files, in sorted order."""
    files: list[Path] = []
    for pattern in filter(None, (p.strip() for p in patterns.split(","))):
        files += [Path(m) for m in matched(pattern, patterns, field) if Path(m).is_file()]
    if not files:
        raise DataError(f"{field}={patterns!r}: no files; give a path or glob of text/JSONL files")
    check_files(files, patterns, field)
    return files


def matched(pattern: str, patterns: str, field: str) -> list[str]:
    """What one of `patterns` names, sorted; DataError if nothing."""
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not matches:
        what = "matches no file" if glob.has_magic(pattern) else "does not exist"
        raise DataError(f"{field}={patterns!r}: {pattern!r} {what}")
    return matches


def check_files(files: list[Path], patterns: str, field: str) -> None:
    """DataError for a file named twice, unreadable or empty."""
    check_once(files, patterns, field)
    for f in files:
        if not os.access(f, os.R_OK):
            raise DataError(f"{f}: cannot be read (permission denied)")
        if f.stat().st_size == 0:
            raise DataError(f"{f}: the file is empty")


def check_once(files: list[Path], patterns: str, field: str) -> None:
    """DataError when two names (patterns, links) resolve to one file: its documents would repeat."""
    real = [os.path.realpath(f) for f in files]
    if len(set(real)) < len(real):
        twice = sorted({str(f) for f, r in zip(files, real) if real.count(r) > 1})
        raise DataError(f"{field}={patterns!r}: {', '.join(twice[:3])} matched twice; each file is read once, "
                        f"so name it once (a mixture weighs sources: config.data.mixture)")


# A UTF-8 byte order mark that some editors write at a file's start: not text, so not
# part of the first document (JSON refuses it). Offsets still count it (they are bytes).
BOM = b"\xef\xbb\xbf"


def has_bom(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(3) == BOM


def iter_documents(files: list[Path], fmt: str, field: str, skip_bad: bool, skipped: list, empty: list | None = None):
    """Yields (file index, byte offset, byte length, text) of every document.

    A bad line raises DataError naming file and line, or with `skip_bad` is
    appended to `skipped` as (file, line, reason) and left out. A record whose text
    is empty or blank is no document (appended to `empty` as (file, line))."""
    for fi, path in enumerate(files):
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot be read ({e.strerror})") from None
        offset = len(BOM) if data.startswith(BOM) else 0
        # Lines end at LF only, as prepare reads them (readers._lines): a lone CR stays in
        # its document (bytes.splitlines cut there too, so the two paths disagreed).
        for lineno, line in enumerate(data[offset:].split(b"\n"), 1):
            start, offset = offset, offset + len(line) + 1
            body = line.rstrip(b"\r\n")
            if not body.strip():
                continue
            try:
                text = _parse(body, fmt, field)
            except ValueError as e:
                if not skip_bad:
                    raise DataError(f"{path}:{lineno}: {e}; fix the line, or set "
                                    f"config.data.skip_bad_records=true to skip such lines") from None
                skipped.append((str(path), lineno, str(e)))
                continue
            if text.strip():  # an empty text is no document, as a blank line is not (readers.read)
                yield fi, start, len(body), text
            elif empty is not None:
                empty.append((str(path), lineno))


def _parse(body: bytes, fmt: str, field: str) -> str:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"undecodable bytes {body[e.start:e.end]!r} at byte {e.start} (not UTF-8)") from None
    if fmt == "text":
        return text
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"no field {field!r} (config.data.text_field); the record has {keys}")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"field {field!r} is a {type(text).__name__}, not a string")
    try:  # JSON's \ud83d escapes decode to lone surrogates, which no tokenizer can encode
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"field {field!r} holds a lone surrogate {text[e.start]!r} at character {e.start} "
                         f"(half of an escaped UTF-16 pair: not valid Unicode)") from None
    return text


GZIP, ZSTD, PARQUET, XZ = b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"PAR1", b"\xfd7zXZ\x00"
# "BZh", a block size, then a block's magic (pi) or the stream's end (sqrt pi): "BZh" alone
# may open a line of text
BZIP2 = re.compile(rb"BZh[1-9](\x31\x41\x59\x26\x53\x59|\x17\x72\x45\x38\x50\x90)")


def kind(path: Path) -> str:
    """plain | gzip | zstd | bz2 | xz | parquet, from the file's first bytes."""
    with open(path, "rb") as f:
        head = f.read(10)
    for name, magic in (("gzip", GZIP), ("zstd", ZSTD), ("parquet", PARQUET), ("xz", XZ)):
        if head.startswith(magic):
            return name
    return "bz2" if BZIP2.match(head) else "plain"


class TextSource:
    """Documents of text (one per line) or JSONL files, tokenized on read."""

    def __init__(self, patterns: str, fmt: str, tokenizer, *, field: str = "text",
                 skip_bad: bool = False, index_dir: str = "", what: str = "config.data.path"):
        self.files = expand(patterns, what)
        for f in self.files:
            if kind(f) != "plain":
                raise DataError(f"{f}: a compressed or Parquet file is read by prepare, not at start-up: "
                                f"python -m hetjax.data.prepare --input {patterns!r} --output DIR, then "
                                f"--config.data.source=array_record --config.data.path=DIR")
        self.fmt, self.field, self.tokenizer = fmt, field, tokenizer
        self.bos_id, self.vocab_size = tokenizer.bos_id, tokenizer.vocab_size
        self.conventions = tokenizer  # its BOS/EOS (tokenizers.specials)
        # The index cache is found by where the files are and when they changed (cheap to
        # check); the data's fingerprint, which a resume compares, by what they hold: a
        # corpus copied, moved or touched resumes, one edited does not.
        options = [fmt, field, skip_bad, tokenizer.fingerprint]
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in self.files]
        key = hashlib.sha256(json.dumps([stats, *options]).encode()).hexdigest()[:20]
        cache = Path(index_dir or Path(self.files[0]).parent / ".hetjax-index") / f"{key}.npz"
        index = dict(np.load(cache)) if cache.is_file() else {}
        bom = any(has_bom(f) for f in self.files)
        # none, or cached before lines ended at LF only, or (a file with a BOM) before it was
        # dropped, or before empty texts were dropped
        if "lone_cr" not in index or bom and "bom" not in index or "empty" not in index:
            index = self._build_index(skip_bad)
            _save_atomic(cache, index)
        # Files with a lone CR split into other documents than before lines ended at LF
        # only, and a BOM left the first document: their fingerprint says so (a resume of
        # a run begun before is refused); other files' fingerprints are what they were.
        lf = ["lines end at LF"] if index["lone_cr"].any() else []
        lf += ["BOM dropped"] if bom else []
        lf += ["empty texts dropped"] if int(index["empty"]) else []
        content = hashlib.sha256(json.dumps([[str(h) for h in index["sha256"]], *options, *lf]).encode())
        self.fingerprint = f"{fmt}:{content.hexdigest()[:20]}"
        self.file_ids, self.offsets, self.sizes = index["file_id"], index["offset"], index["size"]
        self.lengths = index["tokens"]
        self.skipped = int(index["skipped"])
        if not len(self.lengths):
            raise DataError(f"{what}={patterns!r}: no documents (every line is blank"
                            f"{' or was skipped' if self.skipped else ''})")
        self._handles: dict[int, object] = {}

    def _build_index(self, skip_bad: bool) -> dict[str, np.ndarray]:
        skipped: list = []
        empty: list = []
        rows, pending = [], []

        def flush():  # tokenizers encode a batch faster than its documents one by one
            counts = [len(ids) for ids in self.tokenizer.encode_batch([p[3] for p in pending])]
            rows.extend((fi, off, size, n) for (fi, off, size, _), n in zip(pending, counts))
            pending.clear()

        for doc in iter_documents(self.files, self.fmt, self.field, skip_bad, skipped, empty):
            pending.append(doc)
            if len(pending) == 1024:
                flush()
        if pending:
            flush()
        for path, line, reason in skipped[:5]:
            print(f"skipped {path}:{line}: {reason}", flush=True)
        if skipped:
            print(f"skipped {len(skipped)} bad line(s) in total", flush=True)
        cols = np.asarray(rows, np.int64).reshape(-1, 4)
        digests, lone_cr = [], []
        for f in self.files:
            raw = f.read_bytes()
            digests.append(hashlib.sha256(raw).hexdigest())
            lone_cr.append(_LONE_CR.search(raw) is not None)
        return {"file_id": cols[:, 0], "offset": cols[:, 1], "size": cols[:, 2], "tokens": cols[:, 3],
                "skipped": np.int64(len(skipped)), "sha256": np.asarray(digests), "lone_cr": np.asarray(lone_cr),
                "bom": np.True_, "empty": np.int64(len(empty))}  # built with the BOM and empty texts dropped

    def __getstate__(self):  # open files stay in their process
        return {**self.__dict__, "_handles": {}}

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        fi = int(self.file_ids[i])
        if fi not in self._handles:
            self._handles.setdefault(fi, open(self.files[fi], "rb"))
        # pread, not seek + read: the train rows' prefetch thread and the eval reads share
        # these files, and a shared file position let one read the other's document.
        raw = os.pread(self._handles[fi].fileno(), int(self.sizes[i]), int(self.offsets[i]))
        return self.tokenizer.encode(_parse(raw, self.fmt, self.field))


# A CR that ends no line: CRs before an LF or the end of the file are stripped on every path.
_LONE_CR = re.compile(rb"\r(?!\r*(?:\n|\Z))")


def _save_atomic(path: Path, arrays: dict) -> None:
    """Writes then renames, so processes building the same index never see half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except OSError as e:
        print(f"warning: could not cache the data index at {path} ({e.strerror}); set "
              f"config.data.index_dir to a writable directory to keep it", flush=True)


def prepared_contents(directory: str) -> dict[tuple[int, str], str]:
    """The inputs a prepared directory was made from, by content as meta.json records them:
    (bytes, sha256) -> path (relative to where prepare ran, so matched by bytes); {} for a
    manifest without them (ArrayRecordSource names a bad one)."""
    try:
        return {(s["bytes"], s["sha256"]): s.get("path", "?")
                for s in json.loads((Path(directory) / "meta.json").read_text()).get("sources", [])
                if isinstance(s, dict) and {"bytes", "sha256"} <= s.keys()}
    except (OSError, ValueError, AttributeError):
        return {}


def sha256(path: str) -> str:
    """The hex sha256 of a file's bytes, read in 4 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class ArrayRecordSource:
    """Token shards written by `python -m hetjax.data.prepare` (a directory)."""

    def __init__(self, directory: str, what: str = "config.data.path"):
        import grain

        root = Path(directory)
        meta_path = root / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"{what}={directory!r}: no meta.json there; make the directory with "
                            f"python -m hetjax.data.prepare")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{meta_path}:{e.lineno}: not JSON ({e.msg})") from None
        again = "run python -m hetjax.data.prepare again"
        if missing := [k for k in ("shards", "bos_id", "vocab_size", "tokenizer", "digest") if k not in meta]:
            raise DataError(f"{meta_path}: no {', '.join(missing)} (not written by prepare, or damaged); {again}")
        shards = [root / s for s in meta["shards"]]
        for s in shards:
            if not s.is_file():
                raise DataError(f"{s}: missing shard listed in {meta_path}")
        try:
            self.lengths = np.load(root / "lengths.npy", mmap_mode="r")  # start-up reads no tokens
        except (OSError, ValueError) as e:
            raise DataError(f"{root / 'lengths.npy'}: cannot be read ({e}); {again}") from None
        self.bos_id, self.vocab_size = meta["bos_id"], meta["vocab_size"]
        # the tokenizer's BOS/EOS convention, recorded by prepare (older manifests: BOS only)
        self.eos_id, self.add_bos, self.add_eos = meta.get("eos_id"), meta.get("add_bos", True), meta.get("add_eos", False)
        self.tokenizer_fingerprint = meta["tokenizer"]
        self.fingerprint = f"array_record:{meta['digest']}"
        try:
            self._records = grain.sources.ArrayRecordDataSource([str(s) for s in shards])
        except RuntimeError as e:  # array_record names no file: find the damaged one
            for s in shards:
                try:
                    grain.sources.ArrayRecordDataSource([str(s)])
                except RuntimeError as bad:
                    raise DataError(f"{s}: damaged array_record shard ({str(bad)[:300]}); {again}") from None
            raise DataError(f"{root}: its array_record shards cannot be read ({str(e)[:300]}); {again}") from None
        if len(self._records) != len(self.lengths):
            raise DataError(f"{root}: {len(self._records)} records but lengths.npy lists "
                            f"{len(self.lengths)}; run prepare again")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.frombuffer(self._records[int(i)], "<i4").astype(np.int32)


class Subset:
    """Documents `ids` of a source, as a source (a train or eval split)."""

    def __init__(self, source, ids: np.ndarray):
        self.source, self.ids = source, ids
        self.lengths = source.lengths[ids]
        self.bos_id, self.vocab_size = source.bos_id, source.vocab_size
        self.conventions = getattr(source, "conventions", source)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.source[int(self.ids[i])]
