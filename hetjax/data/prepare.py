"""Tokenizes a corpus once into ArrayRecord shards, on every core, resumably.

    python -m hetjax.data.prepare --input 'corpus/*.jsonl.zst' --output data/corpus \\
        [--format jsonl|text] [--field text] [--tokenizer byte|tokenizer.json|DIR|tokenizer.model] \\
        [--processes N] [--docs_per_shard 100000] [--skip_bad]

Inputs (comma-separated paths or globs): text (one document a line) and JSONL, plain,
gzip, zstd, bz2 or xz; Parquet files (the --field column, read by row groups); a directory
saved by `datasets`' save_to_disk. Without --format a text/JSONL file's name says which
(.jsonl or .json, any case, before .gz/.zst/.bz2/.xz: JSONL; else text), and names that disagree
are refused; a file named twice is refused too. A UTF-8 BOM opening a file is dropped.
The inputs are cut into units (hetjax/data/readers.py) that N processes (default:
every core) tokenize in batches, each unit into its own shards
DIR/shard-UUUUU-KKK.array_record (one record per document: its token ids as
little-endian int32, no BOS/EOS). A finished unit is recorded in
DIR/.progress, so a run that was interrupted continues where it stopped. Then
DIR/lengths.npy (every document's token count) and the manifest DIR/meta.json
(source files with sizes and SHA-256, the tokenizer's hash and BOS/EOS, token
counts). Train on it with `--config.data.source=array_record --config.data.path=DIR`.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.pool import ThreadPool
import os
import sys
from pathlib import Path

import numpy as np

from hetjax import cli as cli_lib  # `cli` below is the console entry point
from hetjax.data import readers, sources, tokenizers
from hetjax.errors import ConfigError, DataError

OPTIONS = {"--input": None, "--output": None, "--format": "", "--field": "text",
           "--tokenizer": "byte", "--docs_per_shard": "100000", "--processes": "0"}


def _format(path: Path) -> str:
    name = path.name.lower()
    for suffix in (".gz", ".zst", ".zstd", ".bz2", ".xz"):
        name = name.removesuffix(suffix)
    return "jsonl" if name.endswith((".jsonl", ".json")) else "text"


def _line_format(files: list[Path], input: str) -> str:
    """The format of every text/JSONL input by its name (Parquet and Arrow have columns, no
    format); ConfigError when they disagree: one prepare reads all its lines one way."""
    found: dict[str, list[str]] = {}
    for f in files:
        if readers.kind(f) not in ("parquet", "arrow"):
            found.setdefault(_format(f), []).append(str(f))
    if len(found) > 1:
        listed = "; ".join(f"{k}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}" for k, v in found.items())
        raise ConfigError(f"--input={input!r} mixes formats by file name ({listed}); give --format=text or "
                          f"--format=jsonl if every file holds that, or prepare each format into its own "
                          f"directory and train on both with config.data.mixture")
    return next(iter(found), "text")  # only Parquet/Arrow: the format is not used


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


_TOK = None


def _init_worker(tok) -> None:
    global _TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process: N processes use N
    _TOK = tok


def _prepare_unit(job) -> dict:
    """Tokenizes unit i into its shards; records it as done last (a crash redoes it)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    i, unit, out, fmt, field, skip_bad, per_shard = job
    out, skipped, lengths, shards = Path(out), [], [], []
    digest, writer = hashlib.sha256(), None
    for texts in readers.read(unit, fmt, field, skip_bad, skipped):
        for ids in _TOK.encode_batch(texts):
            if writer is None or len(lengths) % per_shard == 0 and lengths:
                if writer is not None:
                    writer.close()
                shards.append(f"shard-{i:05d}-{len(shards):03d}.array_record")
                writer = ArrayRecordWriter(str(out / shards[-1]), "group_size:1")
            raw = ids.astype("<i4").tobytes()
            writer.write(raw)
            digest.update(len(ids).to_bytes(8, "little"))  # where documents end: packing starts each anew
            digest.update(raw)
            lengths.append(len(ids))
    if writer is not None:
        writer.close()
    np.save(out / ".progress" / f"unit-{i:05d}.npy", np.asarray(lengths, np.int64))
    record = {"shards": shards, "documents": len(lengths), "tokens": int(sum(lengths)),
              "digest": digest.hexdigest(), "skipped": len(skipped), "examples": skipped[:5]}
    _write_atomic(out / ".progress" / f"unit-{i:05d}.json", json.dumps(record))
    return {"i": i, **record}


