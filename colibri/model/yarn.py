"""YaRN (Peng et al., 2023), the RoPE scaling of DeepSeek-V2/V3, Qwen's long contexts and others,
as llama.cpp computes it (``ggml_rope_yarn_corr_dims``, ``rope_yarn``) and transformers'
``_compute_yarn_parameters`` does: a frequency keeps its own value where a head's dimension
turns many times over the original context, is divided by the factor where it turns less than
once, and blends linearly between (the dimensions ``low .. high`` set by ``beta_fast`` and
``beta_slow`` rotations); the rotated pairs are scaled by ``1 + 0.1 ln(factor)``, except where
the file carries DeepSeek's ``yarn_log_multiplier``: there the keys' and queries' magnitudes stay
and the attention's scale takes the term instead (``Deepseek2Decoder.query_scale``).
"""

from __future__ import annotations

import math

import numpy as np

from colibri.model.hparams import HParams


def yarn_divisors(hp: HParams) -> np.ndarray:
    """Per rotated pair, what its inverse frequency is divided by (``decoder.py`` divides by them as
    by Llama 3's factors): the factor below ``low``, 1 above ``high``, a linear blend between."""
    half = hp.rope_dim // 2
    low, high = correction_range(hp)
    kept = 1.0 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0.0, 1.0)  # extrapolated share
    return 1.0 / ((1.0 - kept) / hp.rope_factor + kept)


def correction_range(hp: HParams) -> tuple[float, float]:
    """The pairs between which YaRN blends: a pair whose dimension turns ``n`` times over the
    original context sits at ``d ln(ctx / (2 pi n)) / (2 ln base)``; ``beta_fast`` turns and more
    keep their frequency, ``beta_slow`` and fewer are divided by the factor. Rounded out to whole
    pairs (llama.cpp always, transformers by default) unless ``hp.yarn_truncate`` is false."""
    def pair(turns: float) -> float:
        return hp.rope_dim * math.log(hp.n_ctx_orig / (turns * 2 * math.pi)) / (2 * math.log(hp.rope_base))

    low, high = pair(hp.yarn_beta_fast), pair(hp.yarn_beta_slow)
    if hp.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(0, low), min(hp.rope_dim - 1, high)


def yarn_magnitude(hp: HParams) -> float:
    """What YaRN scales the rotated pairs by (before ``rope.scaling.attn_factor``)."""
    if hp.rope_scaling != "yarn" or hp.rope_factor <= 1.0 or hp.yarn_log_mul:
        return 1.0
    return 1.0 + 0.1 * math.log(hp.rope_factor)


def yarn_attention_scale(hp: HParams) -> float:
    """DeepSeek's factor on q·k's scale: ``(1 + 0.1 mscale_all_dim ln(factor))²`` (the file keeps
    ``0.1 mscale_all_dim`` as ``yarn_log_multiplier``), times the rotation's magnitude squared."""
    if hp.rope_scaling != "yarn" or hp.rope_factor <= 1.0:
        return 1.0
    m = hp.rope_attn_factor * yarn_magnitude(hp) * (1.0 + hp.yarn_log_mul * math.log(hp.rope_factor))
    return m * m
