"""Hyperparameters of a model, read from its GGUF metadata under the architecture's prefix.

The mixture-of-experts fields are optional, with the value a dense model has (0, or None for "not
in the file"), so a dense model's file needs none of them; the keys are llama.cpp's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from colibri.store.gguf import GGUFError, GGUFFile


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layers: int  # layers the forward pass runs (block_count less any next-token-prediction layers)
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float
    norm_eps: float
    n_vocab: int
    context_length: int
    # Mixture of experts (0 / None in a dense model).
    n_expert: int = 0  # expert_count: routed experts per MoE layer
    n_expert_used: int = 0  # expert_used_count: experts each token is routed to (top-k)
    n_ff_exp: int = 0  # expert_feed_forward_length: rows of one expert's gate (and up) matrix
    n_ff_shexp: int = 0  # expert_shared_feed_forward_length
    n_expert_shared: int = 0  # expert_shared_count
    n_expert_groups: int = 0  # expert_group_count: grouped top-k when > 1
    n_group_used: int = 0  # expert_group_used_count: groups kept
    n_dense_lead: int = 0  # leading_dense_block_count: the first layers have a dense FFN
    expert_weights_scale: float = 0.0  # routed scaling factor (0: none)
    expert_weights_norm: bool | None = None  # renormalise the top-k weights; None: arch default
    expert_gating_func: int = 0  # 0: the architecture's default, 1: softmax, 2: sigmoid
    # Attention and RoPE variants (the plain value where the file says nothing).
    sliding_window: int = 0  # attention.sliding_window: positions a local layer attends to (0: none)
    swa_pattern: int | tuple[bool, ...] | None = None  # attention.sliding_window_pattern: period or per layer
    rope_base_swa: float = 10000.0  # rope.freq_base_swa: the local layers' base (llama.cpp's default)
    rope_scaling: str = "linear"  # rope.scaling.type (llama.cpp's default); ROPE_SCALINGS: computed
    rope_linear: float = 1.0  # rope.scaling.factor of a "linear" scaling: positions divided by it
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor: RoPE's rotated pairs times it (Phi)
    rope_factor: float = 1.0  # rope.scaling.factor, whatever the type (YaRN's: ``yarn.py``)
    yarn_beta_fast: float = 32.0  # rope.scaling.yarn_beta_fast (llama.cpp's default)
    yarn_beta_slow: float = 1.0  # rope.scaling.yarn_beta_slow
    yarn_log_mul: float = 0.0  # rope.scaling.yarn_log_multiplier: DeepSeek's 0.1 * mscale_all_dim
    # rope.scaling.yarn_truncate (colibri's key; llama.cpp always truncates): whether YaRN's blend
    # range is rounded out to whole pairs, as transformers' ``truncate`` (default true; gpt-oss's false)
    yarn_truncate: bool = True
    n_ctx_orig: int = 0  # rope.scaling.original_context_length: past it, the long RoPE factors
    n_nextn: int = 0  # nextn_predict_layers: the file's last blocks, next-token-prediction (MTP) layers
    # Multi-head latent attention (deepseek2; 0 elsewhere): the cache's one kv head holds a token's
    # latent and its rope key (head_dim = kv_lora_rank + rope_dim); a query head's key and value
    # are key_length_mla and value_length_mla wide.
    q_lora_rank: int = 0  # attention.q_lora_rank: q through a low rank (0: from the hidden state)
    kv_lora_rank: int = 0  # attention.kv_lora_rank: the latent's width
    head_dim_mla: int = 0  # attention.key_length_mla: a query head's nope and rope parts
    v_dim_mla: int = 0  # attention.value_length_mla: a head's value

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> HParams:
        arch = gguf.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{gguf.path}: no general.architecture in the metadata")

        def need(key: str) -> int | float:
            value = gguf.get(f"{arch}.{key}")
            if value is None:
                raise GGUFError(f"{gguf.path}: metadata {arch}.{key} is missing")
            return value

        def opt(key: str, default: int | float = 0) -> int | float:
            return gguf.get(f"{arch}.{key}", default)

        n_embd, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
        head_dim = int(gguf.get(f"{arch}.attention.key_length", n_embd // n_heads))
        embd = gguf.tensors.get("token_embd.weight")
        n_vocab = int(gguf.get(f"{arch}.vocab_size", embd.shape[1] if embd else 0))
        norm = gguf.get(f"{arch}.expert_weights_norm")
        scaling = str(gguf.get(f"{arch}.rope.scaling.type", "linear"))
        pattern = gguf.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):
            pattern = tuple(bool(v) for v in pattern)
        hp = cls(
            arch=arch,
            n_layers=int(need("block_count")) - int(opt("nextn_predict_layers")),
            n_nextn=int(opt("nextn_predict_layers")),
            n_embd=n_embd,
            n_ff=int(need("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(gguf.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rope_dim=int(gguf.get(f"{arch}.rope.dimension_count", head_dim)),
            rope_base=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
            norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            n_vocab=n_vocab,
            context_length=int(gguf.get(f"{arch}.context_length", 2048)),
            expert_weights_norm=None if norm is None else bool(norm),
            **{name: int(opt(key)) for name, key in _INT_KEYS.items()},
            expert_weights_scale=float(opt("expert_weights_scale", 0.0)),
            sliding_window=int(opt("attention.sliding_window")),
            swa_pattern=pattern if pattern is None or isinstance(pattern, tuple) else int(pattern),
            rope_base_swa=float(opt("rope.freq_base_swa", 10000.0)),
            rope_scaling=scaling,
            rope_linear=float(opt("rope.scaling.factor", 0.0) or 1.0) if scaling == "linear" else 1.0,
            rope_attn_factor=float(opt("rope.scaling.attn_factor", 1.0)),
            rope_factor=float(opt("rope.scaling.factor", 0.0) or 1.0),
            yarn_beta_fast=float(opt("rope.scaling.yarn_beta_fast", 32.0)),
            yarn_beta_slow=float(opt("rope.scaling.yarn_beta_slow", 1.0)),
            yarn_log_mul=float(opt("rope.scaling.yarn_log_multiplier", 0.0)),
            yarn_truncate=bool(opt("rope.scaling.yarn_truncate", arch not in UNTRUNCATED_YARN)),
            n_ctx_orig=int(opt("rope.scaling.original_context_length",
                               gguf.get(f"{arch}.context_length", 2048))),
        )
        return hp.legacy_mla(int(opt("attention.value_length", head_dim))) if hp.kv_lora_rank else hp

    def legacy_mla(self, value_length: int) -> HParams:
        """A latent-attention file converted before llama.cpp split ``attn_kv_b`` (no
        ``key_length_mla``): its key and value lengths are a query head's, its kv heads the
        heads. Read as the split files say it: the cache's one kv head of the latent and rope key,
        the heads' widths in the ``_mla`` fields (``network/mla.py`` splits ``attn_kv_b`` at load)."""
        if self.head_dim_mla:
            return self
        return replace(self, head_dim_mla=self.head_dim, v_dim_mla=value_length, n_kv_heads=1,
                       head_dim=self.kv_lora_rank + self.rope_dim)

    @property
    def kv_layers(self) -> int:
        """Layers with K/V in the cache: the file's next-token-prediction layer has its own, run or
        not (slot files keep one layout whether ``--speculative`` loads it)."""
        return self.n_layers + (self.n_nextn > 0)

    @property
    def kv_values_per_token(self) -> int:
        """Values a token keeps in one layer of the cache: its kv heads' keys and values, or (latent
        attention) its latent and rope key alone."""
        return self.n_kv_heads * self.head_dim * (1 if self.kv_lora_rank else 2)

    @property
    def kv_values_uncompressed(self) -> int:
        """What ``kv_values_per_token`` would be without latent attention: every head's key and value
        (the same where there is none)."""
        if not self.kv_lora_rank:
            return self.kv_values_per_token
        return self.n_heads * (self.head_dim_mla + self.v_dim_mla)

    def unsupported_rope(self) -> str | None:
        """Why the engine cannot compute this file's RoPE, or None: a scaling outside
        ``ROPE_SCALINGS`` (the loader refuses it; ``coli info`` says it)."""
        if self.rope_scaling in ROPE_SCALINGS:
            return None
        return f"RoPE scaling {self.rope_scaling!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})"


