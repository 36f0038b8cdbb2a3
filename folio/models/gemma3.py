"""Gemma 3 (text): interleaved sliding-window and global layers, QK-norm, GeGLU, scaled embeddings.

Norms scale by (1 + weight), following the reference checkpoints; the GGUF loader converts llama.cpp's
pre-added ones back to that convention. The C++ decode step (decode_stack.py) serves whole models.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.config import ModelConfig
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.norm import RMSNorm
from folio.layers.rotary import RotaryEmbedding
from folio.models.base import GatedMLP
from folio.models.config_readers import (
    LLAMA_BLOCK_NAMES,
    LLAMA_TOP_NAMES,
    gguf_common_fields,
    hf_common_config,
    hf_common_fields,
    scaling_or_none,
)
from folio.models.decode_stack import Rope, build_decode_stack
from folio.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from folio.models.registry import Architecture, GGUFLayout, GGUFMetadata, HFConfig


class Gemma3Attention(LlamaAttention):
    qk_norm_offset = 1.0


def _norm(config: ModelConfig) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, weight_offset=1.0)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, attention: type[LlamaAttention]) -> None:
        super().__init__()
        self.self_attn = attention(config, layer_index)
        self.mlp = GatedMLP(config)
        self.input_layernorm = _norm(config)
        self.post_attention_layernorm = _norm(config)
        self.pre_feedforward_layernorm = _norm(config)
        self.post_feedforward_layernorm = _norm(config)

    def forward(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden), rope, meta)
        hidden = hidden + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class Gemma3Model(LlamaModel):
    """Llama's body with layers that add their own residuals, scaled embeddings, and a second RoPE for the
    sliding-window layers."""

    carries_residual = False
    attention = Gemma3Attention
    decoder_layer = Gemma3DecoderLayer
    norm_offset = 1.0

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.rotary_local = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_local_theta or 10000.0, None
        )
        self.embed_scale = config.hidden_size**0.5

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        return [rotary.cos_sin(positions, dtype) for rotary in (self.rotary, self.rotary_local)]

    def bind_decode_stack(self, dtype: torch.dtype) -> None:
        local = [int(layer.self_attn.is_sliding) for layer in self.layers]  # their RoPE: the second table
        self.decode_stack = build_decode_stack(self, dtype, sandwich=True, rope_tables=local)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The reference rounds the scale to the activation dtype before multiplying.
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def run_layers(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, None]:
        rope_global, rope_local = self.ropes(positions, hidden.dtype)
        for layer in self.held_layers():
            hidden = layer(hidden, rope_local if layer.self_attn.is_sliding else rope_global, meta)
        return hidden, None  # Llama's `finish` then norms the hidden states alone


class Gemma3ForCausalLM(LlamaForCausalLM):
    body = Gemma3Model


def _config_from_hf(raw: HFConfig) -> ModelConfig:
    fields = hf_common_fields(raw)
    fields.update(
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        sliding_window=raw.get("sliding_window"),
        layer_types=_layer_types(raw),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )
    params = raw.get("rope_parameters")
    if params and "full_attention" in params:  # new style: one entry per layer type
        full, local = params["full_attention"], params.get("sliding_attention", {})
        fields.update(rope_theta=full.get("rope_theta", 1e6), rope_scaling=scaling_or_none(full),
                      rope_local_theta=local.get("rope_theta", 10000.0))  # fmt: skip
    elif not params:
        fields.update(rope_local_theta=raw.get("rope_local_base_freq", 10000.0))
    return ModelConfig(**fields)


def _layer_types(raw: HFConfig) -> list[str]:
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(raw["num_hidden_layers"])
    ]


def _config_to_hf(config: ModelConfig) -> HFConfig:
    raw = hf_common_config(config, "gemma3_text")
    raw.update(
        hidden_activation=config.hidden_act,
        sliding_window=config.sliding_window,
        layer_types=config.layer_types,
        rope_local_base_freq=config.rope_local_theta,
        query_pre_attn_scalar=config.query_pre_attn_scalar,
        final_logit_softcapping=config.final_logit_softcapping,
    )
    return raw


def _config_from_gguf(gguf: GGUFMetadata) -> ModelConfig:
    fields = gguf_common_fields(gguf, "Gemma3ForCausalLM")
    num_layers = fields["num_layers"]
    # llama.cpp hard-codes Gemma 3's layout: every 6th layer is global, local layers use base 10k.
    fields.update(
        hidden_act="gelu_pytorch_tanh",
        sliding_window=int(gguf.arch_get("attention.sliding_window", 4096)),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)],
        rope_local_theta=10000.0,
        query_pre_attn_scalar=float(fields["head_dim"]),
        rope_theta=float(gguf.arch_get("rope.freq_base", 1e6)),
    )
    return ModelConfig(**fields)


_GGUF_BLOCK_NAMES = {
    **LLAMA_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

ARCHITECTURES = (
    Architecture(
        "gemma3",
        ("Gemma3ForCausalLM",),
        Gemma3ForCausalLM,
        _config_from_hf,
        _config_to_hf,
        gguf=GGUFLayout(("gemma3",), _config_from_gguf, _GGUF_BLOCK_NAMES, LLAMA_TOP_NAMES, norm_offset=1.0),
        tokenizer_family="gemma",
        decode_stack=True,
        hf_refused={
            "Gemma3ForConditionalGeneration": "multimodal Gemma 3 checkpoints are not supported; use a text-only "
            "(Gemma3ForCausalLM) one"
        },
    ),
)
