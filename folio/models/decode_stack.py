"""A Llama-family model's decode steps in one C++ call (folio/csrc/decode_stack.cpp).

Built once the KV cache is bound, from the model's own tensors (nothing is copied), when every piece
has a C++ kernel: projections dense or 4-bit (`PackedInt4`), a KV cache in the model's dtype, the
decode attention, norm, rotary and activation kernels all built. A step takes it when every
scheduled token is a decode and the batch is within the 4-bit kernel's rows; anything else runs the
Python layers, which stay the oracle (FOLIO_DISABLE_KERNELS=decode_stack turns the stack off).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from folio import ops
from folio.layers import fused_ops
from folio.layers.activation import gelu_tanh_and_mul, silu_and_mul
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.linear import Linear
from folio.quant.int4 import DOT_MAX_ROWS, PackedInt4


def _projection(module: ModuleType, layer: Linear, dtype: torch.dtype) -> Any | None:
    packed, bias = layer.packed, layer.bias
    if packed is None and layer.weight.dtype == dtype:
        return module.Projection(layer.weight, None, None, None, 0, 0, bias)
    if isinstance(packed, PackedInt4):
        rows = packed.shape[0]
        return module.Projection(None, packed.tiles, packed.scales, packed.mins, packed.group_size, rows, bias)
    return None  # another format: the Python layers


def build_decode_stack(model: nn.Module, dtype: torch.dtype) -> Any | None:
    """The C++ stack for a LlamaModel whose layers it can run, else None."""
    layers = model.layers
    attention = [layer.self_attn.attn for layer in layers]
    if not layers or any(a.cache is None or a.cache.fmt is not None or a.cache.k.dtype != dtype for a in attention):
        return None
    act = layers[0].mlp.act
    if act not in (silu_and_mul, gelu_tanh_and_mul) or dtype not in (torch.float32, torch.bfloat16):
        return None
    module, int8_dot, attention_kernel = ops.load("decode_stack"), ops.load("int8_dot"), ops.load("paged_decode")
    probe = torch.empty(0, dtype=dtype, device=attention[0].cache.k.device)
    fused = fused_ops.fused_ops_for(probe)
    if module is None or int8_dot is None or attention_kernel is None or fused is None:
        return None
    first = layers[0]
    entries = ops.entries(fused, int8_dot, attention_kernel)
    stack = module.DecodeStack(
        entries, first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim,
        attention[0].block_size, attention[0].scale, first.input_layernorm.eps, act is gelu_tanh_and_mul,
    )  # fmt: skip
    for layer, attn in zip(layers, attention, strict=True):
        projections = [
            _projection(module, p, dtype)
            for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(p is None for p in projections) or any(n.weight_offset or n.eps != first.input_layernorm.eps
                                                      for n in norms):  # fmt: skip
            return None
        stack.add_layer(norms[0].weight, norms[1].weight, *projections, attn.cache.k, attn.cache.v,
                        attn.sliding_window or 0)  # fmt: skip
    return stack


def takes_step(stack: Any | None, num_tokens: int, meta: AttentionMetadata) -> bool:
    """Whether this step is one the stack runs: decodes only, within the 4-bit kernel's rows."""
    groups = meta.groups
    whole = meta.context is None  # a split context attends across ranks, which the stack cannot
    return stack is not None and whole and len(groups) == 1 and groups[0].is_decode and num_tokens <= DOT_MAX_ROWS