def prepare(input: str, output: str, *, fmt: str = "", field: str = "text", tokenizer: str = "byte",
            docs_per_shard: int = 100_000, skip_bad: bool = False, progress: bool = True,
            processes: int = 0, chunk_bytes: int = 64 << 20) -> dict:
    """Writes the shards, lengths.npy and meta.json; returns the manifest."""
    from tqdm import tqdm

    files = readers.expand(input, "--input")
    fmt = fmt or _line_format(files, input)
    if fmt not in sources.FORMATS:
        raise ConfigError(f"--format={fmt!r}: choose one of {sources.FORMATS}")
    tok = tokenizers.load(tokenizer)
    units = readers.units(files, field, chunk_bytes)  # checks the columns before any process starts
    out = Path(output)
    try:
        (out / ".progress").mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file there, or no permission
        raise ConfigError(f"--output={output!r}: cannot make a directory there ({e.strerror}); give a new "
                          f"directory's path") from None
    stats = [{"path": str(f), "bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]
    parts = [stats, [list(vars(u).values()) for u in units], fmt, field, tok.fingerprint, docs_per_shard, skip_bad]
    plan_file = out / ".progress" / "plan.json"
    if plan_file.is_file() and (old := json.loads(plan_file.read_text())) != parts:
        names = ("the inputs (their paths, sizes or times)", "how the inputs are cut", "--format", "--field",
                 "--tokenizer", "--docs_per_shard", "--skip_bad")
        differ = [n for n, a, b in zip(names, old, parts) if a != b]
        # Units finished without --skip_bad skipped nothing: the same with it. (The rest redo.)
        if differ != ["--skip_bad"] or not skip_bad:
            raise ConfigError(f"--output={output!r} holds a preparation that differs in {', '.join(differ)}; give a "
                              f"new directory, or delete {out} to start again")
    _write_atomic(plan_file, json.dumps(parts))
    done = {i: json.loads((out / ".progress" / f"unit-{i:05d}.json").read_text())
            for i in range(len(units)) if (out / ".progress" / f"unit-{i:05d}.json").is_file()}
    todo = [(i, u, str(out), fmt, field, skip_bad, docs_per_shard) for i, u in enumerate(units) if i not in done]
    if done:
        print(f"resuming: {len(done)} of {len(units)} units already done", flush=True)
    processes = min(processes or os.cpu_count() or 1, max(len(todo), 1))
    size = {i: (u.stop - u.start if u.kind == "plain" else Path(u.path).stat().st_size) for i, u in enumerate(units)}
    bar = tqdm(total=sum(size.values()), initial=sum(size[i] for i in done), unit="B", unit_scale=True,
               desc=f"tokenizing ({processes} processes)", disable=not progress)
    if todo:
        # spawn: no copy of a parent's threads (jax's, tokenizers'); a process that dies
        # breaks the pool with an error (multiprocessing.Pool would wait for it forever)
        with ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"), _init_worker, (tok,)) as pool:
            try:
                for future in as_completed([pool.submit(_prepare_unit, job) for job in todo]):
                    record = future.result()
                    i = record.pop("i")
                    done[i] = record
                    bar.update(size[i])
            except BrokenProcessPool as e:
                raise DataError(f"a prepare process died ({e}); run the same command again: the "
                                f"{len(done)} finished units are kept") from None
            except BaseException:  # a bad record or Ctrl-C: stop, do not finish the queue
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    bar.close()
    order = [done[i] for i in range(len(units))]
    lengths = np.concatenate([np.load(out / ".progress" / f"unit-{i:05d}.npy") for i in range(len(units))])
    if not len(lengths):
        raise DataError(f"--input={input!r}: no documents (every line blank or skipped)")
    np.save(out / "lengths.npy", lengths)
    digest = hashlib.sha256("".join(r["digest"] for r in order).encode()).hexdigest()
    tok_file = None if tokenizer == "byte" else str(tokenizers.resolve(tokenizer))
    with ThreadPool(processes) as pool:  # hashlib lets go of the GIL
        hashes = pool.map(sources.sha256, [s["path"] for s in stats])
    meta = {"shards": [s for r in order for s in r["shards"]], "num_documents": int(len(lengths)),
            "tokens": int(lengths.sum()), "bos_id": tok.bos_id, "eos_id": tok.eos_id,
            "add_bos": tok.add_bos, "add_eos": tok.add_eos, "vocab_size": tok.vocab_size,
            "tokenizer": tok.fingerprint, "tokenizer_file": tok_file,
            "tokenizer_sha256": sources.sha256(tok_file) if tok_file else None,
            "sources": [{"path": s["path"], "bytes": s["bytes"], "sha256": h} for s, h in zip(stats, hashes)],
            "units": len(units), "skipped": sum(r["skipped"] for r in order), "digest": digest[:20],
            "format": fmt, "field": field}
    _write_atomic(out / "meta.json", json.dumps(meta, indent=1) + "\n")
    for path, line, reason in [e for r in order for e in r["examples"]][:5]:
        print(f"skipped {path}:{line}: {reason}")
    print(f"wrote {meta['num_documents']:,} documents, {meta['tokens']:,} tokens in {len(meta['shards'])} "
          f"shard(s) to {out}" + (f"; skipped {meta['skipped']} bad record(s)" if meta["skipped"] else ""))
    return meta


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    opts, skip_bad, args = dict(OPTIONS), False, list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = cli_lib.alias(arg, [*OPTIONS, "--skip_bad"]).partition("=")
        arg = key + eq + value
        if arg == "--skip_bad":
            skip_bad = True
        elif key in opts:
            opts[key] = value if eq else (args.pop(0) if args else None)
        else:
            raise ConfigError(f"unknown argument {arg!r}; known: {', '.join(OPTIONS)}, --skip_bad")
    for key in ("--input", "--output"):
        if not opts[key]:
            raise ConfigError(f"{key} is required, e.g. --input 'corpus/*.jsonl' --output data/corpus")
    numbers = {}
    for key, least in (("--docs_per_shard", 1), ("--processes", 0)):
        try:
            numbers[key] = int(opts[key])
        except ValueError:
            numbers[key] = -1
        if numbers[key] < least:
            raise ConfigError(f"{key}={opts[key]!r}: give an integer >= {least}")
    prepare(opts["--input"], opts["--output"], fmt=opts["--format"], field=opts["--field"],
            tokenizer=opts["--tokenizer"], docs_per_shard=numbers["--docs_per_shard"], skip_bad=skip_bad,
            progress=sys.stderr.isatty(), processes=numbers["--processes"])
    return 0


def cli() -> int:
    return cli_lib.run_main(lambda: main(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(cli())
