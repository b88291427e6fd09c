"""The numba kernels against plain numpy: quantized matmul (decode and prompt rows, every supported
block type, stacked weights), row dequantization, RMSNorm, RoPE, SwiGLU and attention."""

from __future__ import annotations

import os
import subprocess
import sys

import llvmlite.binding as llvm
import numba as nb
import numpy as np
import pytest

from colibri.model.kernels.attention import attend, store_kv
from colibri.model.kernels.int8_matmul import LEVELS, int8_matmul, quantize_rows
from colibri.model.kernels.ops import add_into, exp_into, rmsnorm, rope, rope_frequencies, swiglu
from colibri.model.kernels.quant_matmul import qmatmul
from colibri.model.kernels.simd import LANES, load_floats, store_floats, sum_lanes, sum_lanes16
from colibri.store.blocks import IN_PLACE, dequantize, dequantize_row
from colibri.store.formats import BLOCK_GEOMETRY, SUPPORTED, GGMLType, quantize
from colibri.store.packed import (
    KIND_F32,
    KIND_Q4,
    KIND_Q5,
    KIND_Q8,
    make_weight,
    packed_nbytes,
    weight_nbytes,
)

TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1]

T_ROWS = [1, 3, 16, 17, 100]
EXPECTED_KIND = {GGMLType.Q8_0: KIND_Q8, GGMLType.Q4_0: KIND_Q4, GGMLType.Q4_1: KIND_Q4}


