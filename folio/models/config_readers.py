"""The fields most architectures spell alike: config.json keys and llama.cpp's GGUF metadata keys.

An architecture's own module starts from these and adds or overrides what is its own.
"""

from __future__ import annotations

from typing import Any

from folio.config import ModelConfig
from folio.models.registry import GGUFMetadata, HFConfig


def hf_common_fields(raw: HFConfig) -> dict[str, Any]:
    """ModelConfig keyword arguments from the config.json keys Llama-style configs share."""
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = hf_rope_settings(raw)
    return dict(
        architecture=raw["architectures"][0],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", False),
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act", "silu"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=hf_eos_ids(raw),
    )


def hf_eos_ids(raw: HFConfig) -> list[int]:
    eos = raw.get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def hf_rope_settings(raw: HFConfig) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None); handles old (rope_theta/rope_scaling) and new (rope_parameters) styles."""
    params = raw.get("rope_parameters")
    if params:
        return params.get("rope_theta", 10000.0), scaling_or_none(params)
    return raw.get("rope_theta", 10000.0), raw.get("rope_scaling")


def scaling_or_none(params: dict[str, Any]) -> dict[str, Any] | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    return None if rope_type == "default" else dict(params)


def hf_common_config(config: ModelConfig, model_type: str) -> HFConfig:
    """config.json keys shared by Llama-style configs (read back by hf_common_fields and transformers)."""
    eos = config.eos_token_ids
    return {
        "architectures": [config.architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "hidden_act": config.hidden_act,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": "float16",
    }


def gguf_common_fields(gguf: GGUFMetadata, architecture: str) -> dict[str, Any]:
    """ModelConfig keyword arguments from llama.cpp's metadata keys shared by its Llama-style models."""
    num_heads = int(gguf.arch_get("attention.head_count"))
    hidden = int(gguf.arch_get("embedding_length"))
    vocab = gguf.arch_get("vocab_size") or len(gguf.get("tokenizer.ggml.tokens", []))
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    return dict(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gguf.arch_get("feed_forward_length")),
        num_layers=int(gguf.arch_get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(gguf.arch_get("attention.head_count_kv") or num_heads),
        head_dim=int(gguf.arch_get("attention.key_length") or hidden // num_heads),
        max_position_embeddings=int(gguf.arch_get("context_length", 4096)),
        rms_norm_eps=float(gguf.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf.arch_get("rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(gguf),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def gguf_rope_scaling(gguf: GGUFMetadata) -> dict | None:
    kind = gguf.arch_get("rope.scaling.type")
    factor = gguf.arch_get("rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = gguf.arch_get("rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
    raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported")


# llama.cpp's tensor names for a Llama-style block, as Hugging Face names within the layer.
LLAMA_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LLAMA_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
