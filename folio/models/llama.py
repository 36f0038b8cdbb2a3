"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), SmolLM2.

Forward runs on a flat batch: input_ids [T] and positions [T] of all scheduled tokens of all requests.
"""

from __future__ import annotations

from typing import Any

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
from folio.models.decode_stack import build_decode_stack, takes_step


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
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it is added): each residual add is fused with
        the norm that follows it, the last one with the model's final norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.decode_stack: Any | None = None  # the C++ decode step, once the KV cache is bound

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        if takes_step(self.decode_stack, hidden, meta):
            cos, sin = (t.view(t.shape[0], -1) for t in rope)
            group = meta.groups[0]
            hidden, residual = self.decode_stack.forward(
                hidden, cos, sin, meta.slot_mapping, group.block_tables, group.seq_lens
            )
            return self.norm.add_and_norm(hidden, residual)[0]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, meta)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = LlamaModel(config)
        self._finish_init(config)

    def bind_decode_stack(self, dtype: torch.dtype) -> None:
        self.model.decode_stack = build_decode_stack(self.model, dtype)
