"""Tokens/s of `python -m hetjax.data.prepare` on 2 processes against the tokenizer's own
`encode_batch` on one process (one core), over the same text, in one run.

    python -m bench.prepare_throughput [--documents=N] [--processes=P]

The corpus (N JSONL documents of English-like words, gzip) and a byte-level BPE
tokenizer (vocabulary 8000, trained with `tokenizers`) are made in a temporary
directory. The baseline parses the same JSONL and calls encode_batch in batches of
1024 with TOKENIZERS_PARALLELISM=false: one core, tokenization only, nothing
written. prepare reads, tokenizes, writes ArrayRecord shards and a manifest with
SHA-256 hashes, start-up of its processes included. The last line is the ratio
(target >= 1.6 on a 2-core machine).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers starts its thread pool


def corpus(path: Path, documents: int) -> None:
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("etaoinshrdlucmfwypvbgkjqxz"), rng.integers(2, 9))) for _ in range(3000)]
    zipf = 1.0 / np.arange(1, len(words) + 1)
    picks = rng.choice(len(words), size=documents * 120, p=zipf / zipf.sum())
    lines = (json.dumps({"text": " ".join(words[i] for i in picks[d * 120:(d + 1) * 120])}) + "\n"
             for d in range(documents))
    path.write_bytes(gzip.compress("".join(lines).encode(), compresslevel=1))


def main(argv: list[str]) -> int:
    opts = {"--documents": 40_000, "--processes": 2}
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in opts:
            raise SystemExit(f"unknown argument {arg!r}; known: {', '.join(opts)} (as --key=value)")
        opts[key] = int(value)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hetjax.data import prepare, tokenizers

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus(root / "c.jsonl.gz", opts["--documents"])
        texts = [json.loads(l)["text"] for l in gzip.decompress((root / "c.jsonl.gz").read_bytes()).splitlines()]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
        tok.train_from_iterator(texts[:2000], trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"]))
        tok.save(str(root / "tokenizer.json"))
        # Several files, so that 2 processes have units to share (one gzip stream is one unit).
        for k in range(8):
            (root / f"part-{k}.jsonl.gz").write_bytes(gzip.compress("".join(
                json.dumps({"text": t}) + "\n" for t in texts[k::8]).encode(), compresslevel=1))
        hf = tokenizers.load(str(root / "tokenizer.json"))
        t = time.perf_counter()
        tokens = 0
        for a in range(0, len(texts), 1024):
            tokens += sum(len(x) for x in hf.encode_batch(texts[a:a + 1024]))
        base = tokens / (time.perf_counter() - t)
        print(f"{len(texts):,} documents, {tokens:,} tokens; os.cpu_count()={os.cpu_count()}", flush=True)
        print(f"encode_batch, 1 process        {base:12,.0f} tokens/s", flush=True)
        t = time.perf_counter()
        meta = prepare.prepare(str(root / "part-*.jsonl.gz"), str(root / "out"), tokenizer=str(root / "tokenizer.json"),
                               progress=False, processes=opts["--processes"])
        rate = meta["tokens"] / (time.perf_counter() - t)
        assert meta["tokens"] == tokens, (meta["tokens"], tokens)
        print(f"prepare, {opts['--processes']} processes        {rate:12,.0f} tokens/s", flush=True)
    print(f"tokens/s ratio prepare ({opts['--processes']} processes) / encode_batch (1 process): {rate / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
