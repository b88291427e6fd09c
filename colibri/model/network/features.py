"""What ``coli info`` says of a file's architecture: the variants its layers use, read from the
metadata and the tensors present (no weights loaded), in the words the docs use."""

from __future__ import annotations

from colibri.model.hparams import HParams
from colibri.model.network.decoder import Decoder
from colibri.store.gguf import GGUFFile


def _any(gguf: GGUFFile, suffix: str) -> bool:
    return any(name.endswith(suffix) for name in gguf.tensors)


def features(gguf: GGUFFile, hp: HParams, arch: type[Decoder]) -> list[str]:
    """The architecture's features, one short phrase each."""
    out = []
    sliding = [i for i in range(hp.n_layers) if arch.is_sliding(hp, i)]
    if sliding:
        local = arch.local_rope_base(hp)
        base = f" (local rope base {local:g})" if local != hp.rope_base else ""
        out.append(f"sliding window {hp.sliding_window} on {len(sliding)} of {hp.n_layers} layers{base}")
    if _any(gguf, "attn_q_norm.weight"):
        out.append("q/k norms")
    if _any(gguf, "attn_q.bias") or _any(gguf, "attn_qkv.bias"):
        out.append("q/k/v biases")
    if _any(gguf, "attn_qkv.weight"):
        out.append("fused qkv")
    if _any(gguf, "attn_sinks.weight"):
        out.append("attention sinks")
    if _any(gguf, "attn_output.bias"):
        out.append("output bias")
    if hp.n_expert == 0 and not _any(gguf, "ffn_gate.weight") and _any(gguf, "ffn_up.weight"):
        out.append("fused gate/up")
    if arch.ATTN_POST_NORM or arch.FFN_POST_NORM:
        out.append("post-norms")
    clamp = f"clamped SwiGLU (alpha {arch.SWIGLU_CLAMP[0]:g}, limit {arch.SWIGLU_CLAMP[1]:g})"
    out.append("GeGLU (tanh GELU)" if arch.GELU else clamp if arch.SWIGLU_CLAMP[1] else "SwiGLU")
    out.append("NEOX rope" if arch.NEOX else "rope on adjacent pairs")
    if hp.rope_dim < hp.head_dim:
        out.append(f"partial rotary ({hp.rope_dim} of {hp.head_dim})")
    if hp.rope_linear != 1.0:
        out.append(f"linear rope scaling x{hp.rope_linear:g}")
    if hp.rope_scaling == "yarn":
        rounding = "" if hp.yarn_truncate else ", its blend range unrounded"
        out.append(f"YaRN rope scaling x{hp.rope_factor:g} from {hp.n_ctx_orig} positions{rounding}")
    if "rope_freqs.weight" in gguf.tensors:
        out.append("rope frequency factors (Llama 3 scaling)")
    if "rope_factors_long.weight" in gguf.tensors:
        out.append(f"long rope factors past {hp.n_ctx_orig} positions (attention factor "
                   f"{hp.rope_attn_factor:.4g})")
    if hp.sliding_window and not sliding:
        out.append(f"the file's sliding window ({hp.sliding_window}) not applied, as llama.cpp")
    if hp.n_expert:
        out.append(f"{hp.n_expert} experts, top {hp.n_expert_used}")
    if _any(gguf, "ffn_down_exps.bias"):
        out.append("expert biases")
    if "output.weight" not in gguf.tensors:
        out.append("tied embeddings")
    if hp.n_nextn:
        used = "the first drafts tokens (--speculative mtp or auto)" if arch.NEXTN else "not run"
        out.append(f"{hp.n_nextn} NextN (MTP) layer{'s' if hp.n_nextn > 1 else ''}: {used}")
    return out
