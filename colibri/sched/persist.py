"""Crash-safe persistence of KV slots (``.coli_kv``, ``.coli_kv.N``) and routing heat (``.coli_usage``).

A slot's file holds its token history and the K/V of exactly those positions, so a restarted engine
resumes a conversation without prefilling it again. Files are written to a temp name, fsynced, renamed
over the final name and the directory fsynced: a reader sees the old file or the new one, never a mix,
after kill -9 or power loss. Loading trusts nothing: a file that is damaged, truncated, foreign (other
model or KV layout) or of another format version is ignored with one warning line and the slot starts
cold. No file is opened through a symbolic link, for writing or reading (``colibri.state_files``).
The format and the reasons are in docs/persistence.md.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from colibri import state_files
from colibri.state_files import Refused as _Reject  # a file we will not load; the message says why

# PNG-style magics: the high-bit first byte catches 7-bit channels, "\r\n" catches CRLF -> LF
# conversion, "\x1a" stops `type` on DOS, the final "\n" catches LF -> CRLF conversion. Distinct
# magics keep a usage file from ever being read as a slot file and the other way round.
KV_MAGIC = b"\x89CKV\r\n\x1a\n"
USAGE_MAGIC = b"\x89CHT\r\n\x1a\n"
# A Channel snapshot (SNAPSHOT_SAVE): a slot's file plus the session's own state (JSON) after the
# K/V, at a path the host names; its own magic, so neither kind is ever loaded as the other.
SNAPSHOT_MAGIC = b"\x89CSN\r\n\x1a\n"
MAX_SNAPSHOT_META = 16 << 20  # the session's JSON: a conversation's text, far below this
# Bumped on any change to the header or payload layout; a file of another version is ignored (the
# slot starts cold) rather than migrated: a KV cache is a cache, recomputing it is always correct.
FORMAT_VERSION = 2  # 2: K/V in the cache's type, float16 or float32 (1: float32 only)

# Header, little-endian: magic, version u32, reserved u32 (zero; aligns what follows to 16 bytes),
# model fingerprint, layout fingerprint, count u64 (tokens, or heat elements), payload length u64,
# payload sha256; then the sha256 of those 128 bytes.
_HEADER_BODY = struct.Struct("<8sII32s32sQQ32s")
DIGEST_BYTES = 32  # sha256, used for both fingerprints and both checksums
HEADER_SIZE = _HEADER_BODY.size + DIGEST_BYTES  # 160
_VERSION_AT = 8  # offset of the version field, read before the header checksum (see _check_header)

TOKEN_DTYPE = np.dtype("<u4")  # token ids: every real vocabulary is far below 2**32
# Payloads are little-endian whatever the host, so files move between hosts.
HEAT_DTYPE = np.dtype("<f4")
MAX_TOKEN_ID = 2**32 - 1  # the largest id a u32 holds
# Write and hash in pieces of this size: a slot's KV can be hundreds of MB, and one bytes object of
# that size would double the memory of a save. 4 MiB is large enough that per-call overhead is noise.
CHUNK_BYTES = 4 << 20

KV_NAME = ".coli_kv"
USAGE_NAME = ".coli_usage"
TEMP_SUFFIX = ".tmp"  # a temp file is the final name plus this: a crash leftover names its slot
# Only names we write are ever deleted as stale temps, never another program's *.tmp.
_TEMP_RE = re.compile(r"\.coli_(kv(\.[0-9]+)?|usage)\.tmp")

Warn = Callable[[str], None]


def warn_stderr(message: str) -> None:
    """The default ``warn``: one line on stderr, in the CLI's ``colibri: warning:`` form."""
    print(f"colibri: warning: {message}", file=sys.stderr, flush=True)



def layout_fingerprint(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str = "float16",
                       keys_only: bool = False) -> bytes:
    """sha256 of the KV cache's shape per position and element type: a cache of another shape or
    dtype (another context-independent layout) must not be filled from this file. ``keys_only``:
    a latent attention's cache, whose values are the keys' first part (an empty V)."""
    desc = f"colibri kv layout v1\0{n_layers}\0{n_kv_heads}\0{head_dim}\0{np.dtype(dtype).str}"
    return hashlib.sha256((desc + ("\0keys only" if keys_only else "")).encode()).digest()


