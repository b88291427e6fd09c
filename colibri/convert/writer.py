"""Streaming conversion: header, metadata and tensor directory first, then the data tensor by
tensor, each in row chunks, so converting never holds more than a chunk of a model in memory.

gguf-py's ``GGUFWriter`` writes the header, the metadata and the tensor directory from sizes
alone; the data is written here, source rows converted to float32, permuted where the plan says,
quantized with ``colibri.store.formats``'s reference quantizers and appended at the offsets the
directory promised. A stacked expert tensor is written expert by expert.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import gguf
import numpy as np

from colibri.convert import DEFAULT_TYPE, TYPE_NAMES
from colibri.convert.architectures import make_plan
from colibri.convert.checkpoint_config import ConvertError
from colibri.convert.mixture import ModelFacts, mixture_type
from colibri.convert.plan import Plan, Source, TensorPlan
from colibri.convert.safetensors import Checkpoint
from colibri.convert.vocab import SPM_MODEL, load_vocab
from colibri.store.formats import GGMLType, quantize, row_nbytes
from colibri.store.numerics import BLOCK

TYPES: dict[str, GGMLType] = {
    "f32": GGMLType.F32,
    "f16": GGMLType.F16,
    "q8_0": GGMLType.Q8_0,
    "q4_0": GGMLType.Q4_0,
    "q4_1": GGMLType.Q4_1,
}
# The K-quant mixtures: a type per tensor, chosen by llama.cpp's rules (``colibri.convert.mixture``).
MIXTURES: dict[str, gguf.LlamaFileType] = {
    "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q4_k_s": gguf.LlamaFileType.MOSTLY_Q4_K_S,
    "q5_k_m": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
}
# llama.cpp's MXFP4_MOE: the experts' 3-D tensors MXFP4 (gpt-oss's own format), the other matrices Q8_0.
MXFP4_MOE = "mxfp4_moe"
assert (*TYPES, *MIXTURES, MXFP4_MOE) == TYPE_NAMES
# general.file_type (llama.cpp's LlamaFileType) of a file whose matrices are of that type.
FILE_TYPES: dict[str, gguf.LlamaFileType] = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    **MIXTURES,
    MXFP4_MOE: gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
}
# Float32 bytes of source rows converted at a time. The quantizers make a few temporaries of this
# size, so a conversion's resident set stays within a small multiple of it, whatever the model.
CHUNK_BYTES = 8 * 2**20
PROGRESS_INTERVAL_S = 0.1  # redraw the progress bar at most this often
PROGRESS_WIDTH = 30  # characters of bar
PART_SUFFIX = ".part"  # the output is written beside its final name and renamed when complete


def tensor_type(t: TensorPlan, type_name: str, facts: ModelFacts | None = None) -> GGMLType:
    """Vectors, norms and routers stay F32; a quantized type needs rows of whole blocks, else the
    matrix falls back to F16 (as llama.cpp's converter does). A mixture picks per tensor, with
    ``facts`` about the model (``model_facts``)."""
    if t.gtype is not None:
        return GGMLType(t.gtype)
    if not t.quantizable or len(t.shape) == 1:
        return GGMLType.F32
    if type_name in MIXTURES:
        assert facts is not None
        return mixture_type(t.name, t.shape, MIXTURES[type_name], facts)
    if type_name == MXFP4_MOE:
        requested = GGMLType.MXFP4 if len(t.shape) == 3 else GGMLType.Q8_0
    else:
        requested = TYPES[type_name]
    # a quantized row must hold whole blocks (Q8_0, Q4_0 and Q4_1: BLOCK values each)
    if requested in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.MXFP4) and t.shape[-1] % BLOCK:
        return GGMLType.F16
    return requested


def model_facts(plan: Plan) -> ModelFacts:
    """What the mixture rules read of the model: from the metadata and the tensor names."""
    meta = {key: value for key, value, _ in plan.metadata}
    n_layer = int(meta[f"{plan.arch}.block_count"])
    n_head = meta.get(f"{plan.arch}.attention.head_count")
    n_head_kv = meta.get(f"{plan.arch}.attention.head_count_kv", n_head)
    return ModelFacts(
        n_layer=n_layer,
        n_expert=int(meta.get(f"{plan.arch}.expert_count", 0)),
        tied=all(t.name != "output.weight" for t in plan.tensors),
        llama_70b=plan.arch == "llama" and n_layer == 80 and n_head != n_head_kv,
    )


def chunks(ckpt: Checkpoint, t: TensorPlan) -> Iterator[np.ndarray]:
    """The tensor's values as float32 (rows, cols) chunks, in file order, expert by expert. The
    source's pages are dropped from this process after every chunk (a view of them stays valid:
    it faults them back in from the page cache), so a huge tensor is never resident whole."""
    if t.gtype is not None:  # the checkpoint's own blocks
        yield from mxfp4_chunks(ckpt, t)
        return
    if t.values is not None:  # computed from the config (Llama 3's rope_freqs)
        yield np.array(t.values, dtype=np.float32).reshape(1, -1)
        return
    if len(t.shape) == 1:  # a vector: one row, permuted element-wise (a llama q/k bias)
        (src,) = t.sources
        order = src.row_order(t.shape[0])
        row = ckpt.rows(src.name, 0, 1, src.expert).reshape(1, -1)
        row = row if order is None else row[:, order]
        yield row + np.float32(src.shift) if src.shift else row  # Gemma's norms: 1 + w
        ckpt.release(src.name)
        return
    rows, cols = t.part_shape
    step = max(1, CHUNK_BYTES // (4 * cols))
    for src in t.sources:
        first = src.rows[0] if src.rows else 0
        if src.transposed:  # a head's (an expert's) block: read whole, written column by column
            block = picked_columns(ckpt.rows(src.name, first, first + cols, src.expert), src)
            yield np.ascontiguousarray(block.T)
            ckpt.release(src.name)
            continue
        order = src.row_order(rows)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            if order is None:
                yield picked_columns(ckpt.rows(src.name, first + start, first + stop, src.expert), src)
            else:
                yield picked_columns(ckpt.rows(src.name, start, stop, src.expert, order + first), src)
            ckpt.release(src.name)


def mxfp4_chunks(ckpt: Checkpoint, t: TensorPlan) -> Iterator[np.ndarray]:
    """An MXFP4 tensor's GGUF bytes, expert by expert, from a checkpoint's ``_blocks`` (32 values a
    block, two a byte: value 2i in the low nibble of byte i, 2i + 1 in the high one) and ``_scales``
    (the E8M0 exponent, bias 127): GGUF's blocks are the exponent byte, then value j in the low
    nibble of byte j and j + 16 in the high one (ggml-common.h); the E2M1 codes and the exponent
    carry over as they are (ggml's grid is E2M1's doubled, its scale the exponent's power halved)."""
    for src in t.sources:
        assert src.scales is not None
        blocks, scales = ckpt.raw(src.name)[src.expert], ckpt.raw(src.scales)[src.expert]
        if src.columns is not None:
            first, step = src.columns
            blocks, scales = blocks[first::step], scales[first::step]
        codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
        nibbles = codes[..., :16] | (codes[..., 16:] << 4)
        yield np.concatenate([scales[..., None], nibbles], axis=-1).reshape(blocks.shape[0], -1)
        ckpt.release(src.name)
        ckpt.release(src.scales)


def picked_columns(block: np.ndarray, src: Source) -> np.ndarray:
    """The columns ``src`` takes (every ``step``-th from ``first``), contiguous; all where it says none."""
    if src.columns is None:
        return block
    first, step = src.columns
    return np.ascontiguousarray(block[:, first::step])


class Progress:
    """A one-line progress bar on a terminal: tensors and bytes written. Silent elsewhere."""

    def __init__(self, n_tensors: int, n_bytes: int, stream: IO[str] | None) -> None:
        self.n_tensors, self.n_bytes, self.stream = n_tensors, max(n_bytes, 1), stream
        self.tensors = self.bytes = 0
        self.last = 0.0

    def advance(self, n_bytes: int, tensor_done: bool = False) -> None:
        self.bytes += n_bytes
        self.tensors += tensor_done
        now = time.monotonic()
        due = now - self.last >= PROGRESS_INTERVAL_S or self.tensors == self.n_tensors
        if self.stream is not None and due:
            self.last = now
            frac = self.bytes / self.n_bytes
            bar = "#" * int(frac * PROGRESS_WIDTH)
            self.stream.write(f"\rconverting {frac:4.0%} [{bar:<{PROGRESS_WIDTH}}] "
                              f"{self.tensors}/{self.n_tensors} tensors  "
                              f"{self.bytes / 2**20:.1f}/{self.n_bytes / 2**20:.1f} MiB")
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


@dataclass(frozen=True)
class Summary:
    path: Path
    arch: str
    n_tensors: int
    nbytes: int
    type_counts: dict[str, int]


def read_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir}: not a directory")
    if not path.is_file():
        raise ConvertError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: cannot read ({e})") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return config


