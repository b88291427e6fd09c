"""The compiled draw (``kernels.draw``) against a plain numpy reference of the truncations.

The draw is an inverse CDF, so it is tested without sampling noise: for every token the reference
keeps, the uniform number at the middle of that token's stretch of the cumulative weights must
draw exactly that token. That checks which tokens are kept, in which order and with what weight.
The reference sorts the whole vocabulary (stable: ties go to the lower id) and sums in the
kernel's order, so the two agree to the bit on where top_p cuts.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from colibri.model.kernels.draw import draw
from colibri.model.sampling import Sampler, SamplingParams


def weights_of(logits: np.ndarray, temperature: float) -> tuple[np.ndarray, float, float]:
    """What ``Sampler`` hands the kernel: float32 weights, the peak and 1/T."""
    peak, inv_t = logits.max(), np.float32(1.0 / temperature)
    w = np.exp((logits - peak) * inv_t).astype(np.float32)
    return w, float(peak), float(inv_t)


def reference(logits: np.ndarray, w: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The kept token ids, best first, by the definitions in ``sampling.Sampler``."""
    order = np.argsort(-logits, kind="stable")
    keep = len(order) if top_k == 0 else min(top_k, len(order))
    norm = 0.0
    for i in (range(len(w)) if top_k == 0 else order[:keep]):  # the kernel's order of summing
        norm += float(w[i])
    if min_p > 0:
        keep = min(keep, int(np.count_nonzero(w[order[:keep]] >= min_p)))
    if top_p < 1:
        acc = 0.0
        for j in range(keep):
            acc += float(w[order[j]])
            if acc >= top_p * norm:
                keep = j + 1
                break
    return order[:keep]


def check(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
          min_p: float = 0.0) -> int:
    """Every kept token drawn at the middle of its stretch; how many tokens were kept."""
    logits = logits.astype(np.float32)
    w, peak, inv_t = weights_of(logits, temperature)
    kept = reference(logits, w, top_k, top_p, min_p)
    truncated = top_k > 0 or top_p < 1 or min_p > 0
    # the tokens with any weight (-inf or underflowed: never drawn); untruncated, the kernel walks
    # them in id order
    walk = kept[w[kept] > 0] if truncated else np.flatnonzero(w > 0)
    cum = np.cumsum([float(w[i]) for i in walk])
    checked = 0
    # every token of a short list; of a long one the first and last 100 and 100 between (each
    # draw is a pass over the vocabulary)
    picks = range(len(walk)) if len(walk) <= 300 else sorted(
        {*range(100), *range(len(walk) - 100, len(walk)), *np.linspace(0, len(walk) - 1, 100).astype(int)})
    for j in picks:
        token = walk[j]
        lo = cum[j - 1] if j else 0.0
        if cum[j] - lo < 1e-9 * cum[-1]:
            continue  # a stretch too thin for a float64 u to land in reliably (odds below 1e-9)
        u = (lo + cum[j]) / 2 / cum[-1]
        got = draw(logits, w, peak, inv_t, top_k, top_p, min_p, u)
        assert got == token, (j, token, got, top_k, top_p, min_p)
        checked += 1
    assert checked >= min(len(walk), 1)
    assert set(walk.tolist()) == {t for t in kept.tolist() if w[t] > 0}  # -inf: weight 0, never drawn
    return len(kept)


PARAMS = [(k, p, m) for k, p, m in itertools.product((0, 1, 5, 40), (1.0, 0.9, 0.5), (0.0, 0.05))]


@pytest.mark.parametrize("n, scale", [(7, 1.0), (1000, 3.0), (50_000, 3.0), (50_000, 0.3)])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_every_kept_token_is_drawn_where_the_reference_puts_it(n, scale, temperature):
    logits = np.random.default_rng(n + int(scale * 10)).standard_normal(n) * scale
    for top_k, top_p, min_p in PARAMS:
        check(logits, temperature, top_k, top_p, min_p)


def test_ties_go_to_the_lower_id_and_minus_infinity_is_never_drawn():
    rng = np.random.default_rng(5)
    logits = rng.integers(0, 4, 3000).astype(np.float32)  # hundreds of tokens tie on each value
    logits[rng.choice(3000, 500, replace=False)] = -np.inf
    for top_k, top_p, min_p in PARAMS:
        check(logits, 1.0, top_k, top_p, min_p)
    assert check(logits, 1.0, top_k=5) == 5


