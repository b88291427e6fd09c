"""Files made by llama.cpp's own quantizer, cached, and the comparison of colibri's logits with
llama.cpp's on the same file (teacher-forced top-1 agreement, decided positions, greedy runs)."""

from __future__ import annotations

import ctypes
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

# The llama.cpp file types the issue names: its most downloaded K-quant mixtures and IQ4_XS.
QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS")
# A position is "decided" when llama.cpp's top-2 logit gap is at least this (the bar).
DECIDED_GAP = 0.5


def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is the peer (make peer)")


def quantized(src: Path, ftype: str, cache: Path) -> Path:
    """``src`` requantized by ``llama_model_quantize`` to ``LLAMA_FTYPE_MOSTLY_<ftype>``, built once
    per source, type and llama.cpp version (a lock keeps parallel test workers from racing)."""
    lib = llama_cpp()
    stat = src.stat()
    out = cache / f"{src.stem}-{stat.st_size}-{int(stat.st_mtime)}-{lib.__version__}-{ftype}.gguf"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            params = lib.llama_model_quantize_default_params()
            params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.allow_requantize = True
            params.nthread = os.cpu_count() or 1
            part = out.with_suffix(".part")
            assert lib.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params)) == 0
            part.rename(out)
    return out


def llama_model(path: Path):
    """The peer with an F32 KV cache: its default F16 cache alone moves logits by ~1e-2."""
    lib = llama_cpp()
    return lib.Llama(str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=os.cpu_count() or 1,
                     type_k=lib.GGML_TYPE_F32, type_v=lib.GGML_TYPE_F32)


@dataclass
class PeerRun:
    """One prompt through llama.cpp: its greedy continuation token by token (``incremental``
    logits), then the whole sequence teacher-forced in one batch (``forced``)."""

    prompt: list[int]
    continuation: list[int]
    incremental: np.ndarray
    forced: np.ndarray


def peer_runs(llm, prompts: list[list[int]], n_new: int) -> list[PeerRun]:
    runs = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        cont: list[int] = []
        for _ in range(n_new):
            cont.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([cont[-1]])
        incremental = np.array(llm.scores[: len(prompt) + n_new])
        llm.reset()
        llm.eval(prompt + cont)
        runs.append(PeerRun(prompt, cont, incremental, np.array(llm.scores[: len(prompt) + n_new])))
    return runs


@dataclass
class Agreement:
    """Top-1 agreement of ``ours`` with a reference over the positions that predict a continuation
    token (the last prompt position on)."""

    agree: int = 0
    total: int = 0
    decided_misses: list[float] = field(default_factory=list)  # reference gaps >= DECIDED_GAP we missed
    top2_diffs: list[float] = field(default_factory=list)  # |ours - ref| at the reference's top two

    def add(self, ref: np.ndarray, ours: np.ndarray, start: int) -> None:
        for pos in range(start, ref.shape[0]):
            top2 = np.argsort(ref[pos])[-2:][::-1]
            hit = int(np.argmax(ours[pos])) == int(top2[0])
            self.agree += hit
            self.total += 1
            gap = float(ref[pos][top2[0]] - ref[pos][top2[1]])
            if not hit and gap >= DECIDED_GAP:
                self.decided_misses.append(round(gap, 2))
            self.top2_diffs.extend(np.abs(ours[pos][top2] - ref[pos][top2]).tolist())

    @property
    def worst_diff(self) -> float:
        return max(self.top2_diffs, default=0.0)

    @property
    def rate(self) -> float:
        return self.agree / max(self.total, 1)

    def __str__(self) -> str:
        return (f"{self.rate:.3f} of {self.total}, decided misses {self.decided_misses}, top-2 logits "
                f"apart by median {np.median(self.top2_diffs):.2f}, at most {self.worst_diff:.2f}")


def sure_prefix(run: PeerRun, gap: float = DECIDED_GAP) -> int:
    """Continuation tokens up to llama.cpp's first near-tie (top-2 gap < ``gap``), token by token."""
    start = len(run.prompt) - 1
    for i in range(len(run.continuation)):
        top2 = np.sort(run.incremental[start + i])[-2:]
        if top2[1] - top2[0] < gap:
            return i
    return len(run.continuation)
