"""What a tiny checkpoint must survive to be a fair test: its matrices rounded as a quantized GGUF
stores them (ggml's rounding rules, simulated in torch), its top-1 choices kept.

``quant_agreement`` is the share of positions whose argmax stays the reference's when every matrix
a quantized conversion stores is rounded so: Q8_0, Q4_0, Q8_0 with its error doubled (headroom for
engines that also round activations, llama.cpp), and for gpt-oss MXFP4_MOE (the experts MXFP4, the
rest Q8_0). A matrix is rounded along GGUF's rows: for gpt-oss's fused experts, the checkpoint's columns.
``mxfp4_grid`` draws values MXFP4 stores exactly (gpt-oss's tiny experts).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

BLOCK = 32  # values per Q8_0 / Q4_0 / MXFP4 block
# Top-1 agreement with the reference, over prompt and continuation, that the model must keep with
# its matrices rounded (the roundings above).
MIN_QUANT_AGREEMENT = 0.95
Q8_ERROR_HEADROOM = 2.0
# MXFP4's values, E2M1 doubled (ggml-common.h's kvalues_mxfp4 without its duplicate zero).
MXFP4_VALUES = torch.tensor([0.0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12])
# gpt-oss's fused experts, stored transposed from GGUF's rows (other families' fused experts are not).
TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")
MXFP4_STD = float(MXFP4_VALUES.square().mean().sqrt())  # of a value drawn uniformly from the grid
MXFP4_MAX = 12.0  # the grid's largest value: one a block fixes its exponent
ROUTERS = (".mlp.gate.weight", ".mlp.router.weight")


def is_router(name: str) -> bool:
    return name.endswith(ROUTERS)


def is_expert(name: str) -> bool:
    return name.endswith(TRANSPOSED)


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` through ggml's Q8_0 (scale amax/127 in f16, round to nearest) and back."""
    b = x.reshape(-1, BLOCK)
    d = b.abs().amax(1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(b / torch.where(d > 0, d, 1)), 0).clamp(-127, 127)
    return (q * d.half().float()).reshape(x.shape)


def round_q4_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` through ggml's Q4_0 (scale max/-8 in f16, floor(x/d + 8.5)) and back."""
    b = x.reshape(-1, BLOCK)
    mx = b.gather(1, b.abs().argmax(1, keepdim=True))
    d = mx / -8
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)
    q = torch.floor(b * inv + 8.5).clamp(0, 15)
    return ((q - 8) * d.half().float()).reshape(x.shape)


def round_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """``x`` through ggml's MXFP4 (the exponent floor(log2 amax) - 2, each value to the nearest
    doubled E2M1 value times half its power of two) and back."""
    b = x.reshape(-1, BLOCK)
    amax = b.abs().amax(1, keepdim=True)
    d = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(amax)) - 3), torch.zeros_like(amax))
    grid = (d * MXFP4_VALUES)[:, None, :]  # [blocks, 1, 15]
    best = (grid - b[:, :, None]).abs().argmin(-1)
    return (d * MXFP4_VALUES[best]).reshape(x.shape)


def q8_0_worse(x: torch.Tensor) -> torch.Tensor:
    return x + Q8_ERROR_HEADROOM * (round_q8_0(x) - x)


ROUNDINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "q8_0": round_q8_0, "q4_0": round_q4_0, "q8_0_x2": q8_0_worse}


def along_rows(x: torch.Tensor, rounding: Callable[[torch.Tensor], torch.Tensor],
               transposed: bool) -> torch.Tensor:
    """``rounding`` of a checkpoint tensor along the rows GGUF stores it in."""
    if transposed:
        return rounding(x.transpose(-1, -2).contiguous()).transpose(-1, -2)
    return rounding(x)


def quant_agreement(model: torch.nn.Module, ids: torch.Tensor, reference: torch.Tensor,
                    kinds: tuple[str, ...] = tuple(ROUNDINGS), gpt_oss: bool = False) -> dict[str, float]:
    """Top-1 agreement with ``reference`` over every position when the matrices a quantized
    conversion stores are rounded so (routers and vectors stay float32); ``kinds``: of
    ``ROUNDINGS``, and "mxfp4_moe" (experts MXFP4, the rest Q8_0); ``gpt_oss``: its experts are
    the transposed ones (``TRANSPOSED``)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = {}
    for kind in kinds:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                transposed = gpt_oss and is_expert(k)
                rows = v.transpose(-1, -2) if transposed else v
                if v.dim() < 2 or is_router(k) or rows.shape[-1] % BLOCK:
                    continue
                mxfp4 = kind == "mxfp4_moe" and is_expert(k)
                rounding = round_mxfp4 if mxfp4 else ROUNDINGS.get(kind, round_q8_0)
                v.copy_(along_rows(state[k], rounding, transposed))
            logits = model(ids).logits[0]
        out[kind] = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
        model.load_state_dict(state)
    return out


def mxfp4_grid(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    """Random values of about ``std`` that MXFP4 stores exactly: per block of the last axis, doubled
    E2M1 values with one of magnitude MXFP4_MAX (which sets the block's exponent), times a power of two."""
    scale = 2.0 ** round(math.log2(std / MXFP4_STD))
    k = MXFP4_VALUES[torch.randint(0, len(MXFP4_VALUES), shape, generator=gen)]
    blocks = k.reshape(-1, BLOCK).clone()
    at = torch.randint(0, BLOCK, (len(blocks),), generator=gen)
    sign = torch.randint(0, 2, (len(blocks),), generator=gen).float() * 2 - 1
    blocks[torch.arange(len(blocks)), at] = sign * MXFP4_MAX
    return (blocks * scale).reshape(shape)
