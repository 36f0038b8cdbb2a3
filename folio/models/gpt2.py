"""GPT-2: learned absolute position embeddings, LayerNorm, a GELU MLP without a gate, biases on every
projection, the LM head tied to the token embedding.

Checkpoints store the projections as `Conv1D` ([in, out], the transpose of a Linear's weight) under
`transformer.h.N.attn.c_attn` etc.; `checkpoint_rename` maps them onto folio's names and layout.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.config import ModelConfig
from folio.distributed.tensor_parallel import SINGLE, current, head_shard
from folio.layers.attention.layer import PagedAttention
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.embedding import VocabEmbedding
from folio.layers.norm import LayerNorm
from folio.layers.parallel_linear import RowParallelLinear, qkv_parallel
from folio.models.base import CausalLM, LayerNormBlock, StackedMapping, gpt2_lineage_rename, layernorm_block_params
from folio.models.registry import Architecture, HFConfig
from folio.models.staged import StagedBody


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        heads = head_shard(config.num_heads, config.num_heads, current())
        self.num_heads, self.head_dim = heads.num_heads, config.head_dim
        self.qkv_proj = qkv_parallel(config.hidden_size, self.head_dim, config.num_heads, config.num_heads, heads,
                                     bias=True)  # fmt: skip
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, bias=True)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = (t.reshape(-1, self.num_heads, self.head_dim) for t in self.qkv_proj(hidden).chunk(3, dim=-1))
        return self.o_proj(self.attn(q, k, v, meta))


class GPT2Model(StagedBody):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = self.on_first(lambda: VocabEmbedding(config.vocab_size, config.hidden_size))
        self.embed_positions = self.on_first(
            lambda: VocabEmbedding(config.max_position_embeddings, config.hidden_size, SINGLE)  # whole
        )
        self.layers = self.build_layers(config, lambda i: LayerNormBlock(config, GPT2Attention(config)))
        self.norm = self.on_last(lambda: LayerNorm(config.hidden_size, config.rms_norm_eps))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(positions)


# Hugging Face name (after "transformer.") -> folio's; the Conv1D ones hold transposed weights.
_TOP_NAMES = {"wte": "embed_tokens", "wpe": "embed_positions", "ln_f": "norm"}
_BLOCK_NAMES = {
    "ln_1": "input_layernorm",
    "attn.c_attn": "self_attn.qkv_proj",
    "attn.c_proj": "self_attn.o_proj",
    "ln_2": "post_attention_layernorm",
    "mlp.c_fc": "mlp.fc_in",
    "mlp.c_proj": "mlp.fc_out",
}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_MASK_BUFFERS = r"\.attn\.(masked_)?bias$"  # old checkpoints saved the causal mask buffers


class GPT2LMHeadModel(CausalLM):
    body = GPT2Model
    stacked_params: StackedMapping = []
    checkpoint_rename = staticmethod(gpt2_lineage_rename("GPT-2", _TOP_NAMES, _BLOCK_NAMES, _CONV1D, _MASK_BUFFERS))


def _config_from_hf(raw: HFConfig) -> ModelConfig:
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
        raise ValueError(
            "GPT-2 configs with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn are not supported"
        )
    if not raw.get("scale_attn_weights", True):
        raise ValueError("GPT-2 configs without scale_attn_weights are not supported")
    hidden, heads = raw["n_embd"], raw["n_head"]
    eos = raw.get("eos_token_id")
    return ModelConfig(
        architecture=raw["architectures"][0],
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw.get("n_inner") or 4 * hidden,
        num_layers=raw["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=raw["n_positions"],
        rms_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        linear_bias=True,
        hidden_act=raw.get("activation_function", "gelu_new"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        position_embedding="learned",
    )


def _config_to_hf(config: ModelConfig) -> HFConfig:
    eos = config.eos_token_ids
    return {
        "architectures": [config.architecture],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.hidden_size,
        "n_inner": config.intermediate_size,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_positions": config.max_position_embeddings,
        "layer_norm_epsilon": config.rms_norm_eps,
        "activation_function": config.hidden_act,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if eos else None,
        "torch_dtype": "float16",
    }


def _estimate_params(config: ModelConfig) -> int:
    return layernorm_block_params(config, config.hidden_size * config.max_position_embeddings)  # + positions


ARCHITECTURES = (
    Architecture(
        "gpt2", ("GPT2LMHeadModel",), GPT2LMHeadModel, _config_from_hf, _config_to_hf, estimate_params=_estimate_params
    ),
)
