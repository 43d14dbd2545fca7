"""Which model class serves a checkpoint: config.json's ``model_type`` -> the class.

    config.json --ModelConfig.from_dict (checks SUPPORTED_MODEL_TYPES)--> ModelConfig
    loader: model_class(config)(config, layers, stage) -> the model, weights by name

Classes are named by module and attribute and imported on first use, so that the engine's
config can list the supported types without importing torch or any model file.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.agent.engine.config import ModelConfig

_LLAMA = ("slipstream.agent.engine.models.llama", "LlamaForCausalLM")
_MOE = ("slipstream.agent.engine.models.moe", "MoEForCausalLM")

MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": ("slipstream.agent.engine.models.qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("slipstream.agent.engine.models.gemma", "Gemma2ForCausalLM"),
    "gemma3_text": ("slipstream.agent.engine.models.gemma", "Gemma3ForCausalLM"),
    # Mixture-of-experts: one sparse block for all four (models/moe.py, moe_config.py).
    "mixtral": _MOE,
    "qwen2_moe": _MOE,
    "qwen3_moe": _MOE,
    "olmoe": _MOE,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(MODEL_CLASSES))

# Configs written without a model_type (older tools) name their class only.
_TYPE_OF_ARCHITECTURE = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe",
}


def model_type_of(raw: dict[str, Any]) -> str:
    """config.json's ``model_type``, or the one its ``architectures`` imply; "" if neither."""
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type:
        return model_type
    for architecture in raw.get("architectures") or []:
        if architecture in _TYPE_OF_ARCHITECTURE:
            return _TYPE_OF_ARCHITECTURE[architecture]
    return ""


def model_class(config: ModelConfig) -> Any:
    """The class whose ``(config, layers, stage)`` builds this model."""
    module, name = MODEL_CLASSES[config.model_type]
    return getattr(importlib.import_module(module), name)
