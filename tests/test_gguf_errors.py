"""The GGUF reader on small files written here: a valid one reads back zero-copy, and every defect
is a GGUFError that names the file (and the tensor, where there is one), also through `coli`."""

from __future__ import annotations

import mmap
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

from colibri.settings import default_model_path
from colibri.store.formats import GGMLType, quantize
from colibri.store.gguf import GGUFError, GGUFFile

ALIGN = 32


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def build(
    tensors: list[tuple[str, tuple[int, ...], int, bytes]],
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    offsets: dict[str, int] | None = None,
) -> tuple[bytes, dict[str, int]]:
    """A GGUF file by hand: (bytes, section boundaries). ``offsets`` overrides a tensor's offset."""
    kv = [("general.architecture", 8, _str("llama")), ("general.name", 8, _str("tiny")),
          ("llama.block_count", 4, struct.pack("<I", 1))]
    header = magic + struct.pack("<IQQ", version, len(tensors), len(kv))
    meta = b"".join(_str(k) + struct.pack("<I", t) + v for k, t, v in kv)
    directory, data = b"", b""
    for name, shape, type_id, payload in tensors:
        data += b"\0" * (-len(data) % ALIGN)  # no padding after the last tensor: the file ends with it
        off = (offsets or {}).get(name, len(data))
        dims = b"".join(struct.pack("<Q", d) for d in shape)
        directory += _str(name) + struct.pack("<I", len(shape)) + dims + struct.pack("<IQ", type_id, off)
        data += payload
    head = header + meta + directory
    pad = b"\0" * (-len(head) % ALIGN)
    marks = {"header": len(header), "meta": len(header) + len(meta), "directory": len(head),
             "data": len(head) + len(pad)}
    return head + pad + data, marks


def q8_tensor(name: str, rows: int = 2, cols: int = 64) -> tuple[str, tuple[int, ...], int, bytes]:
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    return name, (cols, rows), int(GGMLType.Q8_0), quantize(w, GGMLType.Q8_0).tobytes()