def _layout_of(k: np.ndarray, v: np.ndarray) -> bytes:
    """Of the K and V arrays written or filled: a file cannot name one type and hold another."""
    return layout_fingerprint(k.shape[0], k.shape[2], k.shape[3], k.dtype.name, v.shape[3] == 0)


def _usage_fingerprint(shape: tuple[int, ...]) -> bytes:
    desc = "colibri usage layout v1\0" + ",".join(map(str, shape)) + "\0" + HEAT_DTYPE.str
    return hashlib.sha256(desc.encode()).digest()



def slot_path(state_dir: Path, slot: int) -> Path:
    """Slot 0 is ``.coli_kv`` (the single-slot engine's one file), slot N is ``.coli_kv.N``."""
    if slot < 0:
        raise ValueError(f"slot {slot} is negative")
    return Path(state_dir) / (KV_NAME if slot == 0 else f"{KV_NAME}.{slot}")


def usage_path(state_dir: Path) -> Path:
    return Path(state_dir) / USAGE_NAME


def _temp_path(path: Path) -> Path:
    return path.with_name(path.name + TEMP_SUFFIX)


def remove_stale_temps(state_dir: Path) -> int:
    """Delete temp files a crash left behind, and links planted under their names (ours only; the
    link itself, never its target); returns how many. Call once at start, before any save: a temp
    file is never read, this only reclaims its space."""
    removed = 0
    try:
        entries = list(os.scandir(state_dir))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for entry in entries:
        if _TEMP_RE.fullmatch(entry.name) and (entry.is_symlink() or entry.is_file(follow_symlinks=False)):
            try:
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


# --- the write protocol -----------------------------------------------------------------------------


_fsync = state_files.fsync  # the data's sync, by this name: tests replace it to make a save fail


def _write_atomic(path: Path, magic: bytes, model_fp: bytes, layout_fp: bytes, count: int,
                  chunks: Iterator[memoryview]) -> None:
    """Write header + chunks to ``path`` so that ``path`` is, at every instant and after any crash,
    either its previous complete content or the new complete content.

    The payload is hashed while it is written; the header, which holds the hash, is written last at
    offset 0 (the temp file is invisible under the final name until the rename, so order is free).
    """
    with state_files.replacing(path, _temp_path(path), sync=_fsync) as f:
        f.write(bytes(HEADER_SIZE))  # placeholder: a temp file cut short has no valid magic
        digest, length = hashlib.sha256(), 0
        for chunk in chunks:
            f.write(chunk)
            digest.update(chunk)
            length += chunk.nbytes
        body = _HEADER_BODY.pack(magic, FORMAT_VERSION, 0, model_fp, layout_fp, count, length,
                                 digest.digest())
        f.seek(0)
        f.write(body + hashlib.sha256(body).digest())


