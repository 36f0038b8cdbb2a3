"""Architecture name (as in config.json's "architectures") -> model class."""

from __future__ import annotations

from torch import nn

from folio.config import ModelConfig
from folio.models.gemma3 import Gemma3ForCausalLM
from folio.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"architecture {config.architecture!r} is not supported; folio runs {known}") from None