def convert(
    hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], type_name: str = DEFAULT_TYPE, *,
    progress: IO[str] | None = None, warn: Callable[[str], None] | None = None,
) -> Summary:
    """Convert the checkpoint in ``hf_dir`` to the GGUF file ``out``; matrices as ``type_name``.

    ``progress``: a stream for the progress bar (drawn only if it is a terminal). ``warn``: called
    with each warning line. Raises ColibriError (ConvertError, SafetensorsError) on a bad input;
    ``out`` is then left untouched.
    """
    if type_name not in FILE_TYPES:
        raise ConvertError(f"--type {type_name!r}: one of {', '.join(FILE_TYPES)}")
    hf_dir, out = Path(hf_dir), Path(out)
    if not out.parent.is_dir():  # before an hour of work, not after
        raise ConvertError(f"{out}: cannot write: no directory {out.parent}")
    config = read_config(hf_dir)
    ckpt = Checkpoint(hf_dir)
    try:
        plan = make_plan(config, {n: e.shape for n, e in ckpt.entries.items()})
        vocab = load_vocab(hf_dir, config, plan.n_vocab)
        if plan.add_space_prefix is not None and vocab.model == SPM_MODEL:
            vocab.add_space_prefix = plan.add_space_prefix
        for line in [*plan.warnings, *([vocab.warning] if vocab.warning else [])]:
            if warn is not None:
                warn(line)
        tmp = out.with_name(out.name + PART_SUFFIX)
        try:
            summary = _write(ckpt, plan, vocab, tmp, type_name, config, hf_dir,
                             progress if progress is not None and progress.isatty() else None)
            os.replace(tmp, out)
        except OSError as e:
            raise ConvertError(f"{out}: cannot write: {e.strerror or e}") from None
        finally:
            tmp.unlink(missing_ok=True)
    finally:
        ckpt.close()
    return Summary(out, summary.arch, summary.n_tensors, summary.nbytes, summary.type_counts)


