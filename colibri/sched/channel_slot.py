"""The Channel session's work on its slot outside any request: soft inputs and context fed without
sampling, probes, snapshots. The core lends the slot between steps (``Engine.exclusive``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import trio

from colibri.io import channel_frames as cf
from colibri.sched import persist
from colibri.sched.engine import Engine
from colibri.sched.probe import run_probe

SOFT_ROW_TOKEN = 0  # a soft input row's place in a slot's history: only this session reads it there


def soft_rows(data: bytes, dim: int) -> np.ndarray | str:
    """STREAM_INPUT's EMBEDDINGS payload as float32 rows of ``dim``, or why it is not that."""
    rows = np.frombuffer(data, "<f2")
    if rows.size == 0 or rows.size % dim:
        return f"soft embeddings must be rows of {dim} f16 values"
    embeds = rows.reshape(-1, dim).astype(np.float32)
    if not np.isfinite(embeds).all():
        return "non-finite soft embeddings"
    return embeds


async def extend(engine: Engine, slot: int, tokens: list[int], embeds: np.ndarray | None = None) -> None:
    """Prefill ``tokens`` then the soft rows ``embeds`` ([rows, n_embd]) onto the slot's history
    without sampling, in the engine's prefill chunks. Rows that would pass the cache's end are
    refused whole, before any is computed (KVBoundsError: the session checked its context)."""
    history = engine.slots[slot].history

    def run() -> None:
        soft = [SOFT_ROW_TOKEN] * (0 if embeds is None else len(embeds))
        rows_at(engine, slot, len(history), len(tokens) + len(soft))
        for ids, rows in ((tokens, None), (soft, embeds)):
            for at in range(0, len(ids), engine.prefill_chunk):
                part = ids[at : at + engine.prefill_chunk]
                start = len(history)
                engine.model.forward(
                    np.asarray(part, np.int64), np.full(len(part), slot, np.int64),
                    np.arange(start, start + len(part), dtype=np.int64), engine.kv,
                    np.asarray([len(part) - 1], np.int64), 0,
                    None if rows is None else rows[at : at + engine.prefill_chunk])
                history.extend(part)

    await engine.exclusive(run)


def rows_at(engine: Engine, slot: int, start: int, n: int) -> None:
    """KVBoundsError unless ``n`` rows of ``slot`` from position ``start`` fit the cache."""
    engine.kv.check_rows(np.full(n, slot, np.int64), np.arange(start, start + n, dtype=np.int64))


async def sync(engine: Engine, slot: int, context: list[int]) -> None:
    """Feed the context's tail (the last sampled token) so the slot holds all of ``context``."""
    history = engine.slots[slot].history
    if history != context[: len(history)]:
        history.clear()  # another protocol's leftovers: start the slot over
    if len(context) > len(history):
        await extend(engine, slot, context[len(history):])


async def probe(engine: Engine, slot: int, prompt: list[int], candidates: list[int],
                max_decode: int) -> cf.AutonomicResult:
    """PROBE_AUTONOMIC on ``slot`` (``probe.py``); the caller checked the room (checked again here:
    the prompt's rows and the micro-decode's, all but its last token fed)."""
    start = len(engine.slots[slot].history)
    rows_at(engine, slot, start, len(prompt) + max(max_decode, 1) - 1)
    return await engine.exclusive(run_probe, engine.model, engine.kv, slot, start, prompt, candidates,
                                  max_decode, engine.stop_ids)


async def save_snapshot(engine: Engine, slot: int, path: Path, meta: bytes) -> None:
    """The slot's history and K/V, and ``meta``, at ``path`` (crash-safe); OSError/ValueError. Called
    with no request on the slot (the session answers BUSY during a turn)."""
    history = list(engine.slots[slot].history)
    await trio.to_thread.run_sync(lambda: persist.save_snapshot(
        path, history, *engine.kv.slot(slot), engine.kv_fp, meta))


# What a snapshot keeps of the session beside the slot: (stream id, messages, SET_SYSTEM's object,
# the last role, tool calls waiting (id -> name), the next call id).
SessionState = tuple[str, list, dict | None, str | None, dict[int, str], int]
_STATE_KEYS = ("stream_id", "messages", "system", "prev_role", "calls", "next_call")


def meta_of(state: SessionState) -> bytes:
    return json.dumps(dict(zip(_STATE_KEYS, state, strict=True)), ensure_ascii=False).encode()


def state_of(meta: bytes) -> SessionState:
    """``meta_of``'s inverse; ValueError, KeyError or TypeError for metadata it did not write."""
    m = json.loads(meta)
    return (str(m["stream_id"]), list(m["messages"]), m["system"], m["prev_role"],
            {int(k): str(v) for k, v in dict(m["calls"]).items()}, int(m["next_call"]))


async def load_snapshot(engine: Engine, slot: int, path: Path) -> bytes:
    """Replace the slot's state with the snapshot at ``path``; its metadata. One that cannot be
    loaded raises persist.SnapshotError and leaves the slot as it was."""

    def run() -> bytes:
        tokens, meta = persist.load_snapshot(path, engine.kv_fp, *engine.kv.slot(slot), engine.n_ctx,
                                             engine.model.hp.n_vocab)
        engine.slots[slot].history = tokens
        return meta

    return await engine.exclusive(run)
