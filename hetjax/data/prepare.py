"""Tokenizes text or JSONL files into ArrayRecord shards, grain's random-access format.

    python -m hetjax.data.prepare --input 'corpus/*.jsonl' --output data/corpus \\
        [--format jsonl|text] [--field text] [--tokenizer byte|tokenizer.json|sp.model] \\
        [--docs_per_shard 100000] [--skip_bad]

Writes DIR/shard-00000.array_record ... (one record per document: its token ids
as little-endian int32, no BOS), DIR/lengths.npy (every document's token count, so
the packer's index needs no re-tokenization) and DIR/meta.json. Train on it with
`--config.data.source=array_record --config.data.path=DIR`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from hetjax import cli as cli_lib  # `cli` below is the console entry point
from hetjax.errors import ConfigError
from hetjax.data import sources, tokenizers

OPTIONS = {"--input": None, "--output": None, "--format": "", "--field": "text",
           "--tokenizer": "byte", "--docs_per_shard": "100000"}


def prepare(input: str, output: str, *, fmt: str = "", field: str = "text", tokenizer: str = "byte",
            docs_per_shard: int = 100_000, skip_bad: bool = False, progress: bool = True) -> dict:
    """Writes the shards, lengths.npy and meta.json; returns the metadata."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from tqdm import tqdm

    files = sources.expand(input, "--input")
    fmt = fmt or ("jsonl" if files[0].suffix in (".jsonl", ".json") else "text")
    if fmt not in sources.FORMATS:
        raise ConfigError(f"--format={fmt!r}: choose one of {sources.FORMATS}")
    tok = tokenizers.load(tokenizer)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    skipped: list = []
    lengths, shards, writer, digest = [], [], None, hashlib.sha256()
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    for fi, offset, size, text in sources.iter_documents(files, fmt, field, skip_bad, skipped):
        if writer is None or len(lengths) % docs_per_shard == 0 and lengths:
            if writer is not None:
                writer.close()
            shards.append(f"shard-{len(shards):05d}.array_record")
            writer = ArrayRecordWriter(str(out / shards[-1]), "group_size:1")
        ids = tok.encode(text).astype("<i4").tobytes()
        writer.write(ids)
        digest.update(ids)
        lengths.append(len(ids) // 4)
        bar.update(size + 1)
    bar.close()
    if writer is not None:
        writer.close()
    if not lengths:
        raise sources.DataError(f"--input={input!r}: no documents (every line blank or skipped)")
    np.save(out / "lengths.npy", np.asarray(lengths, np.int64))
    meta = {"shards": shards, "num_documents": len(lengths), "tokens": int(sum(lengths)),
            "bos_id": tok.bos_id, "vocab_size": tok.vocab_size, "tokenizer": tok.fingerprint,
            "skipped": len(skipped), "digest": digest.hexdigest()[:20], "format": fmt}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for path, line, reason in skipped[:5]:
        print(f"skipped {path}:{line}: {reason}")
    print(f"wrote {len(lengths):,} documents, {meta['tokens']:,} tokens in {len(shards)} shard(s) "
          f"to {out}" + (f"; skipped {len(skipped)} bad line(s)" if skipped else ""))
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
    try:
        per_shard = int(opts["--docs_per_shard"])
    except ValueError:
        per_shard = 0
    if per_shard <= 0:
        raise ConfigError(f"--docs_per_shard={opts['--docs_per_shard']!r}: give a positive integer")
    prepare(opts["--input"], opts["--output"], fmt=opts["--format"], field=opts["--field"],
            tokenizer=opts["--tokenizer"], docs_per_shard=per_shard, skip_bad=skip_bad,
            progress=sys.stderr.isatty())
    return 0


def cli() -> int:
    return cli_lib.run_main(lambda: main(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(cli())
