"""BLOOM: ALiBi attention biases instead of position embeddings, LayerNorm (one right after the token
embedding too), a GELU MLP without a gate, biases on every projection, the LM head tied.

The checkpoint's `query_key_value` interleaves q, k and v per head ([heads, 3, head_dim] rows), and
the layer keeps that order (so the weight loads, quantizes and exports as one tensor).
"""

from __future__ import annotations

import torch
from torch import nn

from folio.config import ModelConfig
from folio.distributed.tensor_parallel import current, head_shard
from folio.layers.attention.alibi import alibi_slopes
from folio.layers.attention.layer import PagedAttention
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.embedding import VocabEmbedding
from folio.layers.norm import LayerNorm
from folio.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from folio.models.base import CausalLM, LayerNormBlock, StackedMapping, gpt2_lineage_rename, layernorm_block_params
from folio.models.registry import Architecture, HFConfig
from folio.models.staged import StagedBody


class BloomAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        heads = head_shard(config.num_heads, config.num_heads, current())
        self.num_heads, self.head_dim = heads.num_heads, config.head_dim
        width = config.num_heads * config.head_dim
        # The checkpoint interleaves q, k, v per head, so a rank's heads are one contiguous range of rows.
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, 3 * width, bias=True)
        self.o_proj = RowParallelLinear(width, config.hidden_size, bias=True)
        slopes = alibi_slopes(config.num_heads)[heads.first_head : heads.first_head + heads.num_heads]
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5, None, slopes)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden).view(-1, self.num_heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, i].contiguous() for i in range(3))
        return self.o_proj(self.attn(q, k, v, meta))


class BloomModel(StagedBody):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = self.on_first(lambda: VocabEmbedding(config.vocab_size, config.hidden_size))
        self.embed_norm = self.on_first(lambda: LayerNorm(config.hidden_size, config.rms_norm_eps))
        self.layers = self.build_layers(config, lambda i: LayerNormBlock(config, BloomAttention(config)))
        self.norm = self.on_last(lambda: LayerNorm(config.hidden_size, config.rms_norm_eps))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(self.embed_tokens(input_ids))


_TOP_NAMES = {"word_embeddings": "embed_tokens", "word_embeddings_layernorm": "embed_norm", "ln_f": "norm"}
_BLOCK_NAMES = {
    "input_layernorm": "input_layernorm",
    "self_attention.query_key_value": "self_attn.qkv_proj",
    "self_attention.dense": "self_attn.o_proj",
    "post_attention_layernorm": "post_attention_layernorm",
    "mlp.dense_h_to_4h": "mlp.fc_in",
    "mlp.dense_4h_to_h": "mlp.fc_out",
}


class BloomForCausalLM(CausalLM):
    body = BloomModel
    stacked_params: StackedMapping = []
    checkpoint_rename = staticmethod(gpt2_lineage_rename("BLOOM", _TOP_NAMES, _BLOCK_NAMES))


def _config_from_hf(raw: HFConfig) -> ModelConfig:
    if raw.get("apply_residual_connection_post_layernorm"):
        raise ValueError("BLOOM configs with apply_residual_connection_post_layernorm are not supported")
    hidden = raw.get("hidden_size") or raw["n_embed"]
    heads = raw.get("n_head") or raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    return ModelConfig(
        architecture=raw["architectures"][0],
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=raw.get("n_layer") or raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        # ALiBi has no trained length; the context folio serves is capped by --max-model-len.
        max_position_embeddings=raw.get("seq_length", 2048),
        rms_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        linear_bias=True,
        hidden_act="gelu_tanh",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        position_embedding="alibi",
    )


def _config_to_hf(config: ModelConfig) -> HFConfig:
    eos = config.eos_token_ids
    return {
        "architectures": [config.architecture],
        "model_type": "bloom",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "seq_length": config.max_position_embeddings,
        "layer_norm_epsilon": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if eos else None,
        "torch_dtype": "float16",
    }


ARCHITECTURES = (
    Architecture(
        "bloom",
        ("BloomForCausalLM",),
        BloomForCausalLM,
        _config_from_hf,
        _config_to_hf,
        estimate_params=lambda config: layernorm_block_params(config, 2 * config.hidden_size),  # the embedding's norm
    ),
)
