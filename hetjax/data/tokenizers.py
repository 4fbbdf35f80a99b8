"""Tokenizers: a built-in byte-level one, Hugging Face `tokenizers` and SentencePiece.

Every tokenizer has `vocab_size`, `bos_id`, `encode(text) -> int32 array` (no BOS:
the packer adds one per document), `decode(ids)` and a `fingerprint` that changes
whenever the ids it produces could change (cache keys and iterator states use it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from hetjax import cli
from hetjax.errors import ConfigError

HF_BOS_NAMES = ("<|begin_of_text|>", "<bos>", "<s>", "[BOS]", "<|endoftext|>")


class ByteTokenizer:
    """UTF-8 bytes: ids 0..255 are the bytes, 256 is BOS; vocab_size 257."""

    vocab_size = 257
    bos_id = 256
    fingerprint = "byte-v1"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (extra: `pip install hetjax[hf]`)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._tok = cli.need("tokenizers", "hf", f"config.data.tokenizer={path!r}").Tokenizer.from_file(path)
        except Exception as e:
            raise ConfigError(f"config.data.tokenizer={path!r}: not a tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = [self._tok.token_to_id(n) for n in HF_BOS_NAMES]
        found = [i for i in ids if i is not None]
        if not found:
            raise ConfigError(f"config.data.tokenizer={path!r} has none of the BOS tokens "
                              f"{HF_BOS_NAMES}; add one as a special token")
        self.bos_id = found[0]
        self.fingerprint = "hf-" + _file_digest(Path(path))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def __getstate__(self):  # Rust objects do not pickle; grain workers reload the file
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


class SentencePieceTokenizer:
    """A SentencePiece .model file (extra: `pip install hetjax[sentencepiece]`)."""

    def __init__(self, path: str):
        self.path = path
        self._sp = cli.need("sentencepiece", "sentencepiece", f"config.data.tokenizer={path!r}").SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except Exception as e:
            raise ConfigError(f"config.data.tokenizer={path!r}: not a SentencePiece model ({e})") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.bos_id = self._sp.bos_id()
        if self.bos_id < 0:
            raise ConfigError(f"config.data.tokenizer={path!r} was trained without a BOS piece "
                              f"(bos_id=-1); retrain it with --bos_id=1")
        self.fingerprint = "sp-" + _file_digest(Path(path))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.EncodeAsIds(text), np.int32)

    def decode(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


def load(spec: str):
    """`byte`, a tokenizer.json path or a SentencePiece .model path."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"config.data.tokenizer={spec!r}: no such file; give 'byte', a "
                          f"tokenizer.json or a SentencePiece .model file")
    if path.suffix == ".json":
        return HFTokenizer(spec)
    if path.suffix == ".model":
        return SentencePieceTokenizer(spec)
    raise ConfigError(f"config.data.tokenizer={spec!r}: unknown kind; use 'byte', a .json "
                      f"(Hugging Face tokenizers) or a .model (SentencePiece) file")


def check_vocab(tokenizer, vocab_size: int, where: str) -> None:
    """The model must have an embedding row for every id the tokenizer can produce."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"{where} has {tokenizer.vocab_size} token ids but config.model.vocab_size="
            f"{vocab_size}; set config.model.vocab_size to at least {tokenizer.vocab_size} "
            f"(rounded up to a multiple of the tensor axis)")
