"""Phi-3: the Llama layout, with q/k/v and gate/up already fused in the checkpoint (`qkv_proj`,
`gate_up_proj`), so its tensors load whole into folio's fused layers; a sliding window, when the
config sets one, applies to every layer. The C++ decode step serves it like any Llama."""

from __future__ import annotations

from folio.config import ModelConfig
from folio.models.base import StackedMapping
from folio.models.config_readers import LLAMA_TOP_NAMES, gguf_common_fields, hf_common_config, hf_common_fields
from folio.models.llama import LlamaForCausalLM
from folio.models.registry import Architecture, GGUFLayout, GGUFMetadata, HFConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    stacked_params: StackedMapping = []  # nothing to stack: the checkpoint's names are the fused layers'


def _config_from_hf(raw: HFConfig) -> ModelConfig:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("Phi-3 checkpoints with partial rotary embeddings (Phi-4-mini) are not supported")
    fields = hf_common_fields(raw)
    if raw.get("sliding_window"):
        fields.update(sliding_window=raw["sliding_window"], layer_types=["sliding_attention"] * fields["num_layers"])
    return ModelConfig(**fields)


def _config_to_hf(config: ModelConfig) -> HFConfig:
    return {**hf_common_config(config, "phi3"), "sliding_window": config.sliding_window}


def _config_from_gguf(gguf: GGUFMetadata) -> ModelConfig:
    fields = gguf_common_fields(gguf, "Phi3ForCausalLM")
    if int(gguf.arch_get("rope.dimension_count", fields["head_dim"])) != fields["head_dim"]:
        raise ValueError("Phi-3 GGUF files with partial rotary embeddings are not supported")
    window = gguf.arch_get("attention.sliding_window")
    if window:
        fields.update(sliding_window=int(window), layer_types=["sliding_attention"] * fields["num_layers"])
    return ModelConfig(**fields)


# llama.cpp keeps Phi-3's fused tensors fused: attn_qkv, and ffn_up holding gate and up.
_GGUF_BLOCK_NAMES = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

ARCHITECTURES = (
    Architecture(
        "phi3",
        ("Phi3ForCausalLM",),
        Phi3ForCausalLM,
        _config_from_hf,
        _config_to_hf,
        gguf=GGUFLayout(("phi3",), _config_from_gguf, _GGUF_BLOCK_NAMES, LLAMA_TOP_NAMES),
        decode_stack=True,
    ),
)
