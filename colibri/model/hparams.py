"""Hyperparameters of a model, read from its GGUF metadata under the architecture's prefix."""

from __future__ import annotations

from dataclasses import dataclass

from colibri.store.gguf import GGUFError, GGUFFile


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layers: int
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

        n_embd, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
        head_dim = int(gguf.get(f"{arch}.attention.key_length", n_embd // n_heads))
        embd = gguf.tensors.get("token_embd.weight")
        n_vocab = int(gguf.get(f"{arch}.vocab_size", embd.shape[1] if embd else 0))
        return cls(
            arch=arch,
            n_layers=int(need("block_count")),
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
        )
