"""What the episodic memory's tests share: a memory that collects its warnings, a recall's users."""

from __future__ import annotations

from pathlib import Path

from colibri.sched.memory import EpisodicMemory, Recall

OK, NO_MATCHES, ARCHIVE_EMPTY = 0, 1, 2  # MEM_RESPONSE's status values, as the notes give them


def opened(path: Path | None) -> tuple[EpisodicMemory, list[str]]:
    warnings: list[str] = []
    return EpisodicMemory(path, warn=warnings.append), warnings


def users(recall: Recall) -> list[str]:
    return [t.user for t in recall.turns]
