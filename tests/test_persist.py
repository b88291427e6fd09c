"""Slot and usage persistence: exact round trips, one warning and a cold start for every kind of bad
file (never an exception), and atomicity under SIGKILL at random moments of a save loop."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from colibri.model.hparams import HParams
from colibri.model.kv_cache import KVCache
from colibri.sched import persist
from colibri.sched.persist import (
    layout_fingerprint,
    load_slot,
    load_usage,
    remove_stale_temps,
    save_slot,
    save_usage,
    slot_path,
)
from colibri.store.gguf import GGUFFile

REPO = Path(__file__).resolve().parent.parent

# The header as docs/persistence.md specifies it, restated here so the tests check the document.
HEADER = struct.Struct("<8sII32s32sQQ32s")
HEADER_SIZE = HEADER.size + 32
assert HEADER_SIZE == 160

N_LAYERS, N_CTX, N_KV, HEAD_DIM, N_VOCAB = 3, 32, 2, 8, 500
MODEL_FP = hashlib.sha256(b"model a").digest()
SHAPE = (N_LAYERS, N_CTX, N_KV, HEAD_DIM)
ROW = N_KV * HEAD_DIM * 2  # bytes of one layer's K (or V) at one position: halves


def state(n: int, seed: int = 0) -> tuple[list[int], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, N_VOCAB, n).tolist()
    k = rng.standard_normal(SHAPE).astype(np.float16)  # nonzero beyond n too: must not be written
    v = rng.standard_normal(SHAPE).astype(np.float16)
    return tokens, k, v


def file_size(n: int) -> int:
    return HEADER_SIZE + n * 4 + 2 * N_LAYERS * n * ROW


def load(d: Path, slot: int = 0, shape: tuple[int, ...] = SHAPE, dtype: type = np.float16,
         **kw) -> tuple[list[int] | None, np.ndarray, np.ndarray]:
    """load_slot into fresh outputs filled with a sentinel (to see what was and was not written);
    ``shape`` and ``dtype``: the cache the file is loaded into."""
    k_out, v_out = np.full(shape, 7, dtype), np.full(shape, 7, dtype)
    args = dict(model_fp=MODEL_FP, max_tokens=N_CTX, n_vocab=N_VOCAB) | kw
    return load_slot(d, slot, k_out=k_out, v_out=v_out, **args), k_out, v_out


def expect_cold(capsys, d: Path, slot: int = 0, fragment: str = "", **kw) -> tuple[np.ndarray, str]:
    """The load gives None and exactly one warning line on stderr, naming the file and the slot."""
    capsys.readouterr()
    tokens, k_out, _ = load(d, slot, **kw)
    err = capsys.readouterr().err
    assert tokens is None
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith(f"colibri: warning: {slot_path(d, slot)}: "), err
    assert lines[0].endswith(f", slot {slot} starts cold"), err
    assert fragment in lines[0], err
    return k_out, lines[0]


def rewrite_header(path: Path, **fields) -> None:
    """Change header fields and recompute the header checksum: a well-formed header with new values."""
    blob = bytearray(path.read_bytes())
    names = ["magic", "version", "reserved", "model", "layout", "count", "length", "digest"]
    values = dict(zip(names, HEADER.unpack_from(blob), strict=True)) | fields
    body = HEADER.pack(*(values[n] for n in names))
    blob[:HEADER_SIZE] = body + hashlib.sha256(body).digest()
    path.write_bytes(bytes(blob))


def flip(path: Path, offset: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[offset] ^= 0x10
    path.write_bytes(bytes(blob))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, Path, int]:
    n = 20
    save_slot(tmp_path, 0, *state(n), MODEL_FP)
    return tmp_path, slot_path(tmp_path, 0), n


# --- round trips ------------------------------------------------------------------------------------


def test_round_trip_is_exact_and_writes_only_the_history(tmp_path):
    tokens, k, v = state(20, seed=3)
    save_slot(tmp_path, 0, tokens, k, v, MODEL_FP)
    path = tmp_path / ".coli_kv"
    assert path.stat().st_size == file_size(20)
    assert path.read_bytes()[:8] == persist.KV_MAGIC
    got, k_out, v_out = load(tmp_path)
    assert got == tokens and all(type(t) is int for t in got)
    assert k_out[:, :20].tobytes() == k[:, :20].tobytes()
    assert v_out[:, :20].tobytes() == v[:, :20].tobytes()
    assert (k_out[:, 20:] == 7).all() and (v_out[:, 20:] == 7).all()  # beyond n: untouched


def test_slots_have_their_own_files_and_a_kv_cache_slot_round_trips(tmp_path):
    hp = HParams(arch="llama", n_layers=N_LAYERS, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=N_KV,
                 head_dim=HEAD_DIM, rope_dim=HEAD_DIM, rope_base=1e4, norm_eps=1e-5, n_vocab=N_VOCAB,
                 context_length=N_CTX)
    kv, fresh = KVCache(hp, n_slots=4, n_ctx=N_CTX), KVCache(hp, n_slots=4, n_ctx=N_CTX)
    for slot, n in ((0, 5), (3, 12)):
        k, v = kv.slot(slot)
        tokens, k[...], v[...] = state(n, seed=slot)
        save_slot(tmp_path, slot, tokens, k, v, MODEL_FP)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".coli_kv", ".coli_kv.3"]
    assert slot_path(tmp_path, 0) == tmp_path / ".coli_kv"
    assert slot_path(tmp_path, 3) == tmp_path / ".coli_kv.3"
    for slot, n in ((0, 5), (3, 12)):
        got = load_slot(tmp_path, slot, MODEL_FP, *fresh.slot(slot), N_CTX, N_VOCAB)
        assert got == state(n, seed=slot)[0]
        assert np.array_equal(fresh.k[slot, :, :n], kv.k[slot, :, :n])
        assert np.array_equal(fresh.v[slot, :, :n], kv.v[slot, :, :n])
        assert not fresh.k[slot, :, n:].any()
    assert not fresh.k[1].any() and not fresh.k[2].any()
    with pytest.raises(ValueError):
        slot_path(tmp_path, -1)


def test_overwrite_keeps_the_latest_and_empty_history_round_trips(tmp_path):
    save_slot(tmp_path, 2, *state(30, seed=1), MODEL_FP)
    tokens, k, v = state(9, seed=2)
    save_slot(tmp_path, 2, tokens, k, v, MODEL_FP)
    assert slot_path(tmp_path, 2).stat().st_size == file_size(9)
    got, k_out, _ = load(tmp_path, 2)
    assert got == tokens and np.array_equal(k_out[:, :9], k[:, :9])
    save_slot(tmp_path, 2, [], k, v, MODEL_FP)
    assert slot_path(tmp_path, 2).stat().st_size == HEADER_SIZE
    got, k_out, _ = load(tmp_path, 2)
    assert got == [] and (k_out == 7).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".coli_kv.2"]  # no temp left behind


def test_missing_file_is_silent(tmp_path, capsys):
    assert load(tmp_path)[0] is None
    assert load(tmp_path / "no such dir", 4)[0] is None
    assert load_usage(tmp_path, MODEL_FP, (2, 3)) is None
    assert capsys.readouterr().err == ""


def test_save_rejects_bad_arguments(tmp_path):
    tokens, k, v = state(4)
    with pytest.raises(ValueError):
        save_slot(tmp_path, 0, list(range(N_CTX + 1)), k, v, MODEL_FP)
    with pytest.raises(ValueError):
        save_slot(tmp_path, 0, [-1], k, v, MODEL_FP)
    with pytest.raises(ValueError):
        save_slot(tmp_path, 0, tokens, k.astype(np.float32), v, MODEL_FP)
    with pytest.raises(ValueError):
        save_slot(tmp_path, 0, tokens, k, v[:2], MODEL_FP)
    with pytest.raises(ValueError):
        save_slot(tmp_path, 0, tokens, k, v, MODEL_FP[:16])
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_the_previous_file_and_no_temp(saved, monkeypatch):
    d, path, n = saved
    before = path.read_bytes()

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist, "_fsync", broken_fsync)
    with pytest.raises(OSError):
        save_slot(d, 0, *state(5, seed=9), MODEL_FP)
    assert path.read_bytes() == before
    assert [p.name for p in d.iterdir()] == [".coli_kv"]


def test_remove_stale_temps_removes_only_ours(tmp_path):
    save_slot(tmp_path, 0, *state(3), MODEL_FP)
    for name in (".coli_kv.tmp", ".coli_kv.3.tmp", ".coli_usage.tmp", "notes.tmp", ".coli_kv.x.tmp"):
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / ".coli_kv.7.tmp").mkdir()  # not a file: not ours to delete
    assert remove_stale_temps(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".coli_kv", ".coli_kv.7.tmp", ".coli_kv.x.tmp", "notes.tmp"]
    assert remove_stale_temps(tmp_path) == 0
    assert remove_stale_temps(tmp_path / "missing") == 0
    assert load(tmp_path)[0] is not None


# --- every bad file: None and exactly one warning line ------------------------------------------------


@pytest.mark.parametrize("where", ["first token", "first K", "middle of K", "first V", "last byte"])
def test_flipped_payload_byte(saved, capsys, where):
    d, path, n = saved
    k_start = HEADER_SIZE + 4 * n
    v_start = k_start + N_LAYERS * n * ROW
    offset = {"first token": HEADER_SIZE, "first K": k_start, "middle of K": (k_start + v_start) // 2,
              "first V": v_start, "last byte": path.stat().st_size - 1}[where]
    flip(path, offset)
    # A flipped token may be caught as an out-of-range id before the checksum; either way, cold.
    k_out, line = expect_cold(capsys, d)
    if where != "first token":
        assert "checksum" in line
        assert not k_out[:, :n].any() and (k_out[:, n:] == 7).all()  # the read-in-place part is zeroed


def test_flipped_header_byte_at_every_offset(saved, capsys):
    d, path, _ = saved
    good = path.read_bytes()
    for offset in range(HEADER_SIZE):
        path.write_bytes(good)
        flip(path, offset)
        k_out, _ = expect_cold(capsys, d)
        assert (k_out == 7).all()  # rejected before any K/V was read


@pytest.mark.parametrize("keep", [0, 1, 7, 8, 100, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1,
                                  HEADER_SIZE + 80, -ROW, -1])
def test_truncated(saved, capsys, keep):
    d, path, _ = saved
    blob = path.read_bytes()
    path.write_bytes(blob[: keep % len(blob)] if keep >= 0 else blob[:keep])
    expect_cold(capsys, d, fragment="empty file" if keep == 0 else "truncated")


def test_trailing_bytes(saved, capsys):
    d, path, _ = saved
    with open(path, "ab") as f:
        f.write(b"\0")
    expect_cold(capsys, d, fragment="trailing bytes")


def test_wrong_magic_and_text_mode_mangling(saved, capsys):
    d, path, _ = saved
    good = path.read_bytes()
    path.write_bytes(b"COLIKV\0\0" + good[8:])
    expect_cold(capsys, d, fragment="bad magic")
    path.write_bytes(good.replace(b"\r\n", b"\n"))  # a CRLF -> LF conversion by a text-mode copy
    expect_cold(capsys, d, fragment="bad magic")
    path.write_bytes(good.replace(b"\n", b"\r\n"))  # and LF -> CRLF
    expect_cold(capsys, d, fragment="bad magic")
    save_usage(d, np.ones(4, np.float32), MODEL_FP)
    os.replace(d / ".coli_usage", path)  # a usage file is never read as a slot
    expect_cold(capsys, d, fragment="bad magic")


@pytest.mark.parametrize("version, word", [(3, "newer"), (1, "older")])
def test_other_format_version(saved, capsys, version, word):
    d, path, _ = saved
    rewrite_header(path, version=version)
    expect_cold(capsys, d, fragment=word)


def test_foreign_files(saved, capsys):
    d, _, n = saved
    expect_cold(capsys, d, fragment="another model", model_fp=hashlib.sha256(b"model b").digest())
    # a cache of another element type, or of another shape, than the file's
    expect_cold(capsys, d, fragment="another KV cache layout", dtype=np.float32)
    for other in ((N_LAYERS + 1, N_CTX, N_KV, HEAD_DIM), (N_LAYERS, N_CTX, N_KV * 2, HEAD_DIM),
                  (N_LAYERS, N_CTX, N_KV, HEAD_DIM * 2)):
        expect_cold(capsys, d, fragment="another KV cache layout", shape=other)
    expect_cold(capsys, d, fragment=f"{n} tokens exceed the context of {n - 1}", max_tokens=n - 1)
    assert load(d, max_tokens=n)[0] is not None


def test_token_id_outside_the_vocabulary(tmp_path, capsys):
    tokens, k, v = state(6)
    tokens[3] = N_VOCAB
    save_slot(tmp_path, 1, tokens, k, v, MODEL_FP)
    expect_cold(capsys, tmp_path, 1, fragment=f"token id {N_VOCAB} is outside")
    assert load(tmp_path, 1, n_vocab=N_VOCAB + 1)[0] == tokens


def test_well_formed_header_with_inconsistent_lengths(saved, capsys):
    d, path, n = saved
    good = path.read_bytes()
    rewrite_header(path, count=n - 1)
    expect_cold(capsys, d, fragment="does not match")
    path.write_bytes(good)
    rewrite_header(path, reserved=1)
    expect_cold(capsys, d, fragment="flags")


def test_empty_file_directory_and_fifo_in_place_of_the_file(tmp_path, capsys):
    slot_path(tmp_path, 0).write_bytes(b"")
    expect_cold(capsys, tmp_path, 0, fragment="empty file")
    slot_path(tmp_path, 1).mkdir()
    expect_cold(capsys, tmp_path, 1, fragment="is a directory")
    os.mkfifo(slot_path(tmp_path, 2))  # must not block waiting for a writer
    expect_cold(capsys, tmp_path, 2, fragment="not a regular file")


def test_custom_warn_gets_the_message_once(saved, capsys):
    d, path, _ = saved
    flip(path, path.stat().st_size - 1)
    seen: list[str] = []
    k_out, v_out = np.zeros(SHAPE, np.float16), np.zeros(SHAPE, np.float16)
    assert load_slot(d, 0, MODEL_FP, k_out, v_out, N_CTX, N_VOCAB, warn=seen.append) is None
    assert seen == [f"{path}: payload checksum mismatch (damaged file), slot 0 starts cold"]
    assert capsys.readouterr().err == ""


# --- routing heat -----------------------------------------------------------------------------------


def test_usage_round_trip(tmp_path):
    heat = np.random.default_rng(5).random((4, 8)).astype(np.float32)
    save_usage(tmp_path, heat, MODEL_FP)
    path = tmp_path / ".coli_usage"
    assert path.stat().st_size == HEADER_SIZE + heat.nbytes
    got = load_usage(tmp_path, MODEL_FP, (4, 8))
    assert got is not None and got.dtype == np.float32 and got.tobytes() == heat.tobytes()
    save_usage(tmp_path, np.zeros(0, np.float32), MODEL_FP)  # a dense model
    got = load_usage(tmp_path, MODEL_FP, (0,))
    assert got is not None and got.shape == (0,)
    assert [p.name for p in tmp_path.iterdir()] == [".coli_usage"]


def test_usage_bad_files(tmp_path, capsys):
    heat = np.ones((4, 8), np.float32)
    path = tmp_path / ".coli_usage"

    def cold(fragment: str, shape: tuple[int, ...] = (4, 8), model_fp: bytes = MODEL_FP) -> None:
        capsys.readouterr()
        assert load_usage(tmp_path, model_fp, shape) is None
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"colibri: warning: {path}: "), lines
        assert fragment in lines[0] and lines[0].endswith(", routing heat starts cold"), lines

    save_usage(tmp_path, heat, MODEL_FP)
    good = path.read_bytes()
    cold("another model", model_fp=hashlib.sha256(b"model b").digest())
    cold("another expert shape", shape=(8, 4))
    flip(path, len(good) - 1)
    cold("checksum")
    flip(path, 20)
    cold("header checksum")
    path.write_bytes(good[:-3])
    cold("truncated")
    path.write_bytes(b"")
    cold("empty file")
    save_usage(tmp_path, np.full((4, 8), np.nan, np.float32), MODEL_FP)
    cold("non-finite")
    save_slot(tmp_path, 0, *state(2), MODEL_FP)
    os.replace(tmp_path / ".coli_kv", path)
    cold("bad magic")


def test_a_float32_cache_round_trips_and_a_halves_cache_refuses_its_file(tmp_path, capsys):
    """``--kv-type f32``: the payload carries float32, named by the layout fingerprint, so a cache
    of halves (another layout) starts cold on that file rather than reading it as halves."""
    tokens, k, v = state(6)
    k32, v32 = k.astype(np.float32) / 3, v.astype(np.float32) / 3  # not representable as halves
    save_slot(tmp_path, 0, tokens, k32, v32, MODEL_FP)
    assert slot_path(tmp_path, 0).stat().st_size == HEADER_SIZE + 6 * 4 + 2 * N_LAYERS * 6 * ROW * 2
    k_out, v_out = np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)
    assert load_slot(tmp_path, 0, MODEL_FP, k_out, v_out, N_CTX, N_VOCAB) == tokens
    assert k_out[:, :6].tobytes() == k32[:, :6].tobytes() and v_out[:, :6].tobytes() == v32[:, :6].tobytes()
    expect_cold(capsys, tmp_path, fragment="another KV cache layout")  # a cache of halves
    with pytest.raises(ValueError):  # K and V of two types
        save_slot(tmp_path, 0, tokens, k32, v, MODEL_FP)


# --- fingerprints -----------------------------------------------------------------------------------


def test_layout_fingerprint_separates_every_parameter():
    params = [(3, 2, 8), (4, 2, 8), (3, 4, 8), (3, 2, 16), (3, 2, 8, "float32")]
    fps = {layout_fingerprint(*p) for p in params}
    assert len(fps) == 5 and all(len(fp) == 32 for fp in fps)
    assert layout_fingerprint(3, 2, 8) == layout_fingerprint(3, 2, 8, "float16")  # the cache's halves


def write_gguf(path: Path, name: str, weight: float) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("general.name", name)
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("w", np.full((4, 8), weight, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_model_fingerprint_covers_header_and_size_not_weights(tmp_path):
    def fp(name: str, weight: float = 1.0) -> bytes:
        g = GGUFFile(write_gguf(tmp_path / f"{name}-{weight}.gguf", name, weight))
        try:
            return g.fingerprint()
        finally:
            g.close()

    a = fp("tiny")
    assert len(a) == 32 and fp("tiny") == a
    assert fp("tinz") != a  # one metadata byte
    assert fp("tiny", 2.0) == a  # tensor data is not read: the documented limit
    path = tmp_path / "tiny-1.0.gguf"
    with open(path, "ab") as f:
        f.write(b"\0" * 32)
    g = GGUFFile(path)
    assert g.fingerprint() != a  # the size is part of it
    g.close()


# --- atomicity under kill -9 ------------------------------------------------------------------------

# Two states of ~1 MB of K/V (halves) each, built identically in the child and here.
CRASH_STATES = r"""
import numpy as np
def crash_states():
    shape = (2, 1024, 2, 64)
    out = []
    for seed, n in ((11, 1024), (12, 1000)):
        rng = np.random.default_rng(seed)
        out.append((rng.integers(0, 50000, n).tolist(), rng.standard_normal(shape).astype(np.float16),
                    rng.standard_normal(shape).astype(np.float16)))
    return out
