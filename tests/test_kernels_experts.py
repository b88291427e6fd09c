"""The experts' kernel, ``int8_matmul_slots``: a step's experts stacked in one weight, each on the
rows routed to it, activations rounded to ``EXPERT_LEVELS`` (one 8-bit level per 32 values).
Against float64 numpy on the same rounded numbers, and bitwise whatever the other rows and
experts in the call (batch invariance: a decode row gives the same bits alone or batched)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.model.kernels.int8_matmul import EXPERT_LEVELS, int8_matmul_slots, quantize_rows
from colibri.store.blocks import dequantize
from colibri.store.formats import GGMLType, quantize
from colibri.store.packed import KIND_Q4, KIND_Q5, KIND_Q6, KIND_Q8, make_weight

N_EXPERTS, N_ROWS, K = 3, 64, 512  # rows of 512: whole K-quant super-blocks
KINDS = {GGMLType.Q4_0: KIND_Q4, GGMLType.Q4_1: KIND_Q4, GGMLType.Q8_0: KIND_Q8, GGMLType.Q5_0: KIND_Q5,
         GGMLType.Q4_K: KIND_Q4, GGMLType.Q5_K: KIND_Q5, GGMLType.Q6_K: KIND_Q6}


def stacked_experts(rng: np.random.Generator, gtype: GGMLType):
    """(the experts stacked as the store stacks them, each expert's dequantized rows float64)."""
    raws, refs = [], []
    for _ in range(N_EXPERTS):
        w = rng.standard_normal((N_ROWS, K)).astype(np.float32)
        raw = quantize(w, gtype).reshape(N_ROWS, -1)
        raws.append((raw, int(gtype)))
        refs.append(dequantize(raw, gtype, N_ROWS * K).reshape(N_ROWS, K).astype(np.float64))
    return make_weight(raws, K, copy=True), refs


def expert_rows(x: np.ndarray, weight, per: int, slots: list[int], starts: list[int]) -> np.ndarray:
    xq, dx, sx = quantize_rows(x, per, EXPERT_LEVELS)
    out = np.full((x.shape[0], N_ROWS), np.nan, np.float32)
    ids, bounds = np.array(slots, np.int64), np.array(starts, np.int64)
    int8_matmul_slots(xq, dx, sx, weight, N_EXPERTS, ids, bounds, out)
    return out


def test_expert_rows_are_one_level():
    """A row at one level: Q8_0's rounding (max / 127), rebuilt within half that step."""
    assert EXPERT_LEVELS == 1
    x = np.random.default_rng(3).standard_normal((4, K)).astype(np.float32)
    xq, dx, sx = quantize_rows(x, 32, EXPERT_LEVELS)
    assert xq.shape == (4, 1, K) and dx.shape == sx.shape == (4, 1, K // 32)
    np.testing.assert_allclose(dx[:, 0], np.abs(x).reshape(4, -1, 32).max(-1) / 127, rtol=1e-6)
    rebuilt = (xq[:, 0].astype(np.float64).reshape(4, -1, 32) * dx[:, 0, :, None]).reshape(4, K)
    assert np.all(np.abs(rebuilt - x) <= np.repeat(dx[:, 0], 32, axis=1) / 2 * 1.0001)


@pytest.mark.parametrize("gtype", list(KINDS), ids=lambda t: t.name)
def test_each_expert_on_its_rows_is_the_product_on_one_level(gtype: GGMLType):
    rng = np.random.default_rng(int(gtype) + 11)
    weight, refs = stacked_experts(rng, gtype)
    assert weight.kind == KINDS[gtype]
    per = K // weight.q.shape[1]  # values per weight block: 32, or Q6's 16
    x = rng.standard_normal((22, K)).astype(np.float32)
    # a prompt's rows for expert 2 (a tile of eight and one), one row for 0, the rest for 1 (eight, four)
    slots, starts = [2, 0, 1], [0, 9, 10, 22]
    out = expert_rows(x, weight, per, slots, starts)
    xq, dx, _ = quantize_rows(x, per, EXPERT_LEVELS)
    seen = (xq[:, 0].astype(np.float64).reshape(22, -1, per) * dx[:, 0, :, None]).reshape(22, K)
    for i, e in enumerate(slots):
        rows = slice(starts[i], starts[i + 1])
        ref = seen[rows] @ refs[e].T
        bound = 1e-4 * (np.abs(seen[rows]) @ np.abs(refs[e]).T) + 1e-6
        assert np.all(np.abs(out[rows] - ref) <= bound), (gtype.name, e)


@pytest.mark.parametrize("gtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_0], ids=lambda t: t.name)
def test_a_row_gives_the_same_bits_alone_or_among_other_rows_and_experts(gtype: GGMLType):
    rng = np.random.default_rng(int(gtype) + 29)
    weight, _ = stacked_experts(rng, gtype)
    per = K // weight.q.shape[1]
    x = rng.standard_normal((22, K)).astype(np.float32)
    # expert 1's 13 rows take a tile of eight, one of four and one row; expert 0's 8 one tile
    together = expert_rows(x, weight, per, [1, 2, 0], [0, 13, 14, 22])
    for e, a, b in [(1, 0, 13), (2, 13, 14), (0, 14, 22)]:
        for t in range(a, b):
            alone = expert_rows(x[t : t + 1], weight, per, [e], [0, 1])
            np.testing.assert_array_equal(alone[0], together[t], err_msg=f"{gtype.name} expert {e} row {t}")
