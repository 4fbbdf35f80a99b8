"""Tokenizers: a built-in byte-level one, Hugging Face `tokenizers`, SentencePiece and tiktoken.

Every tokenizer has `vocab_size`, `bos_id` and `eos_id` (None where it has none),
`add_bos` and `add_eos` (its own convention for a pretraining document: Llama 3
opens with <|begin_of_text|> and ends with <|end_of_text|>, Qwen2 has no BOS and
ends with <|endoftext|>), `encode(text)` and `encode_batch(texts)` (int32 arrays
without BOS/EOS: the packer adds them), `decode(ids)`, and a `fingerprint` that
changes whenever the ids it produces could change (cache keys and iterator states
use it). `load` tells the kinds apart by a file's content, not by its name.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from hetjax import cli
from hetjax.errors import ConfigError

HF_BOS_NAMES = ("<|begin_of_text|>", "<bos>", "<s>", "[BOS]")
HF_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]")
# Llama 3's tiktoken file: the merges only; its 256 special tokens follow the ranks.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                   "<|python_tag|>"]
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*\s+\d+\s*$")


class ByteTokenizer:
    """UTF-8 bytes: ids 0..255 are the bytes, 256 is BOS; vocab_size 257, no EOS."""

    vocab_size = 257
    bos_id, eos_id = 256, None
    add_bos, add_eos = True, False
    fingerprint = "byte-v1"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


class _Reloaded:
    """Rust tokenizers do not pickle: grain and prepare's workers load the file again."""

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


class HFTokenizer(_Reloaded):
    """A Hugging Face `tokenizers` tokenizer.json (extra: `pip install hetjax[hf]`).

    BOS/EOS come from a tokenizer_config.json beside it (bos_token, eos_token,
    add_bos_token) where there is one, else from the tokenizer's post-processor
    (does it prepend a special token?) and the usual token names."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._tok = cli.need("tokenizers", "hf", f"config.data.tokenizer={path!r}").Tokenizer.from_file(path)
        except Exception as e:
            raise ConfigError(f"config.data.tokenizer={path!r}: not a tokenizer.json ({e})") from None
        # A document's text is text: "<|endoftext|>" quoted in it is not an EOS, as with
        # tiktoken's encode_ordinary (the same Llama 3 text gave other ids from each file).
        self._tok.encode_special_tokens = True  # tokenizers >= 0.15.1 (pyproject's extras say so)
        # A file saved after a call with truncation=True or padding=True keeps them: every
        # document would be cut to its max_length, and a batch's padded to its longest.
        # hf3 marks a file whose tokens change by this (others keep hf2's fingerprint).
        saved_cuts = self._tok.truncation is not None or self._tok.padding is not None
        self._tok.no_truncation()
        self._tok.no_padding()
        # The embedding needs a row for the highest id, which ids not counted from 0 exceed.
        self.vocab_size = 1 + max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        extra = _tokenizer_config(Path(path).parent)
        bos = extra.get("bos_token") or _first_known(self._tok, HF_BOS_NAMES)
        eos = extra.get("eos_token") or _first_known(self._tok, HF_EOS_NAMES)
        self.bos_id = self._tok.token_to_id(bos) if bos else None
        self.eos_id = self._tok.token_to_id(eos) if eos else None
        prepends = self._tok.encode("a", add_special_tokens=True).ids[:1] == [self.bos_id]
        self.add_bos = self.bos_id is not None and bool(extra.get("add_bos_token", prepends or "bos_token" not in extra))
        self.add_eos = self.eos_id is not None
        self.fingerprint = ("hf3-" if saved_cuts else "hf2-") + _file_digest(Path(path))  # hf2: special-token text encoded as text

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def _tokenizer_config(directory: Path) -> dict:
    f = directory / "tokenizer_config.json"
    try:
        raw = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    out = {k: v.get("content") if isinstance(v, dict) else v for k, v in raw.items()
           if k in ("bos_token", "eos_token", "add_bos_token")}
    return {k: v for k, v in out.items() if v is not None}


def _first_known(tok, names):
    return next((n for n in names if tok.token_to_id(n) is not None), None)


class SentencePieceTokenizer(_Reloaded):
    """A SentencePiece .model file (extra: `pip install hetjax[sentencepiece]`)."""

    def __init__(self, path: str):
        self.path = path
        self._sp = cli.need("sentencepiece", "sentencepiece", f"config.data.tokenizer={path!r}").SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except Exception as e:
            raise ConfigError(f"config.data.tokenizer={path!r}: not a SentencePiece model ({e})") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.add_bos, self.add_eos = self.bos_id is not None, self.eos_id is not None
        self.fingerprint = "sp-" + _file_digest(Path(path))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.EncodeAsIds(text), np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int32) for ids in self._sp.EncodeAsIds(texts)]

    def decode(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


class TiktokenTokenizer(_Reloaded):
    """A tiktoken BPE file (base64 token, rank per line), e.g. Llama 3's original
    tokenizer.model (extra: `pip install hetjax[tiktoken]`). Special tokens follow the
    ranks as Llama 3 lays them out (256 of them: <|begin_of_text|> first)."""

    def __init__(self, path: str):
        self.path = path
        tiktoken = cli.need("tiktoken", "tiktoken", f"config.data.tokenizer={path!r}")
        ranks = {}
        for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
            if line.strip():
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except ValueError:
                    raise ConfigError(f"config.data.tokenizer={path!r}:{n}: not a tiktoken line "
                                      f"(base64 token, space, rank)") from None
        names = LLAMA3_SPECIALS + [f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(LLAMA3_SPECIALS) + 2)]
        specials = {name: len(ranks) + i for i, name in enumerate(names)}
        self._enc = tiktoken.Encoding(Path(path).stem, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=specials)
        self.vocab_size = len(ranks) + len(specials)
        self.bos_id, self.eos_id = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]
        self.add_bos = self.add_eos = True
        self.fingerprint = "tiktoken-" + _file_digest(Path(path))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int32) for ids in self._enc.encode_ordinary_batch(texts, num_threads=1)]

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def kind(path: Path) -> str:
    """'hf', 'sentencepiece' or 'tiktoken', from the first bytes of the file."""
    with open(path, "rb") as f:
        head = f.read(4096)
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        return "hf"
    first = head.split(b"\n", 1)[0]
    if _TIKTOKEN_LINE.match(first):
        return "tiktoken"
    if head[:1] == b"\x0a":  # a protobuf ModelProto: field 1 (pieces), length-delimited
        return "sentencepiece"
    raise ConfigError(f"config.data.tokenizer={str(path)!r}: unknown kind of tokenizer file (it is "
                      f"not JSON, not a tiktoken BPE list and not a SentencePiece model); give 'byte', "
                      f"a tokenizer.json, a directory holding one, a SentencePiece or a tiktoken model")


KINDS = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer, "tiktoken": TiktokenTokenizer}


def resolve(spec: str) -> Path:
    """The tokenizer file `spec` names: itself, or a model directory's tokenizer.json
    (else its tokenizer.model)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return path / name
        raise ConfigError(f"config.data.tokenizer={spec!r}: the directory holds no tokenizer.json "
                          f"or tokenizer.model")
    if not path.is_file():
        raise ConfigError(f"config.data.tokenizer={spec!r}: no such file; give 'byte', a "
                          f"tokenizer.json, a model directory, or a SentencePiece/tiktoken model file")
    return path