def test_a_flat_row_keeps_the_first_ids_that_reach_top_p():
    """Every token in the histogram's first bucket: the cut must still be exact."""
    assert check(np.zeros(10_000), 1.0, top_p=0.25) == 2500
    assert check(np.zeros(10_000), 1.0, top_k=10) == 10


def test_a_cut_deep_in_the_tail_reaches_the_last_bucket():
    """A cut below e^-32 of the peak's weight, where every token shares the histogram's last
    bucket: a large top_k, a tiny min_p."""
    logits = -np.arange(2000, dtype=np.float32)  # log-weights -2i at T 0.5
    assert check(logits, 0.5, min_p=1e-30) == 35  # e^-2i >= 1e-30: i <= 34, down to log-weight -68
    assert check(logits, 0.5, top_k=1500) == 1500  # most of them of weight 0 in float32: never drawn
    assert check(logits, 0.5, top_p=1 - 1e-12) == 14  # the mass beyond the first i is ~e^-2i


def test_u_at_the_ends():
    logits = np.array([0.0, 1.0, 2.0, -np.inf], np.float32)
    w, peak, inv_t = weights_of(logits, 1.0)
    assert draw(logits, w, peak, inv_t, 0, 1.0, 0.0, 0.0) == 0  # id order untruncated
    assert draw(logits, w, peak, inv_t, 0, 1.0, 0.0, np.nextafter(1.0, 0.0)) == 2  # never the -inf
    assert draw(logits, w, peak, inv_t, 2, 1.0, 0.0, 0.0) == 2  # best first truncated
    assert draw(logits, w, peak, inv_t, 2, 1.0, 0.0, np.nextafter(1.0, 0.0)) == 1


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_row_without_a_finite_peak_is_refused(bad):
    row = np.zeros(10, np.float32)
    row[3] = bad
    with pytest.raises(ValueError, match="finite peak"):
        Sampler(SamplingParams(temperature=1.0, seed=0))(row)


def test_a_large_vocabulary_samples_its_softmax():
    """The sampler end to end on Qwen3's vocabulary size: the frequencies of the three likely
    tokens (probabilities ~0.66, 0.24 and 0.09; the other 151,933 hold 0.002), within ~3.5 sigma
    of 3000 seeded draws."""
    n = 151_936
    likely = [7, 70_000, 151_935]
    logits = np.full(n, -15.0, np.float32)
    logits[likely] = [3.0, 2.0, 1.0]
    s = Sampler(SamplingParams(temperature=1.0, seed=11))
    draws = np.array([s(logits) for _ in range(3000)])
    w = np.exp(logits.astype(np.float64) - 3.0)
    p = w / w.sum()
    for token in likely:
        assert abs(np.mean(draws == token) - p[token]) < 0.03
    assert p[likely].sum() > 0.99 and np.mean(np.isin(draws, likely)) > 0.99


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e30, 1e300])
def test_temperatures_at_the_edges_of_float32(temperature):
    """1/T beyond float32's range either way: the peak alone (T -> 0), or every finite logit
    alike (T -> inf), and never a -inf one (no NaN weights, no index out of range)."""
    row = np.array([-np.inf, 1.0, 3.0, -np.inf, 2.0, -np.inf], np.float32)
    for params in (SamplingParams(temperature=temperature, seed=1),
                   SamplingParams(temperature=temperature, top_p=0.9, seed=1),
                   SamplingParams(temperature=temperature, top_k=5, min_p=0.01, seed=1)):
        s = Sampler(params)
        got = {s(row) for _ in range(200)}
        if temperature < 1:
            assert got == {2}
        else:
            assert got <= {1, 2, 4} and len(got) >= 2


def test_a_sampling_sampler_loads_the_kernel_before_its_first_token():
    """The compiled draw is loaded when a sampling Sampler is made (the engine: before READY), so
    that no decode step waits on numba's cache; a greedy one needs none."""
    from colibri.model import sampling

    sampling.load_kernels.cache_clear()
    Sampler(SamplingParams(temperature=0.0))
    assert sampling.load_kernels.cache_info().currsize == 0
    Sampler(SamplingParams(temperature=0.7))
    assert sampling.load_kernels.cache_info().currsize == 1
    loaded = len(draw.signatures)  # the signature every Sampler calls: nothing more to load
    Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=2))(np.arange(9, dtype=np.float32))
    assert len(draw.signatures) == loaded
