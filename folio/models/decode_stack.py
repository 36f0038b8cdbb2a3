"""A model's decode steps in one C++ call (folio/csrc/decode_stack.cpp): the Llama family, Qwen3 and Gemma 3.

Built once the KV cache is bound, from the model's own tensors (nothing is copied), when every piece
has a C++ kernel: projections dense, 4- or 5-bit (`PackedInt4`: GGUF's Q4_*, Q5_*) or 8-bit
(`PackedInt8`: Q8_0, Q6_K), or row blocks of those (`ConcatRows`), a KV cache in the model's dtype,
the decode attention, norm, rotary and activation kernels all built. A step takes it when every
scheduled token is a decode and the batch is within the rows its weights' dot-product kernels are
picked for (all of them with float32 activations); anything else runs the Python layers, which stay
the oracle (FOLIO_DISABLE_KERNELS=decode_stack turns the stack off).

A step of at most four float32 tokens whose projections are all 4-, 5- or 8-bit tiles runs "in teams"
(folio/csrc/decode_team.h): one parallel region from each layer's attention output to the next layer's
queries, the serial work on one thread while the others prefetch the tiles they multiply next. The
results are the same bits; `stack.team_steps` and `stack.kernel_steps` count the steps each way took.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from folio import ops
from folio.layers import fused_ops
from folio.layers.activation import gelu_tanh_and_mul, silu_and_mul
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.linear import Linear
from folio.layers.lora import LoRABatch
from folio.layers.norm import RMSNorm
from folio.layers.weight_storage import ConcatRows
from folio.weight_formats import int4, int8

Rope = tuple[torch.Tensor, torch.Tensor]


class DecodeStack:
    """The compiled stack and the most rows a step may have for it (its weights' kernels' limit)."""

    def __init__(self, stack: Any, max_rows: int, projections: list[list[Linear]]) -> None:
        self.stack, self.max_rows = stack, max_rows
        self.projections = projections  # each layer's q/k/v, o, gate/up and down, as the stack holds them
        self.lora_layouts = 0  # the LoRABatch.layouts the stack last took the layers' LoRA slots at

    def takes_step(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether this step is one the stack runs: decodes only, within `max_rows`."""
        groups = meta.groups
        whole = meta.context is None  # a split context attends across ranks, which the stack cannot
        return whole and len(groups) == 1 and groups[0].is_decode and num_tokens <= self.max_rows

    def forward(
        self, hidden: torch.Tensor, ropes: Sequence[Rope], meta: AttentionMetadata, lora: LoRABatch | None = None
    ) -> list[torch.Tensor]:
        """hidden: the embedded tokens; ropes: (cos, sin) of the global layers, then of the local ones (if
        the model has two); lora: the step's adapter rows, if any. Returns (x, residual), the hidden states
        being residual + x before the final norm."""
        tables = [t.view(t.shape[0], -1) for rope in ropes for t in rope]
        views = meta.by_kv_group or [meta]  # one per KV cache group
        slots = [view.slot_mapping for view in views]
        block_tables = [view.groups[0].block_tables for view in views]
        lora_slots = None
        if lora is not None and lora.token_slots is not None:
            if lora.layouts != self.lora_layouts:
                self._take_lora_slots(lora.layouts)
            lora_slots = lora.token_slots
        return self.stack.forward(hidden, tables, slots, block_tables, meta.groups[0].seq_lens, lora_slots)

    def _take_lora_slots(self, layouts: int) -> None:
        for index, projections in enumerate(self.projections):
            for which, layer in enumerate(projections):
                if layer.lora is not None:
                    self.stack.set_lora(index, which, layer.lora.a, layer.lora.b, layer.lora.flat_parts)
        self.lora_layouts = layouts


def _projection(module: ModuleType, layer: Linear, dtype: torch.dtype) -> tuple[Any, int] | None:
    """(the C++ projection, the most rows its kernel is picked for), or None for a format it lacks."""
    packed, bias = layer.packed, layer.bias
    if packed is None and layer.weight.dtype == dtype:
        return module.Projection.dense(layer.weight, bias), sys.maxsize
    if isinstance(packed, ConcatRows):  # row blocks in formats of their own (e.g. q and k Q5_0, v Q8_0)
        parts = [_packed_projection(module, part, None, dtype) for part in packed.parts]
        if any(p is None for p in parts):
            return None
        return module.Projection.row_blocks([p for p, _ in parts], bias), min(rows for _, rows in parts)
    return _packed_projection(module, packed, bias, dtype)


