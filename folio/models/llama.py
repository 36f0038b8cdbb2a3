"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), SmolLM2; Qwen3 and Gemma 3 run variants of
its attention and body (qwen3.py, gemma3.py), and phi3.py its whole model.

Forward runs on a flat batch: input_ids [T] and positions [T] of all scheduled tokens of all requests.
The C++ decode step (decode_stack.py) serves these models once the KV cache is bound (whole models).
"""

from __future__ import annotations

import torch
from torch import nn

from folio.config import ModelConfig
from folio.distributed.tensor_parallel import current, head_shard
from folio.layers.attention.layer import PagedAttention
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.embedding import VocabEmbedding
from folio.layers.lora import LoRABatch
from folio.layers.norm import RMSNorm
from folio.layers.parallel_linear import RowParallelLinear, qkv_parallel
from folio.layers.rotary import RotaryEmbedding, apply_rotary
from folio.models.base import CausalLM, GatedMLP
from folio.models.config_readers import (
    LLAMA_BLOCK_NAMES,
    LLAMA_TOP_NAMES,
    gguf_common_fields,
    hf_common_config,
    hf_common_fields,
)
from folio.models.decode_stack import DecodeStack, Rope, build_decode_stack
from folio.models.registry import Architecture, GGUFLayout, GGUFMetadata, HFConfig
from folio.models.staged import StageCarry, StagedBody


class LlamaAttention(nn.Module):
    # Where a variant sets it (Qwen3: 0; Gemma 3: 1, its norms scaling by 1 + weight), each query and key
    # head is RMS-normed before RoPE (QK-norm).
    qk_norm_offset: float | None = None

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        heads = head_shard(config.num_heads, config.num_kv_heads, current())
        self.num_heads = heads.num_heads  # this rank's (all of them with one rank)
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.is_sliding = config.is_sliding(layer_index)  # Mistral v0.1's layers, Gemma 3's local ones
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = qkv_parallel(config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, heads,
                                     config.attention_bias)  # fmt: skip
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size)
        if self.qk_norm_offset is not None:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, self.qk_norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, self.qk_norm_offset)
        scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        window = config.sliding_window if self.is_sliding else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale, window)
        self.split = (q_size, kv_size, kv_size)

    def forward(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm_offset is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, attention: type[LlamaAttention]) -> None:
        super().__init__()
        self.self_attn = attention(config, layer_index)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata
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


class LlamaModel(StagedBody):
    """A variant body (Qwen3's, Gemma 3's) names its layers' `attention` (a subclass of Llama's), and may
    name its own `decoder_layer` and its final norm's `norm_offset`."""

    carries_residual = True
    attention: type[LlamaAttention] = LlamaAttention
    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    norm_offset = 0.0

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = self.on_first(lambda: VocabEmbedding(config.vocab_size, config.hidden_size))
        self.layers = self.build_layers(config, lambda i: self.decoder_layer(config, i, self.attention))
        self.norm = self.on_last(lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, self.norm_offset))
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.decode_stack: DecodeStack | None = None  # the C++ decode step, once the KV cache is bound (whole models)
        self.lora_batch: LoRABatch | None = None  # the step's adapter rows (lora/store.py)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        carried: StageCarry | None = None,
    ) -> torch.Tensor | StageCarry:  # fmt: skip
        stack = self.decode_stack
        if stack is None or not stack.takes_step(input_ids.shape[0], meta):
            return super().forward(input_ids, positions, meta, carried)
        hidden = self.embed(input_ids, positions)
        hidden, residual = stack.forward(hidden, self.ropes(positions, hidden.dtype), meta, self.lora_batch)
        return self.norm.add_and_norm(hidden, residual)[0]

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        """(cos, sin) of every RoPE the layers use: of the global layers, then of the local ones (if any)."""
        return [self.rotary.cos_sin(positions, dtype)]

    def bind_decode_stack(self, dtype: torch.dtype) -> None:
        self.decode_stack = build_decode_stack(self, dtype)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def run_layers(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        for layer in self.held_layers():
            hidden, residual = layer(hidden, residual, rope, meta)
        return hidden, residual

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    body = LlamaModel

    def bind_decode_stack(self, dtype: torch.dtype) -> None:
        if self.tp.size == 1 and self.stage.size == 1:  # the C++ step runs whole models only
            self.model.bind_decode_stack(dtype)


def _config_from_hf(raw: HFConfig) -> ModelConfig:
    fields = hf_common_fields(raw)
    name = fields["architecture"]
    fields["attention_bias"] = raw.get("attention_bias", name == "Qwen2ForCausalLM")
    if raw.get("sliding_window") and raw.get("use_sliding_window", name == "MistralForCausalLM"):
        # Mistral v0.1 (and Qwen2 with use_sliding_window) limit every layer to a window.
        fields.update(sliding_window=raw["sliding_window"], layer_types=["sliding_attention"] * fields["num_layers"])
    return ModelConfig(**fields)


def _config_to_hf(model_type: str):
    def to_hf(config: ModelConfig) -> HFConfig:
        raw = hf_common_config(config, model_type)
        if config.sliding_window:
            raw.update(sliding_window=config.sliding_window, use_sliding_window=True)
        return raw

    return to_hf


def _gguf_layout(gguf_name: str, hf_name: str, permuted_rope_rows: bool) -> GGUFLayout:
    def config_from_gguf(gguf: GGUFMetadata) -> ModelConfig:
        return ModelConfig(**gguf_common_fields(gguf, hf_name))

    return GGUFLayout((gguf_name,), config_from_gguf, LLAMA_BLOCK_NAMES, LLAMA_TOP_NAMES,
                      permuted_rope_rows=permuted_rope_rows)  # fmt: skip


def _architecture(name: str, hf_name: str, gguf: GGUFLayout | None) -> Architecture:
    return Architecture(name, (hf_name,), LlamaForCausalLM, _config_from_hf, _config_to_hf(name), gguf=gguf,
                        decode_stack=True)  # fmt: skip


ARCHITECTURES = (
    # llama.cpp's Llama converter interleaves q/k rows for GGML's RoPE; its Qwen2 converter does not.
    _architecture("llama", "LlamaForCausalLM", _gguf_layout("llama", "LlamaForCausalLM", permuted_rope_rows=True)),
    _architecture("qwen2", "Qwen2ForCausalLM", _gguf_layout("qwen2", "Qwen2ForCausalLM", permuted_rope_rows=False)),
    _architecture("mistral", "MistralForCausalLM", None),  # llama.cpp stores Mistral as "llama"
)
