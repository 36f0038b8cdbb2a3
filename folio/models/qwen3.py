"""Qwen3 (dense): the Llama layout with an RMSNorm on each query and key head before RoPE (QK-norm)
and no q/k/v bias. The C++ decode step (decode_stack.py) serves it as it serves Llama."""

from __future__ import annotations

import torch

from folio.config import ModelConfig
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.norm import RMSNorm
from folio.layers.rotary import apply_rotary
from folio.models.architecture import Architecture, GGUFLayout, GGUFMetadata, HFConfig
from folio.models.base import CausalLM
from folio.models.config_readers import (
    LLAMA_BLOCK_NAMES,
    LLAMA_TOP_NAMES,
    gguf_common_fields,
    hf_common_config,
    hf_common_fields,
)
from folio.models.decode_stack import build_decode_stack
from folio.models.llama import LlamaAttention, LlamaModel


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v, meta))


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = LlamaModel(config, Qwen3Attention)
        self._finish_init(config)

    def bind_decode_stack(self, dtype: torch.dtype) -> None:
        if self.tp.size == 1 and self.stage.size == 1:  # the C++ step runs whole models only
            self.model.decode_stack = build_decode_stack(self.model, dtype)


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