def quantized(rng: np.random.Generator, n: int, k: int, gtype: GGMLType) -> tuple[np.ndarray, np.ndarray]:
    """(raw rows uint8 [n, row_bytes], their reference dequantization float32 [n, k])."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, gtype).reshape(n, -1)
    return raw, dequantize(raw, gtype, n * k).reshape(n, k)


def rounded_activations(x: np.ndarray) -> np.ndarray:
    """x as the integer matmul sees it: its own LEVELS 8-bit levels per 32 values
    (``quantize_rows``, checked on its own by ``test_quantize_rows_levels``), summed in float64."""
    xq, dx, _ = quantize_rows(np.ascontiguousarray(x, np.float32), 32, LEVELS)
    blocks = xq.astype(np.float64).reshape(x.shape[0], LEVELS, -1, 32) * dx[..., None]
    return blocks.sum(1).reshape(x.shape)


def test_quantize_rows_levels():
    """Each 32 values as LEVELS 8-bit levels: the first Q8_0's scale (max / 127) and each next 254
    times finer, quants in [-127, 127], their integer sums per 32 and per 16 values, and the row
    rebuilt within half a last-level step of each value (the bound the matmul tests rest on)."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((6, 256)).astype(np.float32) * np.float32(3.0)
    x[1] = 0.0  # an all-zero row: zero scales, zero quants
    x[2, :32] = np.float32(1e-30)  # tiny values
    x[3, :64] = rng.choice(np.array([-1.5, 0.5, 127.0], np.float32), 64)  # ties and exact steps
    x[4] *= np.float32(1e6)
    for per in (32, 16):
        xq, dx, sx = quantize_rows(x, per, LEVELS)
        assert xq.shape == (6, LEVELS, 256) and dx.shape == sx.shape == (6, LEVELS, 256 // per)
        assert np.abs(xq.astype(np.int32)).max() <= 127
        assert np.array_equal(sx, xq.astype(np.int32).reshape(6, LEVELS, -1, per).sum(-1))
        amax = np.repeat(np.abs(x).reshape(6, -1, 32).max(-1), 32 // per, axis=1)
        np.testing.assert_allclose(dx[:, 0], amax / 127, rtol=1e-6)
        for level in range(1, LEVELS):
            np.testing.assert_allclose(dx[:, level], dx[:, level - 1] / 254, rtol=1e-6)
        rebuilt = (xq.astype(np.float64).reshape(6, LEVELS, -1, per) * dx[..., None]).sum(1).reshape(6, -1)
        half_step = np.repeat(dx[:, -1].astype(np.float64), per, axis=1) / 2
        assert np.all(np.abs(rebuilt - x) <= half_step * 1.0001 + 1e-45)
    assert not xq[1].any() and not dx[1].any()


def check_matmul(x: np.ndarray, weight, ref_w: np.ndarray) -> None:
    """Every split of decode and prompt rows against float64 numpy on the same numbers: packed Q4,
    Q5 and Q8's rows, decode and prompt alike, see their activations rounded to LEVELS 8-bit levels
    first (the integer dot products are then exact, only the scaling rounds)."""
    seen = rounded_activations(x) if weight.kind in (KIND_Q4, KIND_Q5, KIND_Q8) else x
    ref = seen.astype(np.float64) @ ref_w.T.astype(np.float64)
    # float32 rounding scales with the terms summed, not with a result that may cancel to ~0
    bound = 1e-4 * (np.abs(seen).astype(np.float64) @ np.abs(ref_w).T.astype(np.float64)) + 1e-6
    for n_direct in sorted({0, x.shape[0] // 2, x.shape[0]}):  # all prompt rows, mixed, all decode
        out = np.full((x.shape[0], ref_w.shape[0]), np.nan, np.float32)
        qmatmul(x, weight, out, n_direct)
        err = np.abs(out - ref)
        assert np.all(err <= bound), (x.shape, n_direct, float((err / bound).max()))


def test_types_cover_supported():
    """The formats computed on in place have their own tests (test_kernels_blocks.py)."""
    assert set(TYPES) | IN_PLACE == SUPPORTED and not set(TYPES) & IN_PLACE


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (1000, 576), (17, 576), (300, 64), (5, 64)])
def test_qmatmul_matches_dequantized_reference(gtype: GGMLType, n: int, k: int):
    rng = np.random.default_rng(n * 1000 + k + int(gtype))
    raw, ref_w = quantized(rng, n, k, gtype)
    weight = make_weight([(raw, int(gtype))], k)
    assert weight.n_rows == n
    assert weight.kind == EXPECTED_KIND.get(gtype, KIND_F32)
    for t in T_ROWS:
        check_matmul(rng.standard_normal((t, k)).astype(np.float32), weight, ref_w)


@pytest.mark.parametrize("gtype", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0], ids=lambda t: t.name)
def test_qmatmul_prompt_rows_are_decode_rows_and_batch_independent(gtype: GGMLType):
    """A packed matrix's prompt rows take the decode rows' integer path: bitwise the same whether
    a row is called a prompt or a decode row (a prompt run whole or token by token multiplies
    alike), within the activation rounding (half a last-level step of each value's block, times
    |w|) and float32's of the float product; a row is bitwise the same alone or batched (the
    engine's batched greedy output must equal the output of a request run alone)."""
    rng = np.random.default_rng(5)
    raw, ref_w = quantized(rng, 300, 128, gtype)
    weight = make_weight([(raw, int(gtype))], 128)
    x = rng.standard_normal((17, 128)).astype(np.float32)
    prompt = np.empty((17, 300), np.float32)
    qmatmul(x, weight, prompt, 0)
    direct = np.empty((17, 300), np.float32)
    qmatmul(x, weight, direct, 17)
    assert np.array_equal(prompt, direct)
    half_step = np.repeat(np.abs(x).reshape(17, -1, 32).max(-1) / (127 * 254 ** (LEVELS - 1) * 2), 32, axis=1)
    bound = half_step @ np.abs(ref_w).T + 1e-4 * (np.abs(x) @ np.abs(ref_w).T)
    exact = x.astype(np.float64) @ ref_w.T.astype(np.float64)
    assert np.all(np.abs(direct - exact) <= bound), float((np.abs(direct - exact) / bound).max())
    assert_direct_rows_alone_equal_batched(x, weight, direct, (0, 7, 16))


# Weights of every packed shape: Q4 with derived and stored offsets, Q8 in 32- and 16-value blocks.
GENERIC_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q6_K")
_GENERIC_SCRIPT = """
import sys
import numpy as np
from colibri.model.kernels.int8_matmul import int8_matmul
from colibri.model.kernels.simd import target_has_vnni
from colibri.store.formats import GGMLType, quantize
from colibri.store.packed import make_weight
assert not target_has_vnni()
rng = np.random.default_rng(21)
outs = []
for name in sys.argv[2:]:
    raw = quantize(rng.standard_normal((45, 256)).astype(np.float32), GGMLType[name]).reshape(45, -1)
    w = make_weight([(raw, int(GGMLType[name]))], 256)
    out = np.zeros((6, 45), np.float32)
    int8_matmul(rng.standard_normal((6, 256)).astype(np.float32), w, out)
    outs.append(out)
np.save(sys.argv[1], np.stack(outs))
"""


def test_the_generic_dot_product_gives_the_vnni_bits(tmp_path):
    """Compiled for a CPU without AVX-512 VNNI (numba's target features, in a fresh cache),
    ``dpbusd`` is plain integer IR: the same products, bit for bit, as on this machine."""
    features = llvm.get_host_cpu_features()
    for name in ("avx512vnni", "avxvnni"):
        if name in features:
            features[name] = False
    env = dict(os.environ, NUMBA_CPU_FEATURES=features.flatten(), NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-c", _GENERIC_SCRIPT, str(tmp_path / "out.npy"), *GENERIC_TYPES],
                   env=env, check=True, timeout=600)
    theirs = np.load(tmp_path / "out.npy")
    rng = np.random.default_rng(21)
    for i, name in enumerate(GENERIC_TYPES):
        gtype = GGMLType[name]
        w = make_weight([(quantize(rng.standard_normal((45, 256)).astype(np.float32), gtype).reshape(45, -1),
                          int(gtype))], 256)
        ours = np.zeros((6, 45), np.float32)
        int8_matmul(rng.standard_normal((6, 256)).astype(np.float32), w, ours)
        assert np.array_equal(ours, theirs[i]), name


def assert_direct_rows_alone_equal_batched(x: np.ndarray, weight, batched: np.ndarray, rows) -> None:
    """Each of ``rows`` of a direct-path product, computed alone, is bitwise its batched result."""
    for i in rows:
        single = np.empty((1, batched.shape[1]), np.float32)
        qmatmul(x[i : i + 1].copy(), weight, single, 1)
        assert np.array_equal(single[0], batched[i])


def test_stacked_q4_0_and_q4_1_equals_concatenation():
    rng = np.random.default_rng(6)
    raw0, w0 = quantized(rng, 40, 96, GGMLType.Q4_0)
    raw1, w1 = quantized(rng, 24, 96, GGMLType.Q4_1)
    weight = make_weight([(raw0, int(GGMLType.Q4_0)), (raw1, int(GGMLType.Q4_1))], 96)
    assert weight.kind == KIND_Q4 and weight.n_rows == 64
    ref = np.concatenate([w0, w1])
    for t in T_ROWS:
        check_matmul(rng.standard_normal((t, 96)).astype(np.float32), weight, ref)


@pytest.mark.parametrize("gtype", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0], ids=lambda t: t.name)
def test_a_packed_legacy_matrix_is_its_file_bytes_and_its_scales_the_files_halves(gtype: GGMLType):
    """Resident no bigger than the file: the quants re-laid, the f16 scales (and Q4_1's mins) kept."""
    rng = np.random.default_rng(9)
    raw, ref_w = quantized(rng, 64, 256, gtype)
    w = make_weight([(raw, int(gtype))], 256)
    assert w.d.size == 0 and w.m.size == 0 and w.dh.size == 64 * 8
    assert w.q.nbytes + w.dh.nbytes + w.mh.nbytes == raw.nbytes
    first = raw[0, :2].view(np.uint16)[0]  # row 0's first block: its scale, bit for bit
    assert w.dh[0, 0, 0] == first
    check_matmul(rng.standard_normal((5, 256)).astype(np.float32), w, ref_w)