def _write(ckpt: Checkpoint, plan: Plan, vocab, path: Path, type_name: str, config: dict, hf_dir: Path,
           stream: IO[str] | None) -> Summary:
    w = gguf.GGUFWriter(path, plan.arch)
    try:
        w.add_name(str(config.get("_name_or_path") or hf_dir.resolve().name))
        w.add_file_type(FILE_TYPES[type_name])
        for key, value, vtype in plan.metadata:
            w.add_key_value(key, value, vtype)
        vocab.write(w)
        types: list[GGMLType] = []
        facts = model_facts(plan) if type_name in MIXTURES else None
        for t in plan.tensors:
            gtype = tensor_type(t, type_name, facts)
            byte_shape = (*t.shape[:-1], row_nbytes(gtype, t.shape[-1]))
            nbytes = int(np.prod(byte_shape))
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType(int(gtype)))
            types.append(gtype)
        total = sum(ti.nbytes for ti in w.tensors[0].values())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == 1
        fout = w.fout[0]
        bar = Progress(len(plan.tensors), total, stream)
        try:
            for t, gtype in zip(plan.tensors, types, strict=True):
                w.write_padding(fout, fout.tell())
                written = 0
                for chunk in chunks(ckpt, t):
                    data = chunk.reshape(-1) if t.gtype is not None else quantize(chunk, gtype)
                    fout.write(memoryview(data))
                    written += data.nbytes
                    bar.advance(data.nbytes)
                expected = w.tensors[0][t.name].nbytes
                if written != expected:  # the plan's shapes were checked; this is a bug
                    raise AssertionError(f"{t.name}: wrote {written} bytes, expected {expected}")
                w.write_padding(fout, fout.tell())
                bar.advance(0, tensor_done=True)
        finally:
            bar.close()
    finally:
        w.close()
    counts: dict[str, int] = {}
    for g in types:
        counts[g.name] = counts.get(g.name, 0) + 1
    return Summary(path, plan.arch, len(plan.tensors), total, counts)


def main_warn(line: str) -> None:
    print(f"coli: warning: {line}", file=sys.stderr)