def load(spec: str):
    """`byte`, or a tokenizer file or model directory (its kind read from its content)."""
    if spec == "byte":
        return ByteTokenizer()
    path = resolve(spec)
    return KINDS[kind(path)](str(path))


def specials(tok, bos: str, eos: str, where: str = "config.data") -> tuple[int | None, int | None]:
    """(BOS id or None, EOS id or None) each document gets: `auto` follows the
    tokenizer's convention, `true` asks for the token (refused if it has none), `false`
    leaves it out. `tok` is a tokenizer or a prepared dataset's metadata."""
    out = []
    for name, choice in (("bos", bos), ("eos", eos)):
        token, default = getattr(tok, f"{name}_id"), getattr(tok, f"add_{name}")
        if choice not in ("auto", "true", "false"):
            raise ConfigError(f"{where}.{name}={choice!r}: choose auto, true or false")
        if choice == "true" and token is None:
            raise ConfigError(f"{where}.{name}=true but the tokenizer has no {name.upper()} token; "
                              f"set {where}.{name}=false or auto")
        out.append(token if choice == "true" or choice == "auto" and default else None)
    if out == [None, None]:
        raise ConfigError(f"{where}.bos and {where}.eos leave documents without a separator "
                          f"(BOS or EOS); keep at least one")
    return out[0], out[1]


def check_vocab(tokenizer, vocab_size: int, where: str) -> None:
    """The model must have an embedding row for every id the tokenizer can produce."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"{where} has {tokenizer.vocab_size} token ids but config.model.vocab_size="
            f"{vocab_size}; set config.model.vocab_size to at least {tokenizer.vocab_size} "
            f"(rounded up to a multiple of the tensor axis)")
