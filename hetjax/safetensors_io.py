"""Streaming safetensors: read one tensor at a time (memory-mapped), write shards
whose headers are planned from shapes alone, so no more than one tensor is ever
held in memory. The format: an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from hetjax.errors import ConvertError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # the format's own limit


class File:
    """One .safetensors file; `get(name)` reads just that tensor."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if head.startswith(b"version "):  # a clone without git-lfs holds its pointers, not the weights
                raise ConvertError(f"{self.path} is a Git LFS pointer, not the weights: run `git lfs pull` in "
                                   f"its repository (or download it again)")
            if not 2 <= n <= min(MAX_HEADER, self.path.stat().st_size - 8):
                raise ConvertError(f"{self.path} is not a safetensors file (no header of a sane length); "
                                   f"download it again")
            try:
                self.header = json.loads(f.read(n))
            except ValueError:
                self.header = None
            if not isinstance(self.header, dict):
                raise ConvertError(f"{self.path}: its safetensors header is not a JSON object; download it again")
        self.header.pop("__metadata__", None)
        self.data_start = 8 + n

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise ConvertError(f"{self.path}: tensor {name} has dtype {info['dtype']}, which hetjax cannot read")
        begin, end = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]])
        if end - begin != math.prod(info["shape"]) * dtype.itemsize:
            raise ConvertError(f"{self.path}: tensor {name} has {end - begin} bytes, not {info['shape']} x {dtype}")
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            raw = f.read(end - begin)
        if len(raw) != end - begin:
            raise ConvertError(f"{self.path} is truncated inside tensor {name}; download it again")
        return np.frombuffer(raw, dtype.newbyteorder("<")).astype(dtype).reshape(info["shape"])


def open_dir(directory: Path) -> dict[str, File]:
    """Tensor name -> the file holding it, for a sharded (index json) or single-file checkpoint."""
    directory = Path(directory)
    if (directory / INDEX).exists():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        files = {f: File(directory / f) for f in sorted(set(weight_map.values()))}
        for name, f in weight_map.items():  # before anything is read
            if name not in files[f].header:
                raise ConvertError(f"{files[f].path} holds no tensor {name}, which {INDEX} places there; "
                                   f"download the checkpoint again")
        return {name: files[f] for name, f in weight_map.items()}
    paths = sorted(directory.glob("*.safetensors"))
    if len(paths) != 1:
        raise FileNotFoundError(f"{directory}: expected {INDEX} or exactly one *.safetensors file, found {len(paths)}")
    file = File(paths[0])
    return {name: file for name in file.header}


def write_dir(directory: Path, specs: list[tuple[str, tuple, np.dtype]], tensors: Iterable[np.ndarray],
              max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Writes `tensors` (in the order of `specs`: name, shape, dtype) as shards of at most
    `max_shard_bytes`, plus the index json when there is more than one shard."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards, size = [[]], 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * np.dtype(spec[2]).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    stream: Iterator[np.ndarray] = iter(tensors)
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in shard:
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(directory / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape, dtype in shard:
                x = np.ascontiguousarray(next(stream), dtype=np.dtype(dtype).newbyteorder("<"))
                assert x.shape == tuple(shape), (name, x.shape, shape)
                f.write(x.tobytes())
        total += offset
    if len(shards) > 1:
        (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [directory / n for n in names]