def _array_chunks(a: np.ndarray, dtype: np.dtype) -> Iterator[memoryview]:
    """``a`` (leading axis = rows) as ``dtype``'s bytes, CHUNK_BYTES at a time, without copying
    when ``a`` is already contiguous and of that dtype."""
    if a.shape[0] == 0 or a.size == 0:
        return
    row_bytes = math.prod(a.shape[1:]) * dtype.itemsize
    rows = max(1, CHUNK_BYTES // row_bytes)
    for r in range(0, a.shape[0], rows):
        part = np.ascontiguousarray(a[r : r + rows], dtype=dtype)
        yield memoryview(part).cast("B")


def _check_fp(fp: bytes, what: str) -> None:
    if not isinstance(fp, bytes) or len(fp) != DIGEST_BYTES:
        raise ValueError(f"{what} must be {DIGEST_BYTES} bytes")


def _check_kv_arrays(k: np.ndarray, v: np.ndarray) -> None:
    if k.ndim != 4 or v.shape not in (k.shape, k.shape[:3] + (0,)):
        raise ValueError(f"k {k.shape} and v {v.shape} must both be [n_layers, n_ctx, n_kv_heads, head_dim] "
                         "(v's head_dim 0: keys only)")
    if k.dtype != v.dtype or k.dtype not in (np.float16, np.float32):
        raise ValueError(f"k and v must both be float16 or float32, not {k.dtype} and {v.dtype}")


def _kv_dtype(k: np.ndarray) -> np.dtype:
    """The payload's element type: the cache's, little-endian (the layout fingerprint names it)."""
    return np.dtype(k.dtype).newbyteorder("<")


def save_slot(state_dir: Path, slot: int, tokens: list[int], k: np.ndarray, v: np.ndarray,
              model_fp: bytes) -> None:
    """Persist one slot: its tokens and the K/V of positions [0, len(tokens)) of ``k`` and ``v``
    ([n_layers, n_ctx, n_kv_heads, head_dim] each). Bad arguments raise ValueError; an I/O error
    (disk full, read-only directory) raises OSError and leaves the previous file in place."""
    _save_kv(slot_path(state_dir, slot), KV_MAGIC, tokens, k, v, model_fp, b"")


def save_snapshot(path: Path, tokens: list[int], k: np.ndarray, v: np.ndarray, model_fp: bytes,
                  meta: bytes) -> None:
    """A Channel snapshot at ``path``: as ``save_slot``, with ``meta`` after the K/V, crash-safely."""
    if len(meta) > MAX_SNAPSHOT_META:
        raise ValueError(f"snapshot metadata of {len(meta)} bytes exceeds {MAX_SNAPSHOT_META}")
    _save_kv(path, SNAPSHOT_MAGIC, tokens, k, v, model_fp, meta)


def _save_kv(path: Path, magic: bytes, tokens: list[int], k: np.ndarray, v: np.ndarray,
             model_fp: bytes, meta: bytes) -> None:
    _check_fp(model_fp, "model_fp")
    _check_kv_arrays(k, v)
    n = len(tokens)
    if n > k.shape[1]:
        raise ValueError(f"{n} tokens but the cache holds {k.shape[1]} positions")
    ids = np.asarray(tokens, dtype=np.int64).reshape(n)
    if n and (ids.min() < 0 or ids.max() > MAX_TOKEN_ID):
        raise ValueError("token ids must be in [0, 2**32)")
    kv_dtype = _kv_dtype(k)

    def chunks() -> Iterator[memoryview]:
        if n:
            yield memoryview(ids.astype(TOKEN_DTYPE)).cast("B")
        for arr in (k, v):
            for layer in range(arr.shape[0]):  # [n_layers, n, ...] order: one layer's rows are contiguous
                yield from _array_chunks(arr[layer, :n], kv_dtype)
        if meta:
            yield memoryview(meta)

    _write_atomic(path, magic, model_fp, _layout_of(k, v), n, chunks())


def save_usage(state_dir: Path, heat: np.ndarray, model_fp: bytes) -> None:
    """Persist the routing heat (float32, any shape; empty for a dense model), as ``save_slot``."""
    _check_fp(model_fp, "model_fp")
    heat = np.asarray(heat)
    flat = heat.reshape(heat.size)
    _write_atomic(usage_path(state_dir), USAGE_MAGIC, model_fp, _usage_fingerprint(heat.shape),
                  heat.size, _array_chunks(flat, HEAT_DTYPE))


# --- the read side ----------------------------------------------------------------------------------


def _check_header(raw: bytes, size: int, magic: bytes, model_fp: bytes, layout_fp: bytes,
                  layout_what: str) -> tuple[int, int, bytes]:
    """Validate the header; (count, payload length, payload digest). Fingerprints and counts are
    judged only once the header checksum holds, so a flipped bit is reported as damage."""
    if size == 0:
        raise _Reject("empty file")
    if size < HEADER_SIZE:
        raise _Reject(f"truncated ({size} bytes, the header alone is {HEADER_SIZE})")
    if raw[: len(magic)] != magic:
        raise _Reject("bad magic, not a colibri state file of this kind (or mangled by a text-mode copy)")
    # The version is read before the checksum: another version may lay out (and check) its header
    # differently, and "written by another version" is the useful message then.
    (version,) = struct.unpack_from("<I", raw, _VERSION_AT)
    if version != FORMAT_VERSION:
        relation = "newer" if version > FORMAT_VERSION else "older"
        raise _Reject(f"format version {version} is {relation} than this build's {FORMAT_VERSION}")
    body = raw[: _HEADER_BODY.size]
    if hashlib.sha256(body).digest() != raw[_HEADER_BODY.size : HEADER_SIZE]:
        raise _Reject("header checksum mismatch (damaged file)")
    _, _, reserved, file_model, file_layout, count, length, digest = _HEADER_BODY.unpack(body)
    if reserved != 0:
        raise _Reject(f"unknown header flags {reserved:#x}")
    if file_model != model_fp:
        raise _Reject("written for another model")
    if file_layout != layout_fp:
        raise _Reject(f"written for another {layout_what}")
    return count, length, digest


def _open_checked(path: Path, magic: bytes, model_fp: bytes, layout_fp: bytes,
                  layout_what: str) -> tuple[BinaryIO, int, int, bytes] | None:
    """``path`` open past its header, which holds for this model and layout and whose payload length
    is the file's: (file, count, payload length, payload digest); None if there is no file."""
    if (opened := state_files.open_regular(path)) is None:
        return None
    f, size = open(opened[0], "rb", closefd=True), opened[1]
    try:
        count, length, expect = _check_header(f.read(HEADER_SIZE), size, magic, model_fp, layout_fp,
                                              layout_what)
        if size != HEADER_SIZE + length:
            cut = "truncated" if size < HEADER_SIZE + length else "trailing bytes"
            raise _Reject(f"{cut} ({size} bytes, expected {HEADER_SIZE + length})")
    except BaseException:
        f.close()
        raise
    return f, count, length, expect


def _read_exact(f, mv: memoryview) -> None:
    if f.readinto(mv) != mv.nbytes:
        raise _Reject("truncated while reading (the file shrank)")


def _read_into(f, digest, dst: np.ndarray, dtype: np.dtype) -> None:
    """Fill ``dst`` (leading axis = rows) from the file's ``dtype`` values, hashing the bytes."""
    if dst.size == 0:
        return
    row_bytes = math.prod(dst.shape[1:]) * dtype.itemsize
    rows = max(1, CHUNK_BYTES // row_bytes)
    direct = dst.dtype == dtype and dst.flags.c_contiguous  # little-endian host: read in place
    for r in range(0, dst.shape[0], rows):
        part = dst[r : r + rows]
        buf = part if direct else np.empty(part.shape, dtype=dtype)
        mv = memoryview(buf).cast("B")
        _read_exact(f, mv)
        digest.update(mv)
        if not direct:
            part[...] = buf


def load_slot(state_dir: Path, slot: int, model_fp: bytes, k_out: np.ndarray, v_out: np.ndarray,
              max_tokens: int, n_vocab: int, *,
              warn: Warn = warn_stderr) -> list[int] | None:
    """The slot's tokens, with their K/V copied into ``k_out[:, :n]`` and ``v_out[:, :n]``; None if
    there is no file (silently) or it cannot be trusted (one ``warn`` line; never raises for the
    file's contents). ``max_tokens`` is the cache's n_ctx, ``n_vocab`` bounds the token ids; a file
written from a cache of another shape or element type than the outputs' is refused.

    K/V are read straight into the outputs (no second copy of hundreds of MB); if the payload then
    fails its checksum, ``[:, :n]`` of both outputs is zeroed, as in a fresh cache.
    """
    path = slot_path(state_dir, slot)
    try:
        loaded = _load_kv(path, KV_MAGIC, model_fp, k_out, v_out, max_tokens, n_vocab)
    except (_Reject, OSError) as e:
        reason = str(e) if isinstance(e, _Reject) else f"cannot read: {e.strerror or e}"
        warn(f"{path}: {reason}, slot {slot} starts cold")
        return None
    return None if loaded is None else loaded[0]


class SnapshotError(Exception):
    """A snapshot that cannot be loaded; the message is the reason (SNAPSHOT_LOAD_FAILED's detail)."""


def load_snapshot(path: Path, model_fp: bytes, k_out: np.ndarray, v_out: np.ndarray,
                  max_tokens: int, n_vocab: int) -> tuple[list[int], bytes]:
    """A snapshot's tokens (their K/V copied into ``k_out[:, :n]``, ``v_out[:, :n]``) and its
    metadata. The whole file is checked before the outputs are touched, so a damaged or foreign
    snapshot leaves the conversation in the cache as it was; SnapshotError says why."""
    _check_kv_arrays(k_out, v_out)
    try:
        if not _verify(path, SNAPSHOT_MAGIC, model_fp, _layout_of(k_out, v_out)):
            raise _Reject("no such file")
        loaded = _load_kv(path, SNAPSHOT_MAGIC, model_fp, k_out, v_out, max_tokens, n_vocab)
    except _Reject as e:
        raise SnapshotError(f"{path}: {e}") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from None
    if loaded is None:
        raise SnapshotError(f"{path}: no such file")
    return loaded


def _verify(path: Path, magic: bytes, model_fp: bytes, layout_fp: bytes) -> bool:
    """Whether ``path`` exists; _Reject if its header or its payload's checksum is wrong."""
    checked = _open_checked(path, magic, model_fp, layout_fp, "KV cache layout")
    if checked is None:
        return False
    f, _, _, expect = checked
    with f:
        digest = hashlib.sha256()
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
        if digest.digest() != expect:
            raise _Reject("payload checksum mismatch (damaged file)")
    return True


def _load_kv(path: Path, magic: bytes, model_fp: bytes, k_out: np.ndarray, v_out: np.ndarray,
             max_tokens: int, n_vocab: int) -> tuple[list[int], bytes] | None:
    """(tokens, metadata) of ``path``, K/V into the outputs; None if there is no file; _Reject if it
    cannot be trusted (``[:, :n]`` of the outputs zeroed once touched)."""
    _check_fp(model_fp, "model_fp")
    _check_kv_arrays(k_out, v_out)
    layout_fp = _layout_of(k_out, v_out)
    if max_tokens > k_out.shape[1]:
        raise ValueError(f"max_tokens {max_tokens} exceeds the cache's {k_out.shape[1]} positions")
    n = 0
    touched = False
    try:
        checked = _open_checked(path, magic, model_fp, layout_fp, "KV cache layout")
        if checked is None:
            return None
        f, n, length, expect = checked
        with f:
            if n > max_tokens:
                raise _Reject(f"{n} tokens exceed the context of {max_tokens}")
            row_bytes = (math.prod(k_out.shape[2:]) + math.prod(v_out.shape[2:])) * k_out.dtype.itemsize
            want = n * TOKEN_DTYPE.itemsize + k_out.shape[0] * n * row_bytes
            extra = MAX_SNAPSHOT_META if magic == SNAPSHOT_MAGIC else 0
            if not want <= length <= want + extra:
                raise _Reject(f"payload of {length} bytes does not match {n} tokens of this layout ({want})")
            digest = hashlib.sha256()
            ids = np.empty(n, dtype=TOKEN_DTYPE)
            _read_exact(f, memoryview(ids).cast("B"))
            digest.update(memoryview(ids).cast("B"))
            if n and int(ids.max()) >= n_vocab:
                raise _Reject(f"token id {int(ids.max())} is outside the vocabulary of {n_vocab}")
            touched = True
            kv_dtype = _kv_dtype(k_out)
            for out in (k_out, v_out):
                for layer in range(out.shape[0]):
                    _read_into(f, digest, out[layer, :n], kv_dtype)
            meta = f.read(length - want)
            if len(meta) != length - want:
                raise _Reject("truncated while reading (the file shrank)")
            digest.update(meta)
            if digest.digest() != expect:
                raise _Reject("payload checksum mismatch (damaged file)")
        return ids.astype(np.int64).tolist(), meta
    except (_Reject, OSError):
        if touched:
            k_out[:, :n] = 0
            v_out[:, :n] = 0
        raise


def load_usage(state_dir: Path, model_fp: bytes, shape: tuple[int, ...], *,
               warn: Warn = warn_stderr) -> np.ndarray | None:
    """The routing heat saved for this model and shape, or None: missing (silently) or untrustworthy
    (one ``warn`` line). Non-finite values are rejected too: one NaN would poison every later sum."""
    _check_fp(model_fp, "model_fp")
    shape = tuple(int(d) for d in shape)
    path = usage_path(state_dir)
    try:
        checked = _open_checked(path, USAGE_MAGIC, model_fp, _usage_fingerprint(shape), "expert shape")
        if checked is None:
            return None
        f, count, length, expect = checked
        with f:
            n = int(np.prod(shape, dtype=np.int64))
            if count != n or length != n * HEAT_DTYPE.itemsize:
                raise _Reject(f"{count} values ({length} bytes) do not match the shape {shape}")
            heat = np.empty(n, dtype=np.float32)
            digest = hashlib.sha256()
            _read_into(f, digest, heat, HEAT_DTYPE)
            if digest.digest() != expect:
                raise _Reject("payload checksum mismatch (damaged file)")
            if not np.isfinite(heat).all():
                raise _Reject("non-finite heat values")
        return heat.reshape(shape)
    except (_Reject, OSError) as e:
        reason = str(e) if isinstance(e, _Reject) else f"cannot read: {e.strerror or e}"
        warn(f"{path}: {reason}, routing heat starts cold")
        return None
