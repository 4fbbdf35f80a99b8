"""Documents out of corpus files: text and JSONL (plain, gzip, zstd, bz2 or xz), Parquet and
Hugging Face datasets saved on disk, cut into units that processes read in parallel.

A unit is a piece of one input that can be read on its own: a byte range of a plain
file (it owns the lines that start in it), a whole compressed file (a compressed
stream cannot be entered in the middle), a run of a Parquet file's row groups, or
one Arrow file of a saved dataset. Units are a function of the inputs and
`chunk_bytes` alone, so any number of processes produces the same documents in the
same order. Kinds are told apart by content (magic bytes), not by name.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import io
import json
import lzma
import zlib
from pathlib import Path

from hetjax import cli
from hetjax.data import sources
from hetjax.errors import DataError

@dataclasses.dataclass(frozen=True)
class Unit:
    path: str
    kind: str  # plain | gzip | zstd | bz2 | xz | parquet | arrow
    start: int = 0  # plain: byte range; parquet: row groups
    stop: int = -1


def expand(patterns: str, what: str = "--input") -> list[Path]:
    """Files and saved-dataset directories (their Arrow files) named by paths or globs."""
    files: list[Path] = []
    for pattern in filter(None, (p.strip() for p in patterns.split(","))):
        # (matches are not joined into a pattern again: a name with a comma was cut in two)
        for m in sources.matched(pattern, patterns, what):
            files += hf_dataset_files(Path(m), what) if Path(m).is_dir() else [Path(m)] if Path(m).is_file() else []
    if not files:
        raise DataError(f"{what}={patterns!r}: no files; give files, globs or a saved dataset directory")
    # a file named by two patterns (or a saved dataset's Arrow file named beside its
    # directory) would be prepared twice
    sources.check_files(files, patterns, what)
    return files


def hf_dataset_files(root: Path, what: str) -> list[Path]:
    """The Arrow files of a `datasets` save_to_disk directory (a DatasetDict: its train split)."""
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{what}={str(root)!r}: a DatasetDict without a 'train' split ({splits}); "
                            f"give the split's directory, e.g. {root / (splits or ['SPLIT'])[0]}")
        root = root / "train"
    state = root / "state.json"
    if not state.is_file():
        raise DataError(f"{what}={str(root)!r}: a directory, but not a dataset saved with "
                        f"datasets' save_to_disk (no state.json); give files or globs")
    names = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    return [root / n for n in names]


def kind(path: Path) -> str:
    """plain | gzip | zstd | bz2 | xz | parquet | arrow (a saved dataset's file: by name, Arrow streams have no magic)."""
    return "arrow" if path.suffix.lower() == ".arrow" else sources.kind(path)


def units(files: list[Path], field: str, chunk_bytes: int = 64 << 20, row_groups: int = 4) -> list[Unit]:
    """The inputs cut into independently readable units, in document order. DataError
    (before any process starts) unless every Parquet file and saved dataset has the
    column `field`."""
    out: list[Unit] = []
    for f in files:
        k = kind(f)
        if k == "plain":
            size = f.stat().st_size
            out += [Unit(str(f), k, a, min(a + chunk_bytes, size)) for a in range(0, size, chunk_bytes)]
        elif k == "parquet":
            pf = _parquet(f)
            _check_column(f, pf.schema_arrow.names, field, "Parquet file")
            n = pf.metadata.num_row_groups
            out += [Unit(str(f), k, a, min(a + row_groups, n)) for a in range(0, n, row_groups)]
        else:
            if k == "arrow":
                _check_column(f, _arrow(f).schema.names, field, "dataset")
            out.append(Unit(str(f), k))
    return out


def _check_column(path: Path, names: list[str], field: str, what: str) -> None:
    if field not in names:
        raise DataError(f"{path}: the {what} has no column {field!r} (--field / config.data.text_field); "
                        f"its columns are {names}")


def _arrow(path):
    ipc = cli.need("pyarrow.ipc", "parquet", f"the saved dataset file {path}")
    try:
        return ipc.open_stream(path)
    except Exception as e:
        raise DataError(f"{path}: not an Arrow stream of a saved dataset ({e})") from None


def _parquet(path):
    pq = cli.need("pyarrow.parquet", "parquet", f"the Parquet file {path}")
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None


def read(unit: Unit, fmt: str, field: str, skip_bad: bool, skipped: list, batch: int = 1024):
    """Yields lists of up to `batch` document texts from one unit; a bad record raises
    DataError naming file and line (or row), or with `skip_bad` goes to `skipped`."""
    if unit.kind in ("parquet", "arrow"):
        yield from _columnar(unit, field, skip_bad, skipped, batch)
        return
    texts: list[str] = []
    for lineno, body in _lines(unit):
        if not body.strip():
            continue
        try:
            text = sources._parse(body, fmt, field)
        except ValueError as e:
            if not skip_bad:
                raise DataError(f"{unit.path}:{lineno}: {e}; fix the line, or pass --skip_bad "
                                f"(config.data.skip_bad_records) to skip such lines") from None
            skipped.append((unit.path, lineno, str(e)))
            continue
        if text.strip():  # an empty text is no document, as a blank line is not (its EOS alone was trained on)
            texts.append(text)
        if len(texts) == batch:
            yield texts
            texts = []
    if texts:
        yield texts


def _lines(unit: Unit):
    """(line number or byte offset, line without its newline) of the unit."""
    if unit.kind == "plain":
        with open(unit.path, "rb") as f:
            pos = unit.start
            if pos:
                f.seek(pos - 1)
                if f.read(1) != b"\n":  # the line under `start` belongs to the unit before
                    pos += len(f.readline())
            lineno = 0
            while pos < unit.stop:
                line = f.readline()
                if not line:
                    break
                lineno += 1  # exact in the file's first unit; later ones name the byte
                # a BOM is dropped where the file starts, as sources.iter_documents does
                body = line[len(sources.BOM):] if pos == 0 and line.startswith(sources.BOM) else line
                yield lineno if unit.start == 0 else f"byte {pos}", body.rstrip(b"\r\n")
                pos += len(line)
        return
    broken: tuple = (OSError, EOFError, zlib.error, lzma.LZMAError)
    if unit.kind in ("gzip", "bz2", "xz"):
        stream = {"gzip": gzip, "bz2": bz2, "xz": lzma}[unit.kind].open(unit.path, "rb")
    else:
        zstd = cli.need("zstandard", "zstd", f"the zstd file {unit.path}")
        broken += (zstd.ZstdError,)
        stream = io.BufferedReader(_ZstdFrames(unit.path, zstd), 1 << 20)
    lineno = 0
    with stream:
        try:
            for lineno, line in enumerate(stream, 1):
                if lineno == 1 and line.startswith(sources.BOM):
                    line = line[len(sources.BOM):]
                yield lineno, line.rstrip(b"\r\n")
        except broken as e:
            raise DataError(f"{unit.path}: corrupt {unit.kind} data after line {lineno} ({e}); the "
                            f"file is damaged: fetch it again or leave it out of the input") from None


class _ZstdFrames(io.RawIOBase):
    """A zstd file's bytes, every frame decompressed in turn; ZstdError when the file ends
    inside a frame (zstandard's stream_reader returns what it had, silently)."""

    def __init__(self, path: str, zstd):
        self._file, self._zstd = open(path, "rb"), zstd
        self._frame, self._begun = zstd.ZstdDecompressor().decompressobj(), False
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self._at == len(self._out):
            data = self._file.read(1 << 20)
            if not data:
                if self._begun and not self._frame.eof:
                    raise self._zstd.ZstdError("the file ends inside a zstd frame")
                return 0
            out = []
            while data:
                if self._frame.eof:  # the next frame
                    self._frame = self._zstd.ZstdDecompressor().decompressobj()
                self._begun = True
                out.append(self._frame.decompress(data))
                data = self._frame.unused_data if self._frame.eof else b""
            self._out, self._at = b"".join(out), 0
        n = min(len(buf), len(self._out) - self._at)
        buf[:n] = self._out[self._at:self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _columnar(unit: Unit, field: str, skip_bad: bool, skipped: list, batch: int):
    if unit.kind == "parquet":
        pf = _parquet(unit.path)  # its column was checked by units()
        batches = pf.iter_batches(batch_size=batch, row_groups=range(unit.start, unit.stop), columns=[field])
        row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
    else:
        reader = _arrow(unit.path)
        batches, row = (b.select([field]) for b in reader), 0
    kind = {"parquet": "Parquet"}.get(unit.kind, "Arrow")
    while True:
        try:  # a damaged page or record shows only when read
            b = next(batches, None)
        except OSError as e:  # pyarrow's errors are OSErrors
            raise DataError(f"{unit.path}: corrupt {kind} data after row {row} ({e}); the file is damaged: "
                            f"fetch it again or leave it out of the input") from None
        if b is None:
            break
        values = b.column(0).to_pylist()
        texts = []
        for i, v in enumerate(values):
            if isinstance(v, str):
                if v.strip():  # as read()'s texts
                    texts.append(v)
            elif not skip_bad:
                raise DataError(f"{unit.path}: row {row + i}: column {field!r} is "
                                f"{type(v).__name__}, not a string; pass --skip_bad to skip such rows")
            else:
                skipped.append((unit.path, f"row {row + i}", f"{type(v).__name__}, not a string"))
        row += len(values)
        if texts:
            yield texts
