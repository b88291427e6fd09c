"""Which Hugging Face architectures ``coli convert`` reads, what each becomes in GGUF, and the plan
of a conversion (``make_plan``): the metadata and tensors, checked against the checkpoint.

The building blocks are in ``plan``; the dense architectures' plans (llama, qwen2, qwen3, gemma3,
phi3) in ``dense``, the mixture-of-experts ones (qwen2moe, qwen3moe, glm4moe, olmoe) in ``moe``, DeepSeek's
(deepseek2) in ``deepseek``, gpt-oss's in ``gpt_oss``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from colibri.convert.checkpoint_config import Config, ConvertError
from colibri.convert.deepseek import plan_deepseek2
from colibri.convert.dense import plan_gemma3, plan_llama, plan_phi3, plan_qwen2
from colibri.convert.gpt_oss import plan_gpt_oss
from colibri.convert.moe import plan_glm4moe, plan_olmoe, plan_qwen_moe
from colibri.convert.plan import Builder, Dims, Plan, TensorPlan

__all__ = ["ARCHITECTURES", "ConvertError", "Plan", "TensorPlan", "make_plan"]

# Hugging Face ``architectures[0]`` -> GGUF architecture. llama.cpp writes Mixtral as "llama" with
# expert tensors; it has no "mixtral" architecture of its own.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Glm4MoeForCausalLM": "glm4moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
    "GptOssForCausalLM": "gpt-oss",
}
PLANNERS = {"llama": plan_llama, "qwen2": plan_qwen2, "qwen3": plan_qwen2, "gemma3": plan_gemma3,
            "phi3": plan_phi3, "qwen2moe": plan_qwen_moe, "qwen3moe": plan_qwen_moe, "glm4moe": plan_glm4moe,
            "olmoe": plan_olmoe, "deepseek2": plan_deepseek2, "gpt-oss": plan_gpt_oss}
# The pre-quantized checkpoints an architecture reads: gpt-oss's release, its experts MXFP4.
QUANTIZED_READ = {"gpt-oss": ("mxfp4",)}
# Architectures whose global and local (sliding-window) layers have ropes of their own.
LAYER_ROPES = ("gemma3",)


def make_plan(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Plan:
    """The conversion plan for a checkpoint with ``config`` and tensors of ``shapes``."""
    archs = config.get("architectures") or []
    hf_arch = archs[0] if isinstance(archs, list) and archs else None
    if hf_arch not in ARCHITECTURES:
        raise ConvertError(f"unsupported architecture {hf_arch!r} (supported: {', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES[hf_arch]
    cfg = Config(config, layer_ropes=arch in LAYER_ROPES)
    cfg.check_not_quantized(QUANTIZED_READ.get(arch, ()))
    plan = Plan(arch, hf_arch)
    d = Dims.read(cfg)
    plan.n_vocab = d.n_vocab
    b = Builder(plan, shapes)
    PLANNERS[plan.arch](b, cfg, d)
    extra = b.leftovers()
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ConvertError(f"unexpected tensor {extra[0]!r}{more} (not part of a {hf_arch} model)")
    for t in plan.tensors:
        if math.prod(t.shape) == 0:
            raise ConvertError(f"tensor {t.name} would be empty ({list(t.shape)})")
    return plan
