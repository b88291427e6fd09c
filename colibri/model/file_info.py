"""What ``coli info`` says of a model file: sizes, hyperparameters, the architecture's features, and
its block types, read from the metadata and the tensor directory (no weights loaded, so a file the
engine cannot run is still described, with the reason)."""

from __future__ import annotations

from collections import Counter

from colibri.model.hparams import HParams
from colibri.model.loader import unsupported
from colibri.model.network import ARCHITECTURES
from colibri.model.network.features import features
from colibri.store.formats import SUPPORTED
from colibri.store.gguf import GGUFFile, TensorInfo


def describe(gguf: GGUFFile) -> list[str]:
    hp = HParams.from_gguf(gguf)
    types = Counter(t.gtype.name for t in gguf.tensors.values())
    n_params = sum(t.n_elements for t in gguf.tensors.values())
    return [
        f"file          {gguf.path} ({gguf.file_size / 2**20:.1f} MiB, GGUF v{gguf.version})",
        f"name          {gguf.get('general.name', '?')}",
        f"architecture  {hp.arch}",
        f"parameters    {n_params / 1e6:.1f} M",
        f"layers        {hp.n_layers}",
        f"embedding     {hp.n_embd}",
        f"feed-forward  {hp.n_ff}",
        f"heads         {hp.n_heads} (kv {hp.n_kv_heads}, dim {hp.head_dim})",
        f"kv cache      {kv_cache_line(hp)}",
        f"context       {hp.context_length}",
        f"vocabulary    {hp.n_vocab}",
        f"rope base     {hp.rope_base:g}",
        f"features      {architecture_features(gguf, hp)}",
        f"tensors       {len(gguf.tensors)}",
        f"block types   {', '.join(f'{k} x{v}' for k, v in sorted(types.items()))}",
        *(f"  {line}" for line in block_type_lines(gguf)),
    ]


def kv_cache_line(hp: HParams) -> str:
    """A slot's cache per token, in the default halves; latent attention's against the heads' keys
    and values it stands for."""
    line = f"{hp.kv_layers * hp.kv_values_per_token * 2:,} bytes a token (f16)"
    if hp.kv_lora_rank:
        ratio = hp.kv_values_uncompressed / hp.kv_values_per_token
        line += (f": latent attention, {hp.kv_values_per_token} values a layer where the heads' keys "
                 f"and values would take {hp.kv_values_uncompressed} ({ratio:.1f}x)")
    return line


def architecture_features(gguf: GGUFFile, hp: HParams) -> str:
    """The architecture's features, or why the engine cannot run it."""
    arch = ARCHITECTURES.get(hp.arch)
    if arch is None:
        return unsupported(hp.arch)
    if (why := hp.unsupported_rope()) is not None:
        return why
    return ", ".join(features(gguf, hp, arch))


def block_type_lines(gguf: GGUFFile) -> list[str]:
    """One line per block type of the file: its tensors and bytes, and for a type the kernels do
    not compute on, the first such tensor and the types they do (``coli run`` would stop there)."""
    by_type: dict[str, list[TensorInfo]] = {}
    for t in gguf.tensors.values():
        by_type.setdefault(t.gtype.name, []).append(t)
    supported = ", ".join(sorted(t.name for t in SUPPORTED))
    lines = []
    for name, tensors in sorted(by_type.items()):
        n, nbytes = len(tensors), sum(t.nbytes for t in tensors)
        line = f"{name:<8}{n:>6} tensor{'s' if n != 1 else ' '}{nbytes / 2**20:>10.1f} MiB"
        if tensors[0].gtype not in SUPPORTED:
            more = f" (and {n - 1} more)" if n > 1 else ""
            line += (f"  unsupported: tensor {tensors[0].name!r}{more} has block type {name}, which "
                     f"the kernels do not compute on (supported: {supported})")
        lines.append(line)
    return lines
