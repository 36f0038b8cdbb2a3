"""Gemma 3 (text): interleaved sliding-window and global layers, QK-norm, GeGLU, scaled embeddings.

Norms scale by (1 + weight), following the reference checkpoints; the GGUF loader converts llama.cpp's
pre-added ones back to that convention. The C++ decode step (decode_stack.py) serves whole models.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.config import ModelConfig
from folio.distributed.tensor_parallel import current, head_shard
from folio.layers.attention.layer import PagedAttention
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.embedding import VocabEmbedding
from folio.layers.norm import RMSNorm
from folio.layers.parallel_linear import RowParallelLinear, qkv_parallel
from folio.layers.rotary import RotaryEmbedding, apply_rotary
from folio.models.architecture import Architecture, GGUFLayout, GGUFMetadata, HFConfig
from folio.models.base import CausalLM, GatedMLP
from folio.models.config_readers import (
    LLAMA_BLOCK_NAMES,
    LLAMA_TOP_NAMES,
    gguf_common_fields,
    hf_common_config,
    hf_common_fields,
    scaling_or_none,
)
from folio.models.decode_stack import DecodeStack, build_decode_stack
from folio.models.staged import StageCarry, StagedBody

Rope = tuple[torch.Tensor, torch.Tensor]


def _norm(dim: int, config: ModelConfig) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, weight_offset=1.0)


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        heads = head_shard(config.num_heads, config.num_kv_heads, current())
        self.num_heads = heads.num_heads  # this rank's (all of them with one rank)
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.is_sliding = config.is_sliding(layer_index)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = qkv_parallel(config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, heads,
                                     config.attention_bias)  # fmt: skip
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size)
        self.q_norm = _norm(self.head_dim, config)
        self.k_norm = _norm(self.head_dim, config)
        scalar = config.query_pre_attn_scalar or self.head_dim
        window = config.sliding_window if self.is_sliding else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scalar**-0.5, window)
        self.split = (q_size, kv_size, kv_size)

    def forward(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v, meta))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_index)
        self.mlp = GatedMLP(config)
        self.input_layernorm = _norm(config.hidden_size, config)
        self.post_attention_layernorm = _norm(config.hidden_size, config)
        self.pre_feedforward_layernorm = _norm(config.hidden_size, config)
        self.post_feedforward_layernorm = _norm(config.hidden_size, config)

    def forward(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden), rope, meta)
        hidden = hidden + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class Gemma3Model(StagedBody):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = self.on_first(lambda: VocabEmbedding(config.vocab_size, config.hidden_size))
        self.layers = self.build_layers(config, lambda i: Gemma3DecoderLayer(config, i))
        self.norm = self.on_last(lambda: _norm(config.hidden_size, config))
        self.rotary_global = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.rotary_local = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_local_theta or 10000.0, None
        )
        self.embed_scale = config.hidden_size**0.5
        self.decode_stack: DecodeStack | None = None  # the C++ decode step, once the KV cache is bound (whole models)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        carried: StageCarry | None = None,
    ) -> torch.Tensor | StageCarry:  # fmt: skip
        stack = self.decode_stack
        if stack is None or not stack.takes_step(input_ids.shape[0], meta):
            return super().forward(input_ids, positions, meta, carried)
        hidden = self.embed(input_ids, positions)
        ropes = [rotary.cos_sin(positions, hidden.dtype) for rotary in (self.rotary_global, self.rotary_local)]
        hidden, residual = stack.forward(hidden, ropes, meta)
        return self.norm.add_and_norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The reference rounds the scale to the activation dtype before multiplying.
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def run_layers(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, None]:
        rope_global = self.rotary_global.cos_sin(positions, hidden.dtype)
        rope_local = self.rotary_local.cos_sin(positions, hidden.dtype)
        for layer in self.held_layers():
            rope = rope_local if layer.self_attn.is_sliding else rope_global
            hidden = layer(hidden, rope, meta)
        return hidden, None

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.norm(hidden)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = Gemma3Model(config)
        self._finish_init(config)

    def bind_decode_stack(self, dtype: torch.dtype) -> None:
        if self.tp.size == 1 and self.stage.size == 1:  # the C++ step runs whole models only
            body = self.model
            local = [int(layer.self_attn.is_sliding) for layer in body.layers]  # their RoPE: the second table
            body.decode_stack = build_decode_stack(body, dtype, sandwich=True, rope_tables=local)


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