@pytest.mark.parametrize("gtype", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0], ids=lambda t: t.name)
def test_packing_by_words_puts_every_file_byte_where_the_layout_says(gtype: GGMLType):
    """The word packer (groups in parallel, parts starting mid-group, a partial last group) against
    the layout's definition, byte by byte: quant byte 4p + k of block b of row r at
    ``q[r // GROUP, b, p, 4 (r % GROUP) + k]`` (Q8_0's flipped to q + 128), its halves in dh, mh."""
    from colibri.store.formats import FORMATS
    from colibri.store.packed import GROUP

    rng = np.random.default_rng(11)
    rows = (45, 7, 40)  # parts start at rows 0, 45 and 52: two of them inside a group
    raws = [quantized(rng, n, 128, gtype)[0] for n in rows]
    w = make_weight([(raw, int(gtype)) for raw in raws], 128)
    raw = np.concatenate(raws)
    layout, size = FORMATS[gtype].pack, FORMATS[gtype].nbytes
    blocks = raw.reshape(raw.shape[0], -1, size)
    n_quants = w.q.shape[2] * 4
    for r in range(raw.shape[0]):
        g, lane = divmod(r, GROUP)
        assert (w.dh[g, :, lane] == blocks[r, :, :2].copy().view(np.uint16)[:, 0]).all()
        if layout.min_at >= 0:
            mins = blocks[r, :, layout.min_at : layout.min_at + 2].copy().view(np.uint16)[:, 0]
            assert (w.mh[g, :, lane] == mins).all()
        quants = blocks[r, :, layout.quants_at : layout.quants_at + n_quants] ^ np.uint8(layout.flip)
        packed = w.q[g, :, :, 4 * lane : 4 * lane + 4].reshape(-1, n_quants)
        assert (packed == quants).all(), f"row {r}"
    assert (w.q[raw.shape[0] // GROUP, :, :, 4 * (raw.shape[0] % GROUP) :] == 0).all()  # the empty rows


@pytest.mark.parametrize("types", [("Q4_0", "Q4_1"), ("Q8_0",), ("Q8_0", "Q4_1"), ("F16",)])
def test_packed_nbytes_is_what_make_weight_allocates(types: tuple[str, ...]):
    """The expert store budgets experts from their shapes alone, before packing them."""
    rng = np.random.default_rng(8)
    rows = (33, 40)[: len(types)]
    gtypes = [GGMLType[t] for t in types]
    parts = [(quantized(rng, n, 64, t)[0], int(t)) for n, t in zip(rows, gtypes, strict=True)]
    w = make_weight(parts, 64)
    allocated = weight_nbytes(w)
    assert packed_nbytes([(raw.shape[0], t) for raw, t in parts], 64) == allocated


def test_mixed_q8_and_q4_stack_packs_to_q8_lanes_or_widens_to_float32():
    """Q4_1 rows re-expressed as Q8 lanes (``lanes.py``); without lanes, the whole stack is float."""
    rng = np.random.default_rng(7)
    raw0, w0 = quantized(rng, 20, 64, GGMLType.Q8_0)
    raw1, w1 = quantized(rng, 33, 64, GGMLType.Q4_1)
    parts = [(raw0, int(GGMLType.Q8_0)), (raw1, int(GGMLType.Q4_1))]
    ref = np.concatenate([w0, w1])
    floats = make_weight(parts, 64, lanes=False)
    assert floats.kind == KIND_F32 and floats.f.shape == (53, 64)
    np.testing.assert_allclose(floats.f, ref, rtol=1e-6, atol=1e-6)
    packed = make_weight(parts, 64)
    assert packed.kind == KIND_Q8 and packed.f.size == 0
    for weight in (floats, packed):
        for t in (1, 17):
            check_matmul(rng.standard_normal((t, 64)).astype(np.float32), weight, ref)


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_dequantize_row_matches_reference(gtype: GGMLType):
    rng = np.random.default_rng(8)
    raw, ref = quantized(rng, 3, 160, gtype)
    for r in range(3):
        out = np.full(160, np.nan, np.float32)
        dequantize_row(raw[r], int(gtype), out)
        np.testing.assert_allclose(out, ref[r], rtol=1e-6, atol=1e-6 * np.abs(ref[r]).max())


@pytest.mark.parametrize(
    "gtype,limit",
    [(GGMLType.F32, 0.0), (GGMLType.F16, 1e-3), (GGMLType.BF16, 5e-3),
     (GGMLType.Q8_0, 0.01), (GGMLType.Q4_0, 0.10), (GGMLType.Q4_1, 0.10)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_quantize_round_trip_error(gtype: GGMLType, limit: float):
    x = np.random.default_rng(9).standard_normal(32 * 256).astype(np.float32)
    raw = quantize(x, gtype)
    per_block, block_bytes = BLOCK_GEOMETRY[gtype]
    assert raw.dtype == np.uint8 and raw.size == x.size // per_block * block_bytes
    back = dequantize(raw, gtype, x.size)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.linalg.norm(back - x) / np.linalg.norm(x) <= limit


@pytest.mark.parametrize("gtype", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1], ids=lambda t: t.name)
def test_quantize_zero_block_is_zero(gtype: GGMLType):
    x = np.zeros(64, np.float32)
    x[32:] = np.linspace(-1, 1, 32)
    back = dequantize(quantize(x, gtype), gtype, 64)
    assert np.all(np.isfinite(back))
    assert np.array_equal(back[:32], np.zeros(32, np.float32))


def test_bf16_rounds_to_nearest_even():
    bits = np.array([0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0xBF80FFFF], np.uint32)
    raw = quantize(bits.view(np.float32), GGMLType.BF16)
    assert raw.view(np.uint16).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xBF81]


def test_rmsnorm():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((5, 96)).astype(np.float32) * 3
    w = rng.standard_normal(96).astype(np.float32)
    out = np.empty_like(x)
    rmsnorm(x, w, 1e-5, out)
    ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def rope_reference(x: np.ndarray, positions: np.ndarray, n_heads: int, head_dim: int, rope_dim: int,
                   base: float) -> np.ndarray:
    out = x.astype(np.float64).copy()
    for t, pos in enumerate(positions):
        for h in range(n_heads):
            for i in range(rope_dim // 2):
                theta = pos * base ** (-2.0 * i / rope_dim)
                j = h * head_dim + 2 * i
                a, b = out[t, j], out[t, j + 1]
                out[t, j] = a * np.cos(theta) - b * np.sin(theta)
                out[t, j + 1] = a * np.sin(theta) + b * np.cos(theta)
    return out


@pytest.mark.parametrize("rope_dim", [16, 8])  # full and partial rotary
def test_rope(rope_dim: int):
    n_heads, head_dim, base = 3, 16, 10000.0
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, n_heads * head_dim)).astype(np.float32)
    positions = np.array([0, 1, 7, 4000], np.int32)
    inv = rope_frequencies(head_dim, rope_dim, base)
    np.testing.assert_allclose(inv, base ** (-np.arange(0, rope_dim, 2) / rope_dim), rtol=1e-12)
    y = x.copy()
    rope(y, positions, n_heads, head_dim, inv)
    np.testing.assert_allclose(y, rope_reference(x, positions, n_heads, head_dim, rope_dim, base),
                               rtol=1e-5, atol=1e-5)
    assert np.array_equal(y[0], x[0])  # position 0 does not rotate
    if rope_dim < head_dim:
        tail = np.concatenate([np.arange(rope_dim, head_dim) + h * head_dim for h in range(n_heads)])
        assert np.array_equal(y[:, tail], x[:, tail])


def test_swiglu_and_add_into():
    rng = np.random.default_rng(12)
    gate = rng.standard_normal((3, 40)).astype(np.float32) * 4
    up = rng.standard_normal((3, 40)).astype(np.float32)
    g = gate.copy()
    swiglu(g, up)
    g64 = gate.astype(np.float64)
    np.testing.assert_allclose(g, g64 / (1 + np.exp(-g64)) * up, rtol=1e-5, atol=1e-6)
    acc = gate.copy()
    add_into(acc, up)
    np.testing.assert_allclose(acc, gate + up, rtol=0, atol=0)


def test_exp_into_is_within_3e_7_of_exp_and_clamps_past_float32s_range():
    x = np.concatenate([np.linspace(-87, 88, 200_001), [0.0, -0.0, 1e-8, -1e-8]]).astype(np.float32)
    out = np.empty_like(x)
    exp_into(x, out)
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - exact) / exact) < 3e-7
    assert out[-4] == 1.0 and out[-3] == 1.0
    far = np.array([-1e4, -100, 100, 1e4], np.float32)
    clamped = np.empty_like(far)
    exp_into(far, clamped)  # clamped to exp(-87) and exp(88): normal floats, never inf or 0
    np.testing.assert_allclose(clamped, np.exp(np.array([-87, -87, 88, 88], np.float64)), rtol=3e-7)


