"""GGUF metadata -> ModelConfig, and GGUF tensors -> (Hugging Face name, tensor) pairs.

Two conversions undo what llama.cpp's converter did: Llama q/k rows were permuted for GGML's
interleaved RoPE (folio uses the rotate-half layout), and Gemma norms had 1 added to them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from gguf import GGMLQuantizationType

from folio.config import ModelConfig
from folio.loaders.gguf_file import GGUFFile, GGUFTensor
from folio.quant.gguf_dequant import dequantize_tensor, unpack
from folio.quant.int4 import Int4Groups, int4_groups
from folio.quant.int8 import Int8Groups, int8_groups

INT4_FORMATS = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K})
# Symmetric formats whose codes fit int8 as they are (folio/quant/int8.py).
INT8_FORMATS = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q5_0})

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

_LAYER_NAMES = {
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
    "ffn_norm": "post_attention_layernorm",  # llama; gemma3 overrides below
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_OVERRIDES = {"ffn_norm": "pre_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; folio runs {sorted(ARCHITECTURES)}")
    num_heads = int(gguf.arch_get("attention.head_count"))
    hidden = int(gguf.arch_get("embedding_length"))
    head_dim = int(gguf.arch_get("attention.key_length") or hidden // num_heads)
    vocab = gguf.arch_get("vocab_size") or len(gguf.get("tokenizer.ggml.tokens", []))
    num_layers = int(gguf.arch_get("block_count"))
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    config = dict(
        architecture=ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gguf.arch_get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(gguf.arch_get("attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        max_position_embeddings=int(gguf.arch_get("context_length", 4096)),
        rms_norm_eps=float(gguf.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf.arch_get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gguf),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )
    if arch == "gemma3":
        # llama.cpp hard-codes Gemma 3's layout: every 6th layer is global, local layers use base 10k.
        config.update(
            hidden_act="gelu_pytorch_tanh",
            sliding_window=int(gguf.arch_get("attention.sliding_window", 4096)),
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)],
            rope_local_theta=10000.0,
            query_pre_attn_scalar=float(head_dim),
            rope_theta=float(gguf.arch_get("rope.freq_base", 1e6)),
        )
    return ModelConfig(**config)


def _rope_scaling(gguf: GGUFFile) -> dict | None:
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


def hf_name(gguf_name: str, arch: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    match = _BLOCK_RE.match(gguf_name)
    if not match:
        raise KeyError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, suffix = match.groups()
    names = {**_LAYER_NAMES, **(_GEMMA3_OVERRIDES if arch == "gemma3" else {})}
    if part not in names:
        raise KeyError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{names[part]}.{suffix}"


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _rope_row_order(rows: int, num_heads: int) -> torch.Tensor:
    """The row index that undoes llama.cpp's q/k permutation (see _unpermute_rope_rows)."""
    return _unpermute_rope_rows(torch.arange(rows), num_heads)


def _as_int4(tensor: GGUFTensor, name: str, arch: str, config: ModelConfig) -> Int4Groups | None:
    """A projection weight whose format maps exactly onto 4-bit groups, kept that way; else None."""
    if name.startswith("token_embd") or tensor.ggml_type not in INT4_FORMATS:
        return None
    groups = int4_groups(unpack(tensor.data, tensor.ggml_type, tensor.shape), tensor.shape)
    if groups is None or arch != "llama" or not (".attn_q." in name or ".attn_k." in name):
        return groups
    heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
    return groups.rows(_rope_row_order(groups.shape[0], heads))


def _as_int8(tensor: GGUFTensor, name: str, arch: str, config: ModelConfig) -> Int8Groups | None:
    """A weight in a symmetric 5- to 8-bit format (Q8_0, Q6_K, Q5_0), kept as 8-bit groups; else None."""
    if tensor.ggml_type not in INT8_FORMATS:
        return None
    groups = int8_groups(unpack(tensor.data, tensor.ggml_type, tensor.shape), tensor.shape)
    if groups is None or arch != "llama" or not (".attn_q." in name or ".attn_k." in name):
        return groups
    heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
    return groups.rows(_rope_row_order(groups.shape[0], heads))


def iter_gguf_weights(
    gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool = True
) -> Iterator[tuple[str, torch.Tensor | Int4Groups | Int8Groups]]:
    """(Hugging Face name, weight) for every tensor. With `keep_quantized`, projection weights in a
    4-bit format come as Int4Groups and weights in Q8_0, Q6_K or Q5_0 (projections, embedding, LM head)
    as Int8Groups, for the layers to keep quantized; everything else is dequantized."""
    arch = gguf.architecture
    for name, tensor in gguf.tensors.items():
        target = hf_name(name, arch)
        groups = None
        if keep_quantized:
            groups = _as_int4(tensor, name, arch, config) or _as_int8(tensor, name, arch, config)
        if groups is not None:
            yield target, groups
            continue
        weight = dequantize_tensor(tensor, dtype=torch.float32)
        if arch == "llama" and ".attn_q." in name:
            weight = _unpermute_rope_rows(weight, config.num_heads)
        elif arch == "llama" and ".attn_k." in name:
            weight = _unpermute_rope_rows(weight, config.num_kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight - 1.0
        yield target, weight.to(dtype)
