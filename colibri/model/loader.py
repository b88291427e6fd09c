"""Opening a model file: the container, its hyperparameters, the network for its architecture."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from colibri.model.chat import ChatTemplate
from colibri.model.glm4moe import Glm4MoeModel
from colibri.model.hparams import HParams
from colibri.model.llama import LlamaModel
from colibri.model.qwen_moe import Qwen2MoeModel, Qwen3MoeModel
from colibri.model.tokenizer import GGUFTokenizer
from colibri.store.gguf import GGUFError, GGUFFile

# GGUF general.architecture -> network. Mixtral-style models are "llama" with expert tensors.
ARCHITECTURES = {
    "llama": LlamaModel,
    "qwen2moe": Qwen2MoeModel,
    "qwen3moe": Qwen3MoeModel,
    "glm4moe": Glm4MoeModel,
}


class Model:
    """A loaded model. The tokenizer and template are built on first use: ``--prompt-ids`` runs
    need neither, and test models may carry no vocabulary."""

    def __init__(self, path: Path, ram_budget: int | None = None) -> None:
        """``ram_budget``: bytes the expert store's resident copies may take (None: no limit)."""
        self.gguf = GGUFFile(path)
        self.hp = HParams.from_gguf(self.gguf)
        arch = ARCHITECTURES.get(self.hp.arch)
        if arch is None:
            raise GGUFError(
                f"{path}: architecture {self.hp.arch!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        self.net = arch(self.gguf, self.hp, ram_budget)

    @cached_property
    def tokenizer(self) -> GGUFTokenizer:
        return GGUFTokenizer(self.gguf)

    @cached_property
    def chat_template(self) -> ChatTemplate:
        tok = self.tokenizer
        bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
        eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
        return ChatTemplate(self.gguf.get("tokenizer.chat_template"), bos, eos)
