"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), SmolLM2.

Forward runs on a flat batch: input_ids [T] and positions [T] of all scheduled tokens of all requests.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.config import ModelConfig
from folio.layers.attention.layer import PagedAttention
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.embedding import VocabEmbedding
from folio.layers.linear import Linear, MergedLinear
from folio.layers.norm import RMSNorm
from folio.layers.rotary import RotaryEmbedding, apply_rotary
from folio.models.base import CausalLM, GatedMLP


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=config.attention_bias
        )
        self.o_proj = Linear(q_size, config.hidden_size)
        window = config.sliding_window if config.is_sliding(layer_index) else None  # Mistral v0.1
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, window)
        self.split = (q_size, kv_size, kv_size)

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, rope, meta)
        return self.norm(hidden)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = LlamaModel(config)
        self._finish_init(config)