def test_swiglu_keeps_its_limits_for_large_gates():
    gate = np.array([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0]], np.float32)
    up = np.ones_like(gate)
    g = gate.copy()
    swiglu(g, up)
    g64 = gate.astype(np.float64)
    np.testing.assert_allclose(g, g64 / (1 + np.exp(-g64)), rtol=1e-6, atol=1e-30)
    assert np.all(np.isfinite(g))


def attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, n_heads: int, n_kv: int,
                        head_dim: int) -> np.ndarray:
    """One row: q (n_heads*head_dim), keys/values (n_positions, n_kv, head_dim)."""
    out = np.empty(n_heads * head_dim)
    for h in range(n_heads):
        kh = h // (n_heads // n_kv)
        qh = q[h * head_dim : (h + 1) * head_dim].astype(np.float64)
        s = keys[:, kh] @ qh / np.sqrt(head_dim)
        p = np.exp(s - s.max())
        out[h * head_dim : (h + 1) * head_dim] = (p / p.sum()) @ values[:, kh]
    return out


def test_attention_ragged_batch_two_slots_gqa():
    n_heads, n_kv, head_dim, n_layers, n_ctx, layer = 4, 2, 16, 2, 32, 1
    rng = np.random.default_rng(13)
    k_cache = np.zeros((2, n_layers, n_ctx, n_kv, head_dim), np.uint16)  # halves' bits (kv_cache)
    v_cache = np.zeros_like(k_cache)
    hist_k = {s: rng.standard_normal((n_ctx, n_kv, head_dim)).astype(np.float32) * 2 for s in (0, 1)}
    hist_v = {s: rng.standard_normal((n_ctx, n_kv, head_dim)).astype(np.float32) for s in (0, 1)}
    # what the cache holds: each value rounded to a half, as numpy rounds (to nearest, ties even)
    half_k = {s: a.astype(np.float16) for s, a in hist_k.items()}
    half_v = {s: a.astype(np.float16) for s, a in hist_v.items()}

    def step(slots: list[int], positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
        sl, ps = np.array(slots, np.int32), np.array(positions, np.int32)
        k = np.stack([hist_k[s][p].reshape(-1) for s, p in zip(slots, positions, strict=True)])
        v = np.stack([hist_v[s][p].reshape(-1) for s, p in zip(slots, positions, strict=True)])
        store_kv(k, v, k_cache, v_cache, layer, sl, ps, n_kv, head_dim)
        q = rng.standard_normal((len(slots), n_heads * head_dim)).astype(np.float32)
        out = np.full_like(q, np.nan)
        attend(q, k_cache, v_cache, layer, sl, ps, n_heads, n_kv, out)
        return q, out

    step([1] * 7, list(range(7)))  # slot 1 already holds 7 positions
    slots, positions = [0, 0, 0, 0, 0, 1, 1], [0, 1, 2, 3, 4, 7, 8]  # a prefill and two decodes
    q, out = step(slots, positions)
    for t, (s, p) in enumerate(zip(slots, positions, strict=True)):
        ref = attention_reference(q[t], half_k[s][: p + 1], half_v[s][: p + 1], n_heads, n_kv, head_dim)
        np.testing.assert_allclose(out[t], ref, rtol=1e-4, atol=1e-5)
    # a row at position 0 sees only its own value
    np.testing.assert_allclose(out[0].reshape(n_heads, head_dim),
                               half_v[0][0][np.arange(n_heads) // 2], rtol=1e-5, atol=1e-6)
    assert np.array_equal(k_cache[1, layer, :9].view(np.float16), half_k[1][:9])
    assert np.array_equal(v_cache[0, layer, :5].view(np.float16), half_v[0][:5])
    assert not k_cache[:, 0].any() and not k_cache[0, layer, 5:].any() and not v_cache[1, layer, 9:].any()

    # decode rows of both slots first, then a prompt run of slot 0: every row matches the reference
    # and is bitwise what it is alone (so a prompt run whole is its run token by token)
    slots, positions = [1, 0, 0, 0, 0], [9, 5, 6, 7, 8]
    q, out = step(slots, positions)
    for t, (s, p) in enumerate(zip(slots, positions, strict=True)):
        ref = attention_reference(q[t], half_k[s][: p + 1], half_v[s][: p + 1], n_heads, n_kv, head_dim)
        np.testing.assert_allclose(out[t], ref, rtol=1e-4, atol=1e-5)
    for t in range(len(slots)):
        alone = np.full_like(q[t : t + 1], np.nan)
        row_slot, row_pos = np.array(slots[t : t + 1]), np.array(positions[t : t + 1])
        attend(q[t : t + 1], k_cache, v_cache, layer, row_slot, row_pos, n_heads, n_kv, alone)
        assert np.array_equal(alone[0], out[t])


@nb.njit(cache=False)
def _sums_by_tree(a: np.ndarray, out: np.ndarray) -> None:
    store_floats(out, 0, 0, sum_lanes16(a, 0), LANES)


@nb.njit(cache=False)
def _sums_one_by_one(a: np.ndarray, out: np.ndarray) -> None:
    for i in range(LANES):
        out[0, i] = sum_lanes(load_floats(a, i * LANES))


def test_sum_lanes16_adds_each_vector_as_sum_lanes():
    """The transposing tree gives each of its 16 sums the bits ``sum_lanes`` gives it alone
    (attention's scores are summed 16 keys at a time, a prompt's tail and a decode one at a time)."""
    rng = np.random.default_rng(5)
    for _ in range(50):
        a = (rng.standard_normal((LANES, LANES)) * 10.0 ** rng.integers(-6, 7, (LANES, LANES)))
        a = a.astype(np.float32)
        tree, alone = np.empty((1, LANES), np.float32), np.empty((1, LANES), np.float32)
        _sums_by_tree(a, tree)
        _sums_one_by_one(a, alone)
        assert np.array_equal(tree.view(np.uint32), alone.view(np.uint32))


@pytest.mark.parametrize(("n_heads", "n_kv", "head_dim"), [(9, 3, 64), (8, 1, 80), (4, 4, 32)])
def test_attention_long_rows_match_reference_and_themselves_alone(n_heads, n_kv, head_dim):
    """Rows long enough for the 16-key blocks and a tail (positions 15 .. 70): each within the
    reference, each bitwise what it is alone."""
    n_ctx, rng = 72, np.random.default_rng(11)
    k_cache = np.zeros((1, 1, n_ctx, n_kv, head_dim), np.uint16)
    v_cache = np.zeros_like(k_cache)
    keys = rng.standard_normal((n_ctx, n_kv * head_dim)).astype(np.float32)
    values = rng.standard_normal((n_ctx, n_kv * head_dim)).astype(np.float32)
    every = np.arange(n_ctx, dtype=np.int64)
    store_kv(keys, values, k_cache, v_cache, 0, np.zeros(n_ctx, np.int64), every, n_kv, head_dim)
    positions = np.array([15, 16, 17, 31, 32, 47, 70], np.int64)
    q = (rng.standard_normal((len(positions), n_heads * head_dim)) * 2).astype(np.float32)
    out = np.full_like(q, np.nan)
    slots = np.zeros(len(positions), np.int64)
    attend(q, k_cache, v_cache, 0, slots, positions, n_heads, n_kv, out)
    half_k = keys.astype(np.float16).reshape(n_ctx, n_kv, head_dim)
    half_v = values.astype(np.float16).reshape(n_ctx, n_kv, head_dim)
    for t, p in enumerate(positions):
        ref = attention_reference(q[t], half_k[: p + 1], half_v[: p + 1], n_heads, n_kv, head_dim)
        np.testing.assert_allclose(out[t], ref, rtol=1e-4, atol=1e-5)
        alone = np.full_like(q[t : t + 1], np.nan)
        attend(q[t : t + 1], k_cache, v_cache, 0, slots[:1], positions[t : t + 1], n_heads, n_kv, alone)
        assert np.array_equal(alone[0], out[t])
