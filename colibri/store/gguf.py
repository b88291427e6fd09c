"""A GGUF reader over mmap: metadata parsed at open, tensor data touched only when a kernel reads it.

Opening a model reads the header, the metadata and the tensor directory (a few MB at most) and
maps the rest; tensors are handed out as zero-copy numpy views of the mapping, so the page cache,
not this process, holds the weights. Every defect is reported as a ``GGUFError`` naming the file
and, where there is one, the tensor.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri.errors import ColibriError
from colibri.store.formats import BLOCK_GEOMETRY, SUPPORTED, GGMLType

MAGIC = b"GGUF"
# Version 1 used 32-bit counts and lengths; every file written since 2023 is v2 or v3.
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Bounds that stop a corrupt count from making us allocate or loop for ever before we notice the
# file is too short: no real model has more tensors, dimensions or metadata entries than these.
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 16
MAX_DIMS = 4
MAX_STRING_BYTES = 1 << 24

# GGUF metadata value types.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = 8, 9, 10, 11, 12
_SCALARS: dict[int, tuple[str, int]] = {
    _UINT8: ("<B", 1),
    _INT8: ("<b", 1),
    _UINT16: ("<H", 2),
    _INT16: ("<h", 2),
    _UINT32: ("<I", 4),
    _INT32: ("<i", 4),
    _FLOAT32: ("<f", 4),
    _BOOL: ("<?", 1),
    _UINT64: ("<Q", 8),
    _INT64: ("<q", 8),
    _FLOAT64: ("<d", 8),
}
_NUMPY_OF: dict[int, str] = {
    _UINT8: "<u1", _INT8: "<i1", _UINT16: "<u2", _INT16: "<i2", _UINT32: "<u4", _INT32: "<i4",
    _FLOAT32: "<f4", _BOOL: "?", _UINT64: "<u8", _INT64: "<i8", _FLOAT64: "<f8",
}


class GGUFError(ColibriError):
    """A file that is not a GGUF model we can read, with the reason."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor directory. ``shape`` is ggml order: ``shape[0]`` is a row's length."""

    name: str
    shape: tuple[int, ...]
    gtype: GGMLType
    offset: int  # absolute offset of the data in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    """Reads little-endian fields from the mapped header, failing with 'truncated' at the end."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated file (ends inside {what})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, size = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(_UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(_UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        if n > MAX_STRING_BYTES:
            raise GGUFError(f"{self.path}: string of {n} bytes in {what} is not plausible")
        return self.take(n, what).decode("utf-8", errors="replace")

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in one loop (a vocabulary's 49152 tokens and 48900 merges: the open's
        main cost when read field by field, 0.3 s of the default model's start-up)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFError(f"{self.path}: truncated file (ends inside {what})")
            n = int.from_bytes(buf[pos : pos + 8], "little")
            if n > MAX_STRING_BYTES:
                raise GGUFError(f"{self.path}: string of {n} bytes in {what} is not plausible")
            if pos + 8 + n > end:
                raise GGUFError(f"{self.path}: truncated file (ends inside {what})")
            out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, count = self.u32(what), self.u64(what)
            if etype in _NUMPY_OF:
                size = _SCALARS[etype][1]
                raw = self.take(count * size, what)
                return np.frombuffer(raw, dtype=_NUMPY_OF[etype]).tolist()
            if count > len(self.buf):
                raise GGUFError(f"{self.path}: array of {count} items in {what} is not plausible")
            if etype == _STRING:
                return self.strings(count, what)
            return [self.value(etype, what) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} in {what}")


class GGUFFile:
    """An open GGUF file: ``metadata`` (dict), ``tensors`` (name -> TensorInfo) and views."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 24:
                    raise GGUFError(f"{self.path}: truncated file ({size} bytes, no GGUF header)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                # The same open file for ``read_into`` (not the path again: a file renamed over it
                # later must not be read under this one's offsets), closed with this object.
                self._fd = os.dup(f.fileno())
                self._close_fd = weakref.finalize(self, os.close, self._fd)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open: {e.strerror or e}") from None
        self.file_size = size
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._released: dict[str, None] = {}  # tensors whose copies are what is read (``release``), once each
        self._parse()

    def _parse(self) -> None:
        cur = _Cursor(self._map, self.path)
        magic = cur.take(4, "magic")
        if magic != MAGIC:
            raise GGUFError(f"{self.path}: bad magic {magic!r}, not a GGUF file")
        self.version = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(
                f"{self.path}: unsupported GGUF version {self.version} "
                f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})"
            )
        n_tensors, n_kv = cur.u64("tensor count"), cur.u64("metadata count")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise GGUFError(f"{self.path}: implausible header ({n_tensors} tensors, {n_kv} keys)")
        for _ in range(n_kv):
            key = cur.string("metadata key")
            self.metadata[key] = cur.value(cur.u32(f"metadata {key!r}"), f"metadata {key!r}")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor #{i} name")
            what = f"tensor {name!r}"
            n_dims = cur.u32(what)
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"{self.path}: {what} has {n_dims} dimensions")
            shape = tuple(cur.u64(what) for _ in range(n_dims))
            type_id, offset = cur.u32(what), cur.u64(what)
            infos.append((name, shape, type_id, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {alignment} is not a power of two")
        self.data_offset = -(-cur.pos // alignment) * alignment
        for name, shape, type_id, offset in infos:
            self.tensors[name] = self._tensor_info(name, shape, type_id, offset)

    def _tensor_info(self, name: str, shape: tuple[int, ...], type_id: int, offset: int) -> TensorInfo:
        try:
            gtype = GGMLType(type_id)
        except ValueError:
            raise GGUFError(
                f"{self.path}: tensor {name!r} has unknown block type {type_id}"
            ) from None
        if gtype not in BLOCK_GEOMETRY:
            raise GGUFError(f"{self.path}: tensor {name!r} has unknown block type {gtype.name}")
        per_block, block_bytes = BLOCK_GEOMETRY[gtype]
        n = math.prod(shape)  # Python ints: a corrupt shape cannot overflow past the checks
        if n == 0:
            raise GGUFError(f"{self.path}: tensor {name!r} has an empty shape {list(shape)}")
        if shape[0] % per_block:
            raise GGUFError(
                f"{self.path}: tensor {name!r} row of {shape[0]} is not whole {gtype.name} blocks"
            )
        nbytes = n // per_block * block_bytes
        start = self.data_offset + offset
        if start + nbytes > self.file_size:
            raise GGUFError(
                f"{self.path}: tensor {name!r} data runs past the end of the file "
                f"(needs bytes {start}..{start + nbytes}, file has {self.file_size})"
            )
        return TensorInfo(name, shape, gtype, start, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view, shaped (rows, row_bytes)."""
        info = self.tensors[name]
        rows = info.n_elements // info.shape[0]
        view = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return view.reshape(rows, info.nbytes // rows)

    def read_into(self, start: int, out: np.ndarray) -> None:
        """``out.nbytes`` bytes at ``start`` copied into ``out`` (C-contiguous) by ``pread``: one
        copy from the page cache (or the disk), never mapped into this process, so nothing enters
        its RSS but ``out`` (the expert store's misses)."""
        if start < 0 or start + out.nbytes > self.file_size:
            raise GGUFError(f"{self.path}: read of {out.nbytes} bytes at {start} runs past the end")
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            try:
                n = os.preadv(self._fd, [view[done:]], start + done)
            except OSError as e:
                raise GGUFError(f"{self.path}: cannot read: {e.strerror or e}") from None
            if n <= 0:
                raise GGUFError(f"{self.path}: file ended at byte {start + done} while reading")
            done += n

    def advise_willneed(self, start: int, length: int) -> None:
        """Ask the kernel to read ``length`` bytes at ``start`` into the page cache in the
        background (readahead), so a later access does not wait on the disk."""
        aligned = start - start % mmap.PAGESIZE
        end = min(start + length, self.file_size)
        if end > aligned:
            self._map.madvise(mmap.MADV_WILLNEED, aligned, end - aligned)

    def release(self, name: str) -> None:
        """Drop this mapping's hold on the pages wholly inside tensor ``name`` once a copy of it is
        all that is read (a packed matrix): they leave this process's RSS and stay in the page
        cache, so that a model costs its packed copy, not that and the file."""
        self._released[name] = None
        self._drop(self.tensors[name])

    @property
    def released(self) -> tuple[str, ...]:
        """The tensors ``release`` was asked for: copies of them are what is read."""
        return tuple(self._released)

    def release_again(self) -> None:
        """``release`` every released tensor once more, when a model's loading is done: a fault
        on a small tensor (a norm, a router) maps the page cache's whole folio around it, up to 2
        MB of its neighbours (large folios), so the released matrices beside it came back: 86 MB
        of a 2.25 GB file's attention weights, 4% of its RSS."""
        for name in self._released:
            self._drop(self.tensors[name])

    def _drop(self, info: TensorInfo) -> None:
        first = -(-info.offset // mmap.PAGESIZE) * mmap.PAGESIZE  # a page shared with a neighbour stays
        end = min(info.offset + info.nbytes, self.file_size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

    def advise_dontneed(self) -> None:
        """Drop this file's pages from the page cache (benchmarks start from a cold disk): first this
        mapping's hold on them, then the cache (the kernel keeps pages any mapping still holds)."""
        self._map.madvise(mmap.MADV_DONTNEED)
        with open(self.path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def require_supported(self, name: str) -> TensorInfo:
        """The tensor's info, or a GGUFError if the kernels cannot compute on its block type."""
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing")
        info = self.tensors[name]
        if info.gtype not in SUPPORTED:
            raise GGUFError(
                f"{self.path}: tensor {name!r} has unsupported block type {info.gtype.name} "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED))})"
            )
        return info

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def fingerprint(self) -> bytes:
        """sha256 of the file's header region (metadata and tensor directory) and its size: what
        persisted KV slots and routing heat are checked against.

        Cheap at any model size (no tensor data is read) and changes with any change of architecture,
        hyperparameters, tokenizer, quantization or tensor layout. It cannot tell apart two files whose
        header and size are identical and whose weights differ (e.g. two fine-tunes saved with the same
        metadata); hashing the weights would cost minutes per start on a large model.
        """
        h = hashlib.sha256(b"colibri model fingerprint v1\0")
        h.update(self._map[: self.data_offset])
        h.update(struct.pack("<QQ", self.data_offset, self.file_size))
        return h.digest()

    def close(self) -> None:
        self._close_fd()
        # Views handed out keep the mapping alive; closing with live views would fault them.
        try:
            self._map.close()
        except BufferError:
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