# Optional integer fields and their keys (0 where the file has none: a dense model, no MLA).
_INT_KEYS = {
    "n_expert": "expert_count", "n_expert_used": "expert_used_count",
    "n_ff_exp": "expert_feed_forward_length", "n_ff_shexp": "expert_shared_feed_forward_length",
    "n_expert_shared": "expert_shared_count", "n_expert_groups": "expert_group_count",
    "n_group_used": "expert_group_used_count", "n_dense_lead": "leading_dense_block_count",
    "expert_gating_func": "expert_gating_func",
    "q_lora_rank": "attention.q_lora_rank", "kv_lora_rank": "attention.kv_lora_rank",
    "head_dim_mla": "attention.key_length_mla", "v_dim_mla": "attention.value_length_mla",
}

# RoPE scalings computed here: none, "linear" (positions divided by the factor; llama.cpp's reading
# of a factor without a type), "longrope" (Phi's: the converter bakes it into per-frequency
# factor tensors, ``rope_factors_short``/``_long``, as it bakes Llama 3's into ``rope_freqs``;
# ``decoder.py`` divides by them) and "yarn" (per-frequency divisors and a magnitude computed at
# load: ``yarn.py``). Another type is refused rather than run with RoPE it was not trained with.
ROPE_SCALINGS = ("none", "linear", "longrope", "yarn")
# The architectures whose reference YaRN blends over the unrounded range (gpt-oss's config says
# ``truncate: false``), where a file does not say (llama.cpp's converter writes no such key).
UNTRUNCATED_YARN = frozenset({"gpt-oss"})
