"""A tensor-parallel rank reads only its slice of a GGUF tensor: narrowing the unread tensor (rows, or
columns on block boundaries) and loading it gives exactly the loaded tensor's slice, in every kept
format (4-bit groups, 8-bit groups, dense), q/k rows with llama.cpp's permutation undone included."""

from __future__ import annotations

import pytest
import torch

from folio.layers.weight_narrowing import narrow_weight
from folio.loaders.gguf_file import GGUFFile
from folio.loaders.gguf_model import GGUFWeight, gguf_model_config, iter_gguf_weights


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return type(a) is type(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y  # a field like Int4Groups.bits
        for x, y in zip(vars(a).values(), vars(b).values(), strict=True)
    )


@pytest.mark.parametrize("keep_quantized", [True, False])
@pytest.mark.parametrize("which", ["gemma3_gguf", "smollm2_gguf"])
def test_a_narrowed_lazy_tensor_loads_the_slice_of_the_whole(which, keep_quantized, request):
    gguf = GGUFFile(request.getfixturevalue(which))
    config = gguf_model_config(gguf)
    wanted = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight", "blk.0.attn_output.weight",
              "token_embd.weight")  # fmt: skip
    lazy = dict(iter_gguf_weights(gguf, config, torch.float32, keep_quantized, lazy=True))
    whole = dict(iter_gguf_weights(gguf, config, torch.float32, keep_quantized))
    names = [n for n in lazy if any(n.startswith(_hf(w)) for w in wanted)]
    assert len(names) == len(wanted)
    for name in names:
        weight = lazy[name]
        assert isinstance(weight, GGUFWeight)
        rows, cols = weight.shape
        heads = weight.rope_heads or 1
        row_part = rows // heads * (heads // 2 or 1) if heads > 1 else rows // 2
        assert _same(
            narrow_weight(weight, 0, rows - row_part, row_part),
            narrow_weight(whole[name], 0, rows - row_part, row_part),
        )
        assert _same(
            narrow_weight(weight, 1, cols // 2, cols // 2), narrow_weight(whole[name], 1, cols // 2, cols // 2)
        )


def _hf(gguf_name: str) -> str:
    layer = "model.layers.0."
    return {"blk.0.attn_q.weight": layer + "self_attn.q_proj", "blk.0.attn_k.weight": layer + "self_attn.k_proj",
            "blk.0.ffn_down.weight": layer + "mlp.down_proj", "blk.0.attn_output.weight": layer + "self_attn.o_proj",
            "token_embd.weight": "model.embed_tokens"}[gguf_name]  # fmt: skip
