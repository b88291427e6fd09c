"""config.json as the checkpoint's authors and transformers write it, read one way.

The same setting is spelled differently across transformers versions, and convert reads every
spelling: rope settings in ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers
5, which also moves ``rope_theta`` and ``partial_rotary_factor`` inside), ``type`` or
``rope_type``, expert counts under three names. Where two spellings are both present and
disagree, the conversion stops with an error naming both: guessing which one the model was
trained with is not convert's to do. ``torch_dtype`` / ``dtype`` are not read: every tensor's own
safetensors header says what it holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri.errors import ColibriError

DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names none
ROPE_KEYS = ("rope_parameters", "rope_scaling")  # transformers 5's name, then transformers 4's
# Keys that may sit at the top level or inside the rope dict (transformers 5 moved them in).
ROPE_MOVED = ("rope_theta", "partial_rotary_factor")
# transformers 5's rope settings per layer type (Gemma 3): global layers, then local ones.
GLOBAL_LAYERS, LOCAL_LAYERS = "full_attention", "sliding_attention"
# transformers 4's name for the local layers' rope base (Gemma 3).
LOCAL_ROPE_THETA = "rope_local_base_freq"


class ConvertError(ColibriError):
    """A checkpoint that cannot be converted, with the reason."""


def read_rope(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The rope settings of ``rope_parameters`` and ``rope_scaling`` as one dict, its type under
    ``rope_type``; an error if the two say different things or the settings are per layer type."""
    parts = []
    for key in ROPE_KEYS:
        value = raw.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise ConvertError(f"config.json: {key} is {value!r}, not an object")
        part = dict(value or {})
        if "type" in part and "rope_type" not in part:
            part["rope_type"] = part.pop("type")
        nested = [k for k, v in part.items() if isinstance(v, Mapping)]
        if nested:
            raise ConvertError(f"config.json: {key} has settings per layer type ({', '.join(nested)}); "
                               "these architectures have one rope")
        parts.append(part)
    new, old = parts
    for k in sorted(new.keys() & old.keys()):
        if new[k] != old[k]:
            raise ConvertError(f"config.json: rope_parameters and rope_scaling disagree on {k} "
                               f"({new[k]!r} and {old[k]!r})")
    merged = old | new
    for k in ROPE_MOVED:
        top, inside = raw.get(k), merged.get(k)
        if top is not None and inside is not None and float(top) != float(inside):
            raise ConvertError(f"config.json: {k} is {top!r}, but {inside!r} inside the rope settings")
    return merged


def split_layer_ropes(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """For a model with global and local (sliding-window) layers: config.json with the global
    layers' rope settings where every other model has its one rope, and the local layers' settings
    (``rope_type`` and ``rope_theta``; empty when the config names none). transformers 5 writes
    both inside ``rope_parameters``, transformers 4 the local base as ``rope_local_base_freq``."""
    out = dict(raw)
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and (GLOBAL_LAYERS in params or LOCAL_LAYERS in params):
        unknown = sorted(k for k in params if k not in (GLOBAL_LAYERS, LOCAL_LAYERS))
        if unknown:
            raise ConvertError(f"config.json: rope_parameters has settings of unknown layer types {unknown}")
        out["rope_parameters"] = params.get(GLOBAL_LAYERS)
        local = params.get(LOCAL_LAYERS) or {}
        if not isinstance(local, Mapping):
            raise ConvertError(f"config.json: rope_parameters.{LOCAL_LAYERS} is {local!r}, not an object")
        return out, read_rope({"rope_parameters": local})
    theta = raw.get(LOCAL_ROPE_THETA)
    return out, {} if theta is None else {"rope_type": "default", "rope_theta": theta}


class Config:
    """config.json, with the lookups every architecture needs and errors that name the key."""

    def __init__(self, raw: Mapping[str, Any], layer_ropes: bool = False) -> None:
        """``layer_ropes``: the model has global and local layers with their own ropes
        (``rope`` is then the global layers', ``rope_local`` the local layers')."""
        self.rope_local: dict[str, Any] = {}
        if layer_ropes:
            raw, self.rope_local = split_layer_ropes(raw)
        self.raw = dict(raw)
        self.rope = read_rope(raw)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.raw.get(key)
        if value is None:
            raise ConvertError(f"config.json: {key} is missing")
        return value

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default) if default is not None else self.need(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConvertError(f"config.json: {key} is {value!r}, not a count")
        return value

    def first_int(self, *keys: str, default: int | None = None) -> int:
        """The first of ``keys`` the config has (configs name some sizes differently across
        transformers versions, e.g. ``num_experts`` and ``num_local_experts``)."""
        key = next((k for k in keys if self.get(k) is not None), keys[0])
        return self.int(key, default)

    def first_key(self, *keys: str) -> str:
        """The first of ``keys`` the config has, else the first (for messages)."""
        return next((k for k in keys if self.get(k) is not None), keys[0])

    def rope_theta(self) -> float:
        return float(self.get("rope_theta", self.rope.get("rope_theta", DEFAULT_ROPE_THETA)))

    def partial_rotary_factor(self, default: float) -> float:
        return float(self.get("partial_rotary_factor", self.rope.get("partial_rotary_factor", default)))

    def rope_type(self) -> str:
        return str(self.rope.get("rope_type") or "default")

    def rope_number(self, key: str) -> float:
        """A number of the rope scaling settings, or an error naming it."""
        value = self.rope.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConvertError(f"config.json: rope scaling {self.rope_type()!r} needs a number {key}, "
                               f"not {value!r}")
        return float(value)

    def check_not_quantized(self, allowed: tuple[str, ...] = ()) -> None:
        """A pre-quantized checkpoint (FP8, GPTQ, AWQ, bitsandbytes) stores other tensors than the
        float weights convert reads; say so, rather than fail on its first odd tensor. ``allowed``:
        the methods an architecture reads (gpt-oss's released ``mxfp4``)."""
        q = self.get("quantization_config")
        if q is not None:
            method = q.get("quant_method", "?") if isinstance(q, Mapping) else q
            if method in allowed:
                return
            raise ConvertError(f"config.json: the checkpoint is quantized (quantization_config, "
                               f"quant_method {method!r}); convert reads F32, F16 and BF16 weights: "
                               "use the unquantized checkpoint")
