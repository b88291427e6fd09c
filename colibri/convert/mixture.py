"""The K-quant mixtures (``--type q4_k_m`` ...): which block type each tensor gets, as llama.cpp's
``llama-quantize`` chooses it, so that a file converted here has the types (and, the quantizers
being bit-exact, the bytes) of llama.cpp's own quantization of the same weights.

Mirrored from llama.cpp ``src/llama-quant.cpp`` (``llama_tensor_get_type_impl``, its fallback
``tensor_type_fallback`` and the use_more_bits schedule), for Q4_K_M, Q4_K_S, Q5_K_M and Q6_K:

- ``output.weight``, and ``token_embd.weight`` when it doubles as the output (no ``output.weight``):
  Q6_K; Q8_0 when its rows are not whole 256-blocks.
- attn_v (and the fused attn_qkv / attn_kv_b, which llama.cpp ranks with it): Q6_K in the
  use_more_bits layers (the first and last eighth, and every third layer between) for Q4_K_M and
  Q5_K_M; Q5_K in the first four layers for Q4_K_S; Q5_K for a 70B llama (80 layers, GQA) that
  would get Q3_K/Q4_K; Q8_0 in a model of exactly 8 experts (Mixtral), attn_k too.
- ffn_down (dense, ``_exps`` and ``_shexp`` alike, by the layer in the name): Q6_K in the
  use_more_bits layers for Q4_K_M and Q5_K_M; Q5_K in the first eighth for Q4_K_S.
- attn_output in an 8-expert model: Q5_K for Q4_K_M and Q4_K_S.
- Everything else: the mixture's type (Q4_K, Q5_K or Q6_K). Then the fallback for rows that are
  not whole 256-blocks: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even 32 does not
  divide them.

Not mirrored: the rules of the other mixtures (Q2_K, Q3_K_*, IQ*: their quantizers are not here),
those that depend on an importance matrix (``has_imatrix``) or on user overrides (``--tensor-type``,
``--output-tensor-type``, ``--pure``), Falcon's rules (not an architecture ``coli convert`` writes),
and llama.cpp's refusal of a tensor whose Q8_0 fallback rows are not whole 32-blocks (F16 here).
llama.cpp counts attn_v tensors in layer order; with one per layer, as in every architecture
converted here, that count is the layer number, which is what this uses. Which tensors are
quantized at all (matrices, not norms or routers) is the writer's call, as for every ``--type``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import gguf

from colibri.store.formats import BLOCK_GEOMETRY, GGMLType

FT = gguf.LlamaFileType
# Each mixture's default type (llama.cpp's ``llama_ftype_get_default_type``).
DEFAULT_TYPE: dict[FT, GGMLType] = {
    FT.MOSTLY_Q4_K_M: GGMLType.Q4_K,
    FT.MOSTLY_Q4_K_S: GGMLType.Q4_K,
    FT.MOSTLY_Q5_K_M: GGMLType.Q5_K,
    FT.MOSTLY_Q6_K: GGMLType.Q6_K,
}
# A type for rows that are not whole blocks of the chosen one (``tensor_type_fallback``).
FALLBACK: dict[GGMLType, GGMLType] = {
    GGMLType.Q4_K: GGMLType.Q5_0,
    GGMLType.Q5_K: GGMLType.Q5_1,
    GGMLType.Q6_K: GGMLType.Q8_0,
}
_LAYER = re.compile(r"^blk\.(\d+)\.")


class ModelFacts(NamedTuple):
    """What llama.cpp's rules read of the model besides the tensor itself."""

    n_layer: int  # {arch}.block_count (llama.cpp's n_layer_all: NextN layers included)
    n_expert: int = 0  # {arch}.expert_count, 0 for a dense model
    tied: bool = False  # no output.weight: token_embd.weight is the output too
    llama_70b: bool = False  # llama.cpp's LLM_TYPE_70B: a llama of 80 layers with GQA


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """The layers llama.cpp gives more bits: the first and last eighth, every third between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _category(name: str, tied: bool) -> str:
    """llama.cpp's ``tensor_get_category``, by name (the same substring tests, in its order)."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for part in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight"):
        if part in name:
            return "attn_v"
    for part in ("attn_k.weight", "attn_q.weight", "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if part in name:
            return part.removesuffix(".weight")
    return "other"


def _layer(name: str, facts: ModelFacts) -> int:
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= facts.n_layer:
        raise ValueError(f"{name}: no layer in [0, {facts.n_layer}) in the name")
    return int(m.group(1))


def _layered(name: str, category: str, ftype: FT, facts: ModelFacts, default: GGMLType) -> GGMLType:
    """The per-layer rules: attn_v, attn_k, ffn_down, attn_output."""
    q4_k_m, q4_k_s, q5_k_m = ftype == FT.MOSTLY_Q4_K_M, ftype == FT.MOSTLY_Q4_K_S, ftype == FT.MOSTLY_Q5_K_M
    new = default
    if category == "attn_v":
        i = _layer(name, facts)
        if (q4_k_m or q5_k_m) and use_more_bits(i, facts.n_layer):
            new = GGMLType.Q6_K
        elif q4_k_s and i < 4:
            new = GGMLType.Q5_K
        if facts.llama_70b and new in (GGMLType.Q3_K, GGMLType.Q4_K):
            new = GGMLType.Q5_K
        if facts.n_expert == 8:
            new = GGMLType.Q8_0
    elif category == "attn_k" and facts.n_expert == 8:
        new = GGMLType.Q8_0
    elif category == "ffn_down":
        i = _layer(name, facts)
        if (q4_k_m or q5_k_m) and use_more_bits(i, facts.n_layer):
            new = GGMLType.Q6_K
        elif q4_k_s and i < facts.n_layer // 8:
            new = GGMLType.Q5_K
    elif category == "attn_output" and facts.n_expert == 8 and (q4_k_m or q4_k_s):
        new = GGMLType.Q5_K
    return new


def _fits(gtype: GGMLType, n_cols: int) -> bool:
    return n_cols % BLOCK_GEOMETRY[gtype][0] == 0


def mixture_type(name: str, shape: tuple[int, ...], ftype: FT, facts: ModelFacts) -> GGMLType:
    """The block type llama.cpp's quantizer gives the matrix ``name`` (numpy-order ``shape``, rows
    of ``shape[-1]`` values) in a file of type ``ftype``. Only for tensors that are quantized at
    all; ValueError for a mixture not mirrored here."""
    if ftype not in DEFAULT_TYPE:
        raise ValueError(f"no mixture rules for {ftype.name}")
    default, n_cols = DEFAULT_TYPE[ftype], shape[-1]
    category = _category(name, facts.tied)
    if category == "output":
        new = GGMLType.Q8_0 if not _fits(default, n_cols) else GGMLType.Q6_K
    elif category == "token_embd":
        new = default
    else:
        new = _layered(name, category, ftype, facts, default)
    if not _fits(new, n_cols):
        new = FALLBACK.get(new, new)
        if not _fits(new, n_cols):
            new = GGMLType.F16
    return new