def write(tmp_path: Path, name: str, blob: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(GGUFError) as exc:
        GGUFFile(path)
    msg = str(exc.value)
    assert str(path) in msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


@pytest.fixture
def valid(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A small file from the reference writer (gguf-py): F32, F16 and Q8_0 tensors."""
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 8)).astype(np.float32)
    f16 = rng.standard_normal((2, 16)).astype(np.float16)
    q8 = quantize(rng.standard_normal((4, 64)), GGMLType.Q8_0).reshape(4, -1)
    path = tmp_path / "valid.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 7)
    w.add_string("general.name", "tiny")
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "日本"])
    w.add_tensor("f32", f32)
    w.add_tensor("f16", f16)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, {"f32": f32, "f16": f16, "q8": q8}


def test_valid_file_opens_with_metadata_and_directory(valid):
    path, arrays = valid
    g = GGUFFile(path)
    assert g.version == 3
    assert g.get("general.architecture") == "llama"
    assert g.get("llama.block_count") == 7
    assert g.get("general.name") == "tiny"
    assert g.get("llama.rope.freq_base") == pytest.approx(10000.0)
    assert g.get("tokenizer.ggml.tokens") == ["a", "b", "日本"]
    assert g.get("missing", 5) == 5
    assert g.tensors["f32"].shape == (8, 3) and g.tensors["f32"].gtype == GGMLType.F32
    assert g.tensors["f16"].gtype == GGMLType.F16
    assert g.tensors["q8"].shape == (64, 4) and g.tensors["q8"].gtype == GGMLType.Q8_0
    assert g.tensors["q8"].nbytes == 4 * 2 * 34
    assert g.require_supported("q8") is g.tensors["q8"]
    for info in g.tensors.values():
        assert info.offset % ALIGN == 0
        assert info.offset + info.nbytes <= g.file_size


def test_raw_is_a_read_only_zero_copy_view(valid):
    path, arrays = valid
    g = GGUFFile(path)
    whole = np.frombuffer(g._map, dtype=np.uint8)
    for name, arr in arrays.items():
        view = g.raw(name)
        assert view.dtype == np.uint8
        assert view.shape == (arr.shape[0], arr.nbytes // arr.shape[0])
        assert view.tobytes() == arr.tobytes()
        assert not view.flags.writeable
        assert np.shares_memory(view, whole)
        base = view
        while isinstance(base, np.ndarray | memoryview):
            base = base.base if isinstance(base, np.ndarray) else base.obj
        assert base is g._map and isinstance(base, mmap.mmap)
        with pytest.raises(ValueError):
            view[0, 0] = 1
    assert np.array_equal(g.raw("f32").view(np.float32), arrays["f32"])


def test_hand_built_file_opens(tmp_path):
    blob, _ = build([q8_tensor("a"), q8_tensor("b", rows=3)])
    g = GGUFFile(write(tmp_path, "ok.gguf", blob))
    assert set(g.tensors) == {"a", "b"}
    assert g.raw("b").shape == (3, 68)


@pytest.mark.parametrize("where", ["header", "meta", "directory", "data"])
def test_truncated_file(tmp_path, where):
    blob, marks = build([q8_tensor("blk.0.attn_q.weight"), q8_tensor("blk.0.attn_k.weight")])
    start = {"header": 0, "meta": marks["header"], "directory": marks["meta"], "data": marks["data"]}[where]
    end = {"header": marks["header"], "meta": marks["meta"], "directory": marks["directory"],
           "data": len(blob)}[where]
    cuts = sorted({start + 1, (start + end) // 2, end - 1} - {0})
    assert cuts
    for cut in cuts:
        path = write(tmp_path, f"cut{cut}.gguf", blob[:cut])
        msg = expect_error(path)
        assert "truncated" in msg or "past the end" in msg, msg
        if where == "data":
            assert "blk.0.attn_" in msg, msg


def test_empty_and_missing_files(tmp_path):
    expect_error(write(tmp_path, "empty.gguf", b""), "truncated")
    expect_error(tmp_path / "nope.gguf", "cannot open")
    expect_error(tmp_path, "cannot open")  # a directory


def test_bad_magic(tmp_path):
    blob, _ = build([q8_tensor("a")], magic=b"GGML")
    expect_error(write(tmp_path, "magic.gguf", blob), "magic")


@pytest.mark.parametrize("version", [1, 4, 0xFFFFFFFF])
def test_unsupported_version(tmp_path, version):
    blob, _ = build([q8_tensor("a")], version=version)
    expect_error(write(tmp_path, f"v{version}.gguf", blob), "version", str(version))


def test_version_2_is_read(tmp_path):
    blob, _ = build([q8_tensor("a")], version=2)
    assert GGUFFile(write(tmp_path, "v2.gguf", blob)).version == 2


def test_tensor_data_past_end(tmp_path):
    blob, _ = build([q8_tensor("a"), q8_tensor("output.weight")], offsets={"output.weight": 4096})
    expect_error(write(tmp_path, "past.gguf", blob), "'output.weight'", "past the end")


def test_unknown_block_type(tmp_path):
    blob, _ = build([q8_tensor("a"), ("token_embd.weight", (32, 2), 99, b"\0" * 64)])
    expect_error(write(tmp_path, "type99.gguf", blob), "'token_embd.weight'", "99")


def test_row_not_whole_blocks(tmp_path):
    blob, _ = build([("odd", (48, 1), int(GGMLType.Q8_0), b"\0" * 68)])
    expect_error(write(tmp_path, "odd.gguf", blob), "'odd'", "Q8_0")


@pytest.mark.parametrize("shape", [(32, 2**62, 4), (2**64 - 32, 1), (0, 2)])
def test_corrupt_shape_overflowing_the_element_count(tmp_path, shape):
    blob, _ = build([("blk.0.ffn_up.weight", shape, int(GGMLType.Q8_0), b"")])
    expect_error(write(tmp_path, "huge.gguf", blob), "'blk.0.ffn_up.weight'")


def test_known_but_unsupported_type_opens_then_require_supported_raises(tmp_path):
    blob, _ = build([q8_tensor("a"), ("ffn_down.weight", (256, 2), 16, b"\0" * 132)])
    path = write(tmp_path, "iq2.gguf", blob)
    g = GGUFFile(path)
    assert g.tensors["ffn_down.weight"].gtype == GGMLType.IQ2_XXS
    assert g.raw("ffn_down.weight").shape == (2, 66)
    with pytest.raises(GGUFError) as exc:
        g.require_supported("ffn_down.weight")
    message = str(exc.value)
    assert str(path) in message and "'ffn_down.weight'" in message and "IQ2_XXS" in message
    with pytest.raises(GGUFError, match="missing"):
        g.require_supported("nope")


def _coli_info(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "colibri", "info", "--model", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_cli_reports_bad_files_in_one_line(tmp_path):
    bad_version = write(tmp_path, "v4.gguf", build([q8_tensor("a")], version=4)[0])
    blob, marks = build([q8_tensor("a")])
    truncated = write(tmp_path, "cut.gguf", blob[: marks["meta"] - 3])
    for path in (bad_version, truncated):
        proc = _coli_info(path)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("coli: error:")
        assert str(path) in lines[0]
        assert "Traceback" not in proc.stderr + proc.stdout


@pytest.fixture(scope="module")
def default_model() -> Path:
    return default_model_path()


def test_open_real_model_maps_instead_of_reading(default_model: Path):
    script = textwrap.dedent(
        """
        import os, resource, sys
        import numpy  # loaded before the first measurement
        from colibri.store.gguf import GGUFFile

        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        def peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        before, peak_before = rss(), peak()
        g = GGUFFile(sys.argv[1])
        assert len(g.tensors) > 0
        print(rss() - before, peak() - peak_before, g.file_size)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script, str(default_model)],
                          capture_output=True, text=True, timeout=120, check=True)
    delta, peak_delta, size = map(int, proc.stdout.split())
    assert size == default_model.stat().st_size > 10 * 2**20
    assert delta < 0.25 * size, (delta, size)
    assert peak_delta < 0.25 * size, (peak_delta, size)


def test_read_into_reads_the_open_file_and_refuses_past_its_end(tmp_path: Path):
    """The expert store's misses: ``pread`` gives the mapping's bytes, from the file that was opened
    even after another is renamed over its path, and a read past the end is a GGUFError."""
    src = default_model_path()
    path = tmp_path / "model.gguf"
    path.write_bytes(src.read_bytes())
    g = GGUFFile(path)
    info = g.tensors["blk.0.ffn_down.weight"]
    out = np.empty(info.nbytes, np.uint8)
    g.read_into(info.offset, out)
    assert (out == g.raw("blk.0.ffn_down.weight").reshape(-1)).all()
    other = tmp_path / "other.gguf"
    other.write_bytes(b"\0" * g.file_size)
    other.replace(path)
    again = np.empty_like(out)
    g.read_into(info.offset, again)
    assert (again == out).all()
    with pytest.raises(GGUFError, match="runs past the end"):
        g.read_into(g.file_size - 8, np.empty(16, np.uint8))
    g.close()
