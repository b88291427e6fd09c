"""A reader of Hugging Face safetensors checkpoints over mmap, one tensor (or row range) at a time.

The format: 8 bytes little-endian header length N, N bytes of JSON (name -> dtype, shape, and
``data_offsets`` relative to the end of the header; an optional ``__metadata__`` entry), then the
data. A sharded checkpoint adds ``model.safetensors.index.json`` whose ``weight_map`` names the
shard of every tensor. Reading hands out row ranges converted to float32; ``release`` drops the
pages a tensor touched from this process (they stay in the page cache), so converting a model
larger than RAM keeps the resident set at one chunk of one tensor.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError

HEADER_LEN_BYTES = 8
# The safetensors specification caps the JSON header at 100 MB; a larger length is corruption.
MAX_HEADER_BYTES = 100 * 1000 * 1000
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Element sizes of every dtype the format defines, so a header can be bounds-checked in full.
ITEM_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
# The dtypes convert reads (as stored numpy type); weights come in these.
READABLE: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8"),
}
# Bytes read as they are: gpt-oss's MXFP4 experts (``*_blocks``: nibbles, ``*_scales``: exponents),
# which the converter writes as GGUF's MXFP4 blocks, not as values.
RAW_SUFFIXES = ("_blocks", "_scales")


class SafetensorsError(ColibriError):
    """A checkpoint file that cannot be read, with the file and the reason."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int
    file: SafetensorsFile


