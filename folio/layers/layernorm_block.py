"""The decoder block of the GPT-2 lineage (GPT-2, BLOOM): LayerNorm before attention and before an
ungated MLP, biases on every projection, residuals around both. Each architecture brings its own
attention (learned positions, ALiBi); the parameter names match the Llama family's where they can."""

from __future__ import annotations

import torch
from torch import nn

from folio.config import ModelConfig
from folio.layers.activation import get_activation
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.norm import LayerNorm
from folio.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear


class UngatedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc_in = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc_out = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class LayerNormBlock(nn.Module):
    def __init__(self, config: ModelConfig, attention: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = UngatedMLP(config)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
