"""The decoder calls its layers through entry points (``decoder.Entry``), not numba's dispatcher:
the same logits, whatever dtype the caller's slot and position arrays have."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.model.kv_cache import KVCache
from colibri.model.loader import Model
from colibri.model.network.decoder import Entry, same_types
from colibri.model.network.layers import dense_layer


def forward(model: Model, kv: KVCache, tokens: list[int], start: int,
            slot_dtype: type = np.int64) -> np.ndarray:
    n = len(tokens)
    positions = np.arange(start, start + n).astype(slot_dtype)
    return model.forward(np.asarray(tokens, np.int64), np.zeros(n, slot_dtype), positions, kv, np.arange(n),
                         n_direct=int(n == 1))


def test_the_layers_are_entry_points_and_give_the_dispatchers_logits(model):
    decoder = model.decoder
    assert isinstance(decoder.dense_layer, Entry)
    prompt, step = [1, 9690, 28, 2286, 314], [3458]
    kv_entry, kv_dispatch = model.new_kv_cache(1, 16), model.new_kv_cache(1, 16)
    entry_logits = [forward(model, kv_entry, prompt, 0), forward(model, kv_entry, step, len(prompt))]
    try:
        decoder.dense_layer = dense_layer
        dispatch_logits = [forward(model, kv_dispatch, prompt, 0),
                           forward(model, kv_dispatch, step, len(prompt))]
    finally:
        decoder.dense_layer = Entry(dense_layer)
    for a, b in zip(entry_logits, dispatch_logits, strict=True):
        assert np.array_equal(a, b)


def test_int32_slots_and_positions_are_normalized_not_misread(model):
    prompt = [1, 9690, 28, 2286, 314]
    wide = forward(model, model.new_kv_cache(1, 16), prompt, 0, np.int64)
    narrow = forward(model, model.new_kv_cache(1, 16), prompt, 0, np.int32)
    assert np.array_equal(wide, narrow)


def test_same_types_tells_a_layer_argument_that_types_differently():
    f32, f64 = np.zeros(4, np.float32), np.zeros(4, np.float64)
    assert same_types(dense_layer, [f32, np.ones(8, np.float32)])
    assert not same_types(dense_layer, [f32, f64])
    assert not same_types(dense_layer, [f32, np.zeros((2, 2), np.float32)])


def test_soft_rows_of_the_wrong_shape_are_refused_not_misread(model):
    kv = model.new_kv_cache(1, 16)
    bad = np.zeros(model.hp.n_embd, np.float32)  # one row, but 1-D
    with pytest.raises(ValueError, match="soft input rows"):
        model.forward(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), kv,
                      np.zeros(1, np.int64), 1, bad)