class SafetensorsFile:
    """One ``.safetensors`` file: the header parsed and checked at open, the data mapped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(HEADER_LEN_BYTES)
                if len(head) < HEADER_LEN_BYTES:
                    self._fail(f"truncated file ({size} bytes, no header length)")
                n = int.from_bytes(head, "little")
                if n > MAX_HEADER_BYTES or HEADER_LEN_BYTES + n > size:
                    self._fail(f"malformed header: header length {n} does not fit the file ({size} bytes)")
                header = f.read(n)
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read: {e.strerror or e}") from None
        self.size = size
        self.entries: dict[str, Entry] = self._parse(header, HEADER_LEN_BYTES + n)

    def _fail(self, what: str) -> None:
        raise SafetensorsError(f"{self.path}: {what}")

    def _parse(self, header: bytes, data_start: int) -> dict[str, Entry]:
        try:
            table = json.loads(header.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._fail(f"malformed header: not JSON ({e})")
        if not isinstance(table, dict):
            self._fail("malformed header: not a JSON object")
        entries = {}
        for name, meta in table.items():
            if name == "__metadata__":
                continue
            what = f"malformed header: tensor {name!r}"
            if not isinstance(meta, dict):
                self._fail(f"{what} is not an object")
            dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
            if dtype not in ITEM_SIZES:
                self._fail(f"{what} has unknown dtype {dtype!r}")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
                self._fail(f"{what} has a bad shape {shape!r}")
            if not (isinstance(offsets, list) and len(offsets) == 2
                    and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
                self._fail(f"{what} has bad data_offsets {offsets!r}")
            nbytes = offsets[1] - offsets[0]
            if nbytes != math.prod(shape) * ITEM_SIZES[dtype]:
                self._fail(f"{what}: {nbytes} bytes do not hold {dtype} {shape}")
            if data_start + offsets[1] > self.size:
                self._fail(f"tensor {name!r} runs past the end of the file (truncated? "
                           f"needs {data_start + offsets[1]} bytes, file has {self.size})")
            entries[name] = Entry(name, dtype, tuple(shape), data_start + offsets[0], nbytes, self)
        return entries

    def raw(self, entry: Entry) -> np.ndarray:
        """Zero-copy view of a tensor's stored values (BF16 as uint16)."""
        if not readable(entry):
            raise SafetensorsError(f"{self.path}: tensor {entry.name!r} is {entry.dtype}; convert reads "
                                   f"{', '.join(READABLE)}")
        dt = READABLE.get(entry.dtype, np.dtype("u1"))
        return np.frombuffer(self._map, dt, entry.nbytes // dt.itemsize, entry.start).reshape(entry.shape)

    def release(self, entry: Entry) -> None:
        """Drop the pages of ``entry`` from this process; the page cache keeps them."""
        page = mmap.PAGESIZE
        start = entry.start // page * page
        end = min(-(-(entry.start + entry.nbytes) // page) * page, self.size)
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view still exists somewhere; the mapping goes with the last one
            pass


def readable(entry: Entry) -> bool:
    """A dtype convert reads, or MXFP4 bytes (``RAW_SUFFIXES``, U8)."""
    return entry.dtype in READABLE or (entry.dtype == "U8" and entry.name.endswith(RAW_SUFFIXES))


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values as float32 (a new array, except F32 which may stay a view)."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


class Checkpoint:
    """The safetensors weights of a Hugging Face model directory, sharded or not."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.files: list[SafetensorsFile] = []
        self.entries: dict[str, Entry] = {}
        index = self.directory / INDEX_NAME
        if index.is_file():
            self._open_index(index)
        elif (self.directory / SINGLE_NAME).is_file():
            self._add(SafetensorsFile(self.directory / SINGLE_NAME))
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise SafetensorsError(
                    f"{self.directory}: no safetensors weights ({SINGLE_NAME} or {INDEX_NAME})"
                )
            for shard in shards:
                self._add(SafetensorsFile(shard))
        self._check_readable()

    def _check_readable(self) -> None:
        """Every tensor of a dtype convert reads, checked now, not when the writer reaches it."""
        odd = [e for e in self.entries.values() if not readable(e)]
        if odd:
            more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
            raise SafetensorsError(f"{odd[0].file.path}: tensor {odd[0].name!r} is {odd[0].dtype}{more}; "
                                   f"convert reads {', '.join(READABLE)} (a quantized checkpoint?)")

    def _open_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise SafetensorsError(f"{index}: malformed index ({e!s})") from None
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(str(file), []).append(name)
        outside = [f for f in sorted(by_file) if Path(f).name != f]
        if outside:
            raise SafetensorsError(f"{index}: shard {outside[0]!r} is not a file name in {self.directory}")
        missing = [f for f in sorted(by_file) if not (self.directory / f).is_file()]
        if len(missing) == 1:
            names = by_file[missing[0]]
            raise SafetensorsError(f"{index}: shard {missing[0]!r} of tensor {names[0]!r} is missing"
                                   + (f" (and of {len(names) - 1} more tensors)" if len(names) > 1 else ""))
        if missing:
            n = sum(len(by_file[f]) for f in missing)
            raise SafetensorsError(f"{index}: {len(missing)} of its {len(by_file)} shards are missing "
                                   f"({', '.join(map(repr, missing))}; {n} tensors)")
        # A *.safetensors file the index does not name is not read, as transformers does not
        # (a consolidated.safetensors beside the shards, say, holds the same weights again).
        for file, names in sorted(by_file.items()):
            path = self.directory / file
            shard = SafetensorsFile(path)
            absent = [n for n in names if n not in shard.entries]
            if absent:
                raise SafetensorsError(f"{index}: tensor {absent[0]!r} is not in its shard {path}")
            self._add(shard, names)

    def _add(self, shard: SafetensorsFile, names: list[str] | None = None) -> None:
        self.files.append(shard)
        for name in names if names is not None else shard.entries:
            if name in self.entries:
                other = self.entries[name].file.path
                raise SafetensorsError(f"{shard.path}: tensor {name!r} is also in {other}")
            self.entries[name] = shard.entries[name]

    def rows(self, name: str, start: int, stop: int, expert: int | None = None,
             order: np.ndarray | None = None) -> np.ndarray:
        """Rows ``start:stop`` of a 2-D tensor (or of matrix ``expert`` of a 3-D one) as float32;
        with ``order``, rows ``order[start:stop]`` instead. A 1-D tensor is one row."""
        entry = self.entries[name]
        raw = entry.file.raw(entry)
        if expert is not None:
            raw = raw[expert]
        if raw.ndim == 1:
            raw = raw[None, :]
        raw = raw.reshape(raw.shape[0], -1)
        picked = raw[order[start:stop]] if order is not None else raw[start:stop]
        return to_float32(picked, entry.dtype)

    def raw(self, name: str) -> np.ndarray:
        """A tensor's stored values as they are (MXFP4's bytes)."""
        entry = self.entries[name]
        return entry.file.raw(entry)

    def release(self, name: str) -> None:
        entry = self.entries[name]
        entry.file.release(entry)

    def close(self) -> None:
        for f in self.files:
            f.close()
