"""Text, JSONL and ArrayRecord sources, the tokenizers, and every bad input's message."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetjax import data, train
from hetjax.config import Config, ConfigError, DataConfig, ModelConfig
from hetjax.data import prepare, sources, tokenizers

ROOT = Path(__file__).resolve().parent.parent
TEXT = ["the quick brown fox jumps over the lazy dog", "héllo wörld, ünïcode text",
        "packing documents into rows", "a fourth line of text for the corpus"] * 5


def cfg_for(path, source, **kw):
    return Config(model=ModelConfig(vocab_size=kw.pop("vocab", 320)), batch_size=4, seq_len=16,
                  data=DataConfig(source=source, path=str(path), **kw))


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def all_documents(packed):
    """Every document of one epoch, read back from the packed rows (split at BOS)."""
    n = packed.epoch_tokens // packed.seq_len + 1
    stream = packed.rows(np.arange(n))["inputs"].reshape(-1)[:packed.epoch_tokens]
    starts = np.flatnonzero(stream == packed.bos_id)
    return [stream[a + 1:b] for a, b in zip(starts, list(starts[1:]) + [len(stream)])]


def test_text_jsonl_and_prepared_array_record_give_the_same_documents(tmp_path):
    byte = tokenizers.ByteTokenizer()
    expected = sorted(bytes(byte.encode(t).astype(np.uint8)) for t in TEXT)
    (tmp_path / "a.txt").write_text("\n".join(TEXT[:10]) + "\n\n")
    (tmp_path / "b.txt").write_text("\n".join(TEXT[10:]))
    write_jsonl(tmp_path / "c.jsonl", TEXT)
    prepare.prepare(str(tmp_path / "c.jsonl"), str(tmp_path / "ar"), docs_per_shard=7, progress=False)
    assert len(list((tmp_path / "ar").glob("*.array_record"))) == 3
    for source, path in (("text", tmp_path / "*.txt"), ("jsonl", tmp_path / "c.jsonl"),
                         ("array_record", tmp_path / "ar")):
        cfg = cfg_for(path, source, eval_fraction=0.2, seed=1)
        d = data.build(cfg)
        docs = all_documents(d.train) + all_documents(d.eval)
        got = sorted(bytes(doc.astype(np.uint8)) for doc in docs)
        assert got == expected, source
        assert len(d.eval.lengths) >= 1 and len(d.train.lengths) + len(d.eval.lengths) == len(TEXT)


def test_a_lone_carriage_return_stays_in_its_document_on_both_paths(tmp_path):
    """Lines end at LF (a CR before it is dropped): the text source cut at a lone CR too,
    so it read other documents from the same file than prepare does."""
    (tmp_path / "c.txt").write_bytes(b"first line\rstill the first\r\nsecond line\n\rthird\n" * 3)
    byte = tokenizers.ByteTokenizer()
    text = sources.TextSource(str(tmp_path / "c.txt"), "text", byte, index_dir=str(tmp_path / "ix"))
    prepare.prepare(str(tmp_path / "c.txt"), str(tmp_path / "ar"), progress=False, processes=1)
    prepared = sources.ArrayRecordSource(str(tmp_path / "ar"))
    docs = lambda src: [bytes(src[i].astype(np.uint8)) for i in range(len(src))]  # noqa: E731
    assert docs(text) == docs(prepared) == [b"first line\rstill the first", b"second line", b"\rthird"] * 3


def test_the_text_index_is_cached_and_rebuilt_when_the_file_changes(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", TEXT)
    src = sources.TextSource(str(f), "jsonl", tokenizers.ByteTokenizer(), index_dir=str(tmp_path / "ix"))
    assert len(list((tmp_path / "ix").glob("*.npz"))) == 1
    again = sources.TextSource(str(f), "jsonl", tokenizers.ByteTokenizer(), index_dir=str(tmp_path / "ix"))
    assert again.fingerprint == src.fingerprint
    # Touched, or moved elsewhere: a new index, but the same data, so a resume goes on.
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    moved = tmp_path / "elsewhere" / "corpus.jsonl"
    moved.parent.mkdir()
    f.rename(moved)
    again = sources.TextSource(str(moved), "jsonl", tokenizers.ByteTokenizer(), index_dir=str(tmp_path / "ix"))
    assert len(list((tmp_path / "ix").glob("*.npz"))) == 2 and again.fingerprint == src.fingerprint
    write_jsonl(moved, TEXT[:3])
    changed = sources.TextSource(str(moved), "jsonl", tokenizers.ByteTokenizer(), index_dir=str(tmp_path / "ix"))
    assert len(changed) == 3 and changed.fingerprint != src.fingerprint


def test_hf_and_sentencepiece_tokenizers_made_here(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXT * 4))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<bos>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    import sentencepiece
    sentencepiece.SentencePieceTrainer.Train(input=str(corpus), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=40, bos_id=1, eos_id=2, unk_id=0,
                                             minloglevel=2)
    write_jsonl(tmp_path / "c.jsonl", TEXT)
    for spec in (tmp_path / "tokenizer.json", tmp_path / "sp.model"):
        t = tokenizers.load(str(spec))
        assert t.decode(t.encode(TEXT[0])).strip() == TEXT[0]
        d = data.build(cfg_for(tmp_path / "c.jsonl", "jsonl", tokenizer=str(spec),
                               index_dir=str(tmp_path / "ix")))
        docs = all_documents(d.train) + all_documents(d.eval)
        assert sorted(t.decode(doc).strip() for doc in docs) == sorted(TEXT)
        # Too small a model vocabulary is refused, naming both sizes.
        with pytest.raises(ConfigError, match=f"has {t.vocab_size} token ids but config.model.vocab_size=16"):
            data.build(cfg_for(tmp_path / "c.jsonl", "jsonl", tokenizer=str(spec), vocab=16,
                               index_dir=str(tmp_path / "ix")))


BAD = {
    "non_json": (b'{"text": "ok"}\n{"text": broken\n', "jsonl", r"bad\.jsonl:2: not JSON"),
    "no_field": (b'{"text": "ok"}\n{"body": "x"}\n', "jsonl", r"bad\.jsonl:2: no field 'text'"),
    "undecodable": (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "jsonl", r"bad\.jsonl:2: undecodable bytes"),
    "undecodable_text": (b"fine line\nsecond \xc3\x28 line\n", "text", r"bad\.jsonl:2: undecodable bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_lines_name_the_file_and_line_or_are_counted_and_skipped(tmp_path, case, capsys):
    content, fmt, message = BAD[case]
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content + b'{"text": "another good one"}\n' if fmt == "jsonl" else content + b"ok\n")
    with pytest.raises(ConfigError, match=message):
        data.build(cfg_for(f, fmt))
    d = data.build(cfg_for(f, fmt, skip_bad_records=True, index_dir=str(tmp_path / "ix")))
    assert d.train.source.source.skipped == 1
    assert "skipped 1 bad line" in capsys.readouterr().out


def test_missing_empty_unreadable_files_and_empty_globs(tmp_path):
    with pytest.raises(ConfigError, match=r"nothing\.jsonl' does not exist"):
        data.build(cfg_for(tmp_path / "nothing.jsonl", "jsonl"))
    with pytest.raises(ConfigError, match=r"\*\.txt' matches no file"):
        data.build(cfg_for(tmp_path / "*.txt", "text"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"empty\.jsonl: the file is empty"):
        data.build(cfg_for(tmp_path / "empty.jsonl", "jsonl"))
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(ConfigError, match=r"no documents"):
        data.build(cfg_for(tmp_path / "blank.txt", "text", index_dir=str(tmp_path / "ix")))
    locked = write_jsonl(tmp_path / "locked.jsonl", TEXT)
    locked.chmod(0)
    try:
        if not os.access(locked, os.R_OK):  # root reads anything
            with pytest.raises(ConfigError, match=r"locked\.jsonl: cannot be read"):
                data.build(cfg_for(locked, "jsonl"))
    finally:
        locked.chmod(0o644)
    with pytest.raises(ConfigError, match="no meta.json"):
        data.build(cfg_for(tmp_path, "array_record"))
    with pytest.raises(ConfigError, match="needs config.data.path"):
        from hetjax.config import validate
        validate(Config(data=DataConfig(source="jsonl")))


def test_the_train_program_exits_2_with_the_message(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "x"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "hetjax.train", "--config", "tiny", "--config.data.source=jsonl",
         f"--config.data.path={tmp_path / 'bad.jsonl'}", "--config.model.vocab_size=320",
         f"--config.run_dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "bad.jsonl:2: no field 'text'" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_prepare_command_line(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", TEXT)
    assert prepare.main(["--input", str(tmp_path / "c.jsonl"), "--output", str(tmp_path / "out")]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["num_documents"] == len(TEXT) and meta["tokens"] == sum(len(t.encode()) for t in TEXT)
    with pytest.raises(ConfigError, match="--output is required"):
        prepare.main(["--input", str(tmp_path / "c.jsonl")])
    # A train run starts from any step of a prepared dataset.
    assert train.main(["--config", "tiny", "--config.data.source=array_record",
                       f"--config.data.path={tmp_path / 'out'}", "--config.model.vocab_size=320",
                       "--config.steps=3", "--config.data.start_step=2", "--config.eval_every=0",
                       "--config.tensorboard=false", "--config.seq_len=16", "--config.batch_size=8",
                       "--config.model.num_layers=1", "--config.model.embed_dim=32",
                       "--config.model.mlp_dim=32", "--config.mesh.fsdp=1", "--config.mesh.data=8",
                       f"--config.run_dir={tmp_path / 'run'}"]) == 0
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2]


@pytest.mark.parametrize("source", ["text", "jsonl"])
def test_train_and_eval_rows_read_from_two_threads_at_once_are_their_own(tmp_path, source):
    """The train split (read in grain's prefetch thread) and the eval split (the training
    loop's thread) share one source's open files: with a shared file position one thread
    read the other's document (silently wrong text rows; "not JSON" from JSONL)."""
    import random
    import threading
    rng = random.Random(0)
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(5, 40)))
             for _ in range(2000)]
    path = tmp_path / "corpus.txt"
    if source == "text":
        path.write_text("\n".join(texts) + "\n")
    else:
        write_jsonl(path, texts)
    d = data.build(cfg_for(path, source, eval_fraction=0.2))
    rows = lambda split, s: split.rows(np.arange(s * 8, s * 8 + 8))["inputs"]  # noqa: E731
    want = {"train": [rows(d.train, s) for s in range(50)], "eval": [rows(d.eval, s) for s in range(20)]}
    got, errors = {"train": 0, "eval": 0}, []

    def read(name, split, reps):
        for _ in range(reps):
            for s, expected in enumerate(want[name]):
                try:
                    got[name] += not np.array_equal(rows(split, s), expected)
                except Exception as e:  # noqa: BLE001 - counted: the old code raised "not JSON" here
                    errors.append(repr(e))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switches as often as the two threads allow
    try:
        t = threading.Thread(target=read, args=("train", d.train, 16))
        t.start()
        read("eval", d.eval, 40)
        t.join()
    finally:
        sys.setswitchinterval(interval)
    assert got == {"train": 0, "eval": 0} and not errors, (got, errors[:2])


