"""Qwen3 (dense): the Llama layout with an RMSNorm on each query and key head before RoPE (QK-norm)
and no q/k/v bias. The C++ decode step (decode_stack.py) serves it as it serves Llama."""

from __future__ import annotations

from folio.config import ModelConfig
from folio.models.config_readers import (
    LLAMA_BLOCK_NAMES,
    LLAMA_TOP_NAMES,
    gguf_common_fields,
    hf_common_config,
    hf_common_fields,
)
from folio.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from folio.models.registry import Architecture, GGUFLayout, GGUFMetadata, HFConfig


class Qwen3Attention(LlamaAttention):
    qk_norm_offset = 0.0


class Qwen3Model(LlamaModel):
    attention = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    body = Qwen3Model


def _config_from_hf(raw: HFConfig) -> ModelConfig:
    fields = hf_common_fields(raw)
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        # Qwen3 windows the layers from max_window_layers on.
        first = raw.get("max_window_layers", fields["num_layers"])
        fields.update(
            sliding_window=raw["sliding_window"],
            layer_types=["full_attention" if i < first else "sliding_attention" for i in range(fields["num_layers"])],
        )
    return ModelConfig(**fields)


def _config_to_hf(config: ModelConfig) -> HFConfig:
    raw = hf_common_config(config, "qwen3")
    if config.layer_types:
        first = config.layer_types.index("sliding_attention")
        raw.update(sliding_window=config.sliding_window, use_sliding_window=True, max_window_layers=first)
    return raw


def _config_from_gguf(gguf: GGUFMetadata) -> ModelConfig:
    return ModelConfig(**gguf_common_fields(gguf, "Qwen3ForCausalLM"))


# llama.cpp's Qwen3 converter keeps q/k rows as they are (no RoPE permutation, unlike its Llama one).
_GGUF = GGUFLayout(("qwen3",), _config_from_gguf, LLAMA_BLOCK_NAMES, LLAMA_TOP_NAMES)

ARCHITECTURES = (
    Architecture(
        "qwen3", ("Qwen3ForCausalLM",), Qwen3ForCausalLM, _config_from_hf, _config_to_hf, gguf=_GGUF, decode_stack=True
    ),
)