def _packed_projection(
    module: ModuleType, packed: Any, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[Any, int] | None:
    if isinstance(packed, int4.PackedInt4):
        projection = module.Projection.int4(packed.tiles, packed.high_bits, packed.scales, packed.mins,
                                            packed.group_size, packed.shape[0], bias,
                                            packed.exact_activations)  # fmt: skip
        return projection, int4.dot_max_rows(dtype)
    if isinstance(packed, int8.PackedInt8):
        projection = module.Projection.int8(packed.tiles, packed.scales, packed.group_size, packed.shape[0], bias,
                                            packed.exact_activations)  # fmt: skip
        return projection, int8.dot_max_rows(dtype)
    return None


def _weight(norm: nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def build_decode_stack(
    model: nn.Module, dtype: torch.dtype, sandwich: bool = False, rope_tables: Sequence[int] | None = None
) -> DecodeStack | None:
    """The C++ stack for a model body whose layers it can run, else None.

    The layers are Llama-shaped (`input_layernorm`, `self_attn.qkv_proj`/`o_proj`/`attn`,
    `post_attention_layernorm`, `mlp.gate_up_proj`/`down_proj`), with `self_attn.q_norm`/`k_norm` where
    the model norms each head (Qwen3, Gemma 3). `sandwich`: Gemma 3's layout, where
    `post_attention_layernorm` norms the attention's output and `pre_feedforward_layernorm` and
    `post_feedforward_layernorm` wrap the MLP. `rope_tables`: per layer, 0 for the first (cos, sin) pair
    `DecodeStack.forward` is given, 1 for the second.
    """
    layers = model.layers
    attention = [layer.self_attn.attn for layer in layers]
    if not layers or any(a.cache is None or a.cache.fmt is not None or a.cache.k.dtype != dtype for a in attention):
        return None
    if any(a.cache.k.device.type != "cpu" for a in attention):  # a CPU kernel: on a GPU, not even compiled
        return None
    if any(a.scale != attention[0].scale or a.alibi_slopes is not None for a in attention):
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
    reference: RMSNorm = first.input_layernorm
    stack = module.DecodeStack(
        ops.entries(fused, int8_dot, attention_kernel), first.self_attn.num_heads, first.self_attn.num_kv_heads,
        first.self_attn.head_dim, attention[0].block_size, attention[0].scale, reference.eps,
        reference.weight_offset, act is gelu_tanh_and_mul, sandwich,
    )  # fmt: skip
    max_rows = sys.maxsize
    projections: list[list[Linear]] = []
    for index, (layer, attn) in enumerate(zip(layers, attention, strict=True)):
        self_attn, mlp = layer.self_attn, layer.mlp
        projections.append([self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj])
        made = [_projection(module, p, dtype) for p in projections[-1]]
        q_norm, k_norm = getattr(self_attn, "q_norm", None), getattr(self_attn, "k_norm", None)
        around_mlp = (layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) if sandwich else (None, None)
        norms = [layer.input_layernorm, layer.post_attention_layernorm, q_norm, k_norm, *around_mlp]
        norms = [n for n in norms if n is not None]
        if any(m is None for m in made) or any(
            not isinstance(n, RMSNorm) or (n.eps, n.weight_offset) != (reference.eps, reference.weight_offset)
            for n in norms
        ):
            return None
        max_rows = min(max_rows, *(rows for _, rows in made))
        stack.add_layer(
            module.Norms(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                         _weight(around_mlp[0]), _weight(around_mlp[1]), _weight(q_norm), _weight(k_norm)),
            *(projection for projection, _ in made), attn.cache.k, attn.cache.v, attn.sliding_window or 0,
            rope_tables[index] if rope_tables is not None else 0, attn.kv_group,
        )  # fmt: skip
    return DecodeStack(stack, max_rows, projections)
