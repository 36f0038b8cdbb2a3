"""4-bit GGUF weights kept packed: the mapping onto the 4-bit groups is exact, the packed layout
round-trips, and both multiply paths (the int8 dot-product kernel, widen-then-GEMM) equal
dequantize-then-matmul on the GGUF bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants

from folio.layers.linear import Linear, MergedLinear
from folio.loaders.gguf_file import GGUFFile
from folio.quant import int4
from folio.quant.gguf_dequant import dequantize, unpack
from folio.quant.int4 import Int4Groups, PackedInt4, int4_groups


def _quantized(ggml_type: Q, rows: int, cols: int, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return quants.quantize(data, ggml_type), (rows, cols)


def _gguf_q4_k(path) -> tuple[np.ndarray, tuple[int, ...]]:
    """A real Q4_K tensor (gguf-py cannot make one)."""
    tensor = next(t for t in GGUFFile(path).tensors.values() if t.ggml_type == Q.Q4_K and len(t.shape) == 2)
    return tensor.data, tensor.shape


@pytest.fixture(params=["Q4_0", "Q4_1", "Q4_K"])
def gguf_tensor(request, gemma3_gguf):
    if request.param == "Q4_K":
        data, shape = _gguf_q4_k(gemma3_gguf)
        return Q.Q4_K, data, shape
    data, shape = _quantized(Q[request.param], 192, 256, seed=len(request.param))
    return Q[request.param], data, shape


def test_int4_groups_equal_the_gguf_dequantization_exactly(gguf_tensor):
    ggml_type, data, shape = gguf_tensor
    groups = int4_groups(unpack(data, ggml_type, shape), shape)
    assert groups is not None and groups.codes.max() <= 15
    assert torch.equal(groups.dequantize(), dequantize(data, ggml_type, shape))


def test_formats_that_do_not_map_are_refused():
    data, shape = _quantized(Q.Q8_0, 64, 64, seed=0)
    assert int4_groups(unpack(data, Q.Q8_0, shape), shape) is None  # 8 bits
    data, shape = _quantized(Q.Q4_0, 96, 64, seed=0)
    assert int4_groups(unpack(data, Q.Q4_0, shape), shape) is not None  # any number of rows maps


def test_packed_layout_round_trips(gguf_tensor):
    ggml_type, data, shape = gguf_tensor
    groups = int4_groups(unpack(data, ggml_type, shape), shape)
    packed = PackedInt4(groups)
    assert torch.equal(packed.codes(), groups.codes)
    # Scales and mins (zero - 8 * scale) are kept in float16: the weights are code * scale + min, rounded.
    scales = groups.scales.half().float().repeat_interleave(32, dim=1)
    mins = (groups.zeros - 8 * groups.scales).half().float().repeat_interleave(32, dim=1)
    torch.testing.assert_close(packed.dequantize(torch.float32), groups.codes.float() * scales + mins,
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    assert packed.nbytes == shape[0] * shape[1] // 2 + 2 * 2 * shape[0] * shape[1] // 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64, int4.DOT_MAX_ROWS_BF16, int4.DOT_MAX_ROWS_BF16 + 1])
def test_both_multiply_paths_equal_dequantize_then_matmul(gguf_tensor, dtype, rows):
    ggml_type, data, shape = gguf_tensor
    weight = dequantize(data, ggml_type, shape)
    packed = PackedInt4(int4_groups(unpack(data, ggml_type, shape), shape))
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(shape[0])
    expected = F.linear(x.double(), weight.double(), bias.double())
    got = packed.linear(x.to(dtype), bias.to(dtype)).double()
    scale = expected.abs().max().item()
    # Scales and mins are float16 (Q4_K's products of two scales round), the kernel codes activations in
    # 8 + 8 bits per block of 32 (int8_dot's own tests check it exactly), and bf16 outputs round.
    tolerance = 3e-3 if dtype == torch.float32 else 1e-2
    assert (got - expected).abs().max().item() <= tolerance * scale


def _groups_for(rows: int, cols: int, seed: int) -> tuple[Int4Groups, torch.Tensor]:
    data, shape = _quantized(Q.Q4_1, rows, cols, seed)
    return int4_groups(unpack(data, Q.Q4_1, shape), shape), dequantize(data, Q.Q4_1, shape)


def test_fused_layer_packs_when_every_shard_is_4_bit():
    layer = MergedLinear(128, {"q": 128, "k": 64, "v": 64})
    dense = []
    for i, (shard, size) in enumerate([("q", 128), ("k", 64), ("v", 64)]):
        groups, weight = _groups_for(size, 128, seed=i)
        assert layer.packed is None
        layer.weight_loader(layer.weight, groups, shard)
        dense.append(weight)
    assert layer.packed is not None and layer.weight.numel() == 0  # no dense copy kept
    assert layer.weight_nbytes == 256 * 128 // 2 + 2 * 2 * 256 * 128 // 32  # codes + float16 (scale, min)
    x = torch.randn(5, 128)
    expected = x @ torch.cat(dense).t()
    assert (layer(x) - expected).abs().max() <= 1e-3 * expected.abs().max()


def test_fused_layer_with_a_dense_shard_falls_back_to_dense():
    layer = MergedLinear(128, {0: 128, 1: 128})
    groups, quantized = _groups_for(128, 128, seed=1)
    dense = torch.randn(128, 128)
    layer.weight_loader(layer.weight, groups, 0)
    layer.weight_loader(layer.weight, dense, 1)
    assert layer.packed is None
    torch.testing.assert_close(layer.weight.data, torch.cat([quantized, dense]))
    later = MergedLinear(128, {0: 128, 1: 128})  # a 4-bit shard after a dense one is widened too
    later.weight_loader(later.weight, dense, 0)
    later.weight_loader(later.weight, groups, 1)
    assert later.packed is None
    torch.testing.assert_close(later.weight.data, torch.cat([dense, quantized]))


def test_plain_linear_on_an_unsupported_dtype_stays_dense():
    layer = Linear(128, 64).to(torch.float64)
    groups, weight = _groups_for(64, 128, seed=2)
    layer.weight_loader(layer.weight, groups)
    assert layer.packed is None
    torch.testing.assert_close(layer.weight.data, weight.double())