"""
CRASH_CHILD = CRASH_STATES + r"""
import sys, hashlib
from pathlib import Path
from colibri.sched.persist import save_slot
d, model_fp = Path(sys.argv[1]), hashlib.sha256(b"crash").digest()
states = crash_states()
print("ready", flush=True)
i = 0
while True:
    save_slot(d, 1, *states[i % 2], model_fp)
    print("saved", flush=True)
    i += 1
"""


def test_sigkill_during_saves_leaves_one_whole_state(tmp_path):
    ns: dict = {}
    exec(CRASH_STATES, ns)
    states = ns["crash_states"]()
    model_fp = hashlib.sha256(b"crash").digest()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    k_out, v_out = np.empty((2, 1024, 2, 64), np.float16), np.empty((2, 1024, 2, 64), np.float16)
    ever_saved, mid_save, seen = 0, 0, set()
    for i in range(50):
        child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, str(tmp_path)], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert child.stdout.readline() == b"ready\n", child.stderr.read().decode()
        time.sleep(rng.uniform(0, 0.04))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        ever_saved += child.stdout.read().count(b"saved\n")
        child.stdout.close()
        child.stderr.close()
        mid_save += (tmp_path / ".coli_kv.1.tmp").exists()
        warnings: list[str] = []
        tokens = load_slot(tmp_path, 1, model_fp, k_out, v_out, 1024, 50000, warn=warnings.append)
        assert warnings == [], f"kill {i} (seed {seed}): {warnings}"
        assert tokens is not None or not ever_saved, f"kill {i} (seed {seed}): no state after a save"
        if tokens is None:
            continue
        which = [j for j, s in enumerate(states) if s[0] == tokens]
        assert len(which) == 1, f"kill {i} (seed {seed}): tokens of neither state"
        _, k, v = states[which[0]]
        n = len(tokens)
        assert np.array_equal(k_out[:, :n], k[:, :n]) and np.array_equal(v_out[:, :n], v[:, :n]), (
            f"kill {i} (seed {seed}): K/V do not belong with the tokens")
        seen.add(which[0])
    assert ever_saved > 0 and mid_save > 0  # the kills did land inside saves
    leftover = int((tmp_path / ".coli_kv.1.tmp").exists())
    assert remove_stale_temps(tmp_path) == leftover
    assert [p.name for p in tmp_path.iterdir()] == [".coli_kv.1"]
    print(f"seed {seed}: {ever_saved} saves, {mid_save} kills left a temp file, states seen {seen}")
