"""The network: the decoder loop every architecture shares (``decoder.py``), the parts of its
layers (``layers.py``, ``moe.py``), both ends (``embedding.py``), reading weights (``weights.py``),
and one small subclass per architecture family. The model's insides: only ``colibri.model``'s own
modules import from here; the engine sees a loaded model through ``colibri.model.interface``."""

from colibri.model.network.decoder import Decoder
from colibri.model.network.deepseek2 import Deepseek2Decoder
from colibri.model.network.dense import Phi3Decoder, Qwen2Decoder, Qwen3Decoder
from colibri.model.network.gemma3 import Gemma3Decoder
from colibri.model.network.glm4moe import Glm4MoeDecoder
from colibri.model.network.gpt_oss import GptOssDecoder
from colibri.model.network.llama import LlamaDecoder
from colibri.model.network.olmoe import OlmoeDecoder
from colibri.model.network.qwen_moe import Qwen2MoeDecoder, Qwen3MoeDecoder

# GGUF general.architecture -> network. Mixtral-style models are "llama" with expert tensors.
ARCHITECTURES: dict[str, type[Decoder]] = {
    "llama": LlamaDecoder,
    "qwen2": Qwen2Decoder,
    "qwen3": Qwen3Decoder,
    "phi3": Phi3Decoder,
    "gemma3": Gemma3Decoder,
    "qwen2moe": Qwen2MoeDecoder,
    "qwen3moe": Qwen3MoeDecoder,
    "glm4moe": Glm4MoeDecoder,
    "olmoe": OlmoeDecoder,
    "deepseek2": Deepseek2Decoder,
    "gpt-oss": GptOssDecoder,
}

__all__ = ["ARCHITECTURES", "Decoder"]