def test_a_byte_order_mark_is_not_part_of_the_first_document_on_any_path(tmp_path):
    """A UTF-8 BOM stayed in a text file's first document, and a JSONL file's first line
    failed as "not JSON" (with advice to skip it); prepare and the sources must agree."""
    import gzip
    bom = b"\xef\xbb\xbf"
    texts = ["first line", "second", "third one"]
    files = {"a.txt": bom + "\n".join(texts).encode() + b"\n",
             "b.jsonl": bom + "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()}
    files["c.jsonl.gz"] = gzip.compress(files["b.jsonl"])
    byte, expected = tokenizers.ByteTokenizer(), [t.encode() for t in texts]
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
        fmt = "text" if name.endswith(".txt") else "jsonl"
        if not name.endswith(".gz"):
            src = sources.TextSource(str(tmp_path / name), fmt, byte, index_dir=str(tmp_path / "ix"))
            assert [bytes(src[i].astype(np.uint8)) for i in range(len(src))] == expected, name
            if fmt == "text":  # an index cached before the BOM was dropped is built again
                cache = next((tmp_path / "ix").glob("*.npz"))
                old = {k: v for k, v in np.load(cache).items() if k != "bom"}
                old["offset"][0], old["size"][0] = 0, old["size"][0] + 3
                np.savez(cache, **old)
                again = sources.TextSource(str(tmp_path / name), fmt, byte, index_dir=str(tmp_path / "ix"))
                assert bytes(again[0].astype(np.uint8)) == b"first line" and again.fingerprint == src.fingerprint
        for chunk in (2, 5, 1 << 20):  # a range that starts at byte 0 and ranges that start after
            out = tmp_path / f"{name}-{chunk}"
            prepare.prepare(str(tmp_path / name), str(out), progress=False, processes=1, chunk_bytes=chunk)
            got = sources.ArrayRecordSource(str(out))
            assert [bytes(got[i].astype(np.uint8)) for i in range(len(got))] == expected, (name, chunk)
