"""4- and 5-bit GGUF weights kept packed: the mapping onto the 4-bit groups (and a fifth bit plane) is
exact, the packed layout round-trips, and both multiply paths (the int8 dot-product kernel, widen-then-GEMM)
equal dequantize-then-matmul on the GGUF bytes. A fused layer whose shards come in different formats keeps
each run of one format packed for its own kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants
from torch import nn

from folio.layers.linear import Linear, MergedLinear
from folio.layers.weight_storage import ConcatRows
from folio.loaders.gguf_file import GGUFFile, GGUFTensor
from folio.loaders.gguf_model import GGUFWeight
from folio.weight_formats import int4
from folio.weight_formats.activation_bits import set_activation_bits
from folio.weight_formats.gguf_dequant import dequantize, unpack
from folio.weight_formats.int4 import Int4Groups, PackedInt4, int4_groups
from folio.weight_formats.int8 import Int8Groups, PackedInt8


def _quantized(ggml_type: Q, rows: int, cols: int, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return quants.quantize(data, ggml_type), (rows, cols)


def load_gguf_groups(data: np.ndarray, ggml_type: Q, shape: tuple[int, int]) -> Int4Groups | Int8Groups:
    """A projection weight as the GGUF loader hands it to a layer."""
    tensor = GGUFTensor("blk.0.attn_q.weight", shape, ggml_type, data)
    loaded = GGUFWeight(tensor, tensor.name, None, 0.0, True, torch.float32).load()
    assert isinstance(loaded, Int4Groups | Int8Groups)
    return loaded


def _gguf_q4_k(path) -> tuple[np.ndarray, tuple[int, ...]]:
    """A real Q4_K tensor (gguf-py cannot make one)."""
    tensor = next(t for t in GGUFFile(path).tensors.values() if t.ggml_type == Q.Q4_K and len(t.shape) == 2)
    return tensor.data, tensor.shape


def _random_q5_k(rows: int, cols: int, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Q5_K super-blocks of random codes, sub-block scales and mins, under moderate d and dmin (gguf-py
    cannot quantize to Q5_K and no catalog file holds it)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // 256, 176), dtype=np.uint8)  # d, dmin, 12 scale bytes, qh, qs
    for offset in (0, 2):
        scales = rng.uniform(1e-4, 1e-3, len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1), (rows, cols)


FORMATS = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K"]


@pytest.fixture(params=FORMATS)
def gguf_tensor(request, gemma3_gguf):
    if request.param == "Q4_K":
        data, shape = _gguf_q4_k(gemma3_gguf)
        return Q.Q4_K, data, shape
    if request.param == "Q5_K":
        data, shape = _random_q5_k(192, 512, seed=5)
        return Q.Q5_K, data, shape
    data, shape = _quantized(Q[request.param], 192, 256, seed=len(request.param))
    return Q[request.param], data, shape


def test_int4_groups_equal_the_gguf_dequantization_exactly(gguf_tensor):
    ggml_type, data, shape = gguf_tensor
    groups = int4_groups(unpack(data, ggml_type, shape), shape)
    bits = 5 if ggml_type.name.startswith("Q5") else 4
    assert groups is not None and groups.bits == bits and groups.codes.max() == (1 << bits) - 1
    assert torch.equal(groups.dequantize(), dequantize(data, ggml_type, shape))


def test_the_loader_keeps_5_bit_projections_as_5_bit_groups_and_a_q5_0_embedding_as_8_bit():
    for ggml_type, (data, shape) in [(Q.Q5_0, _quantized(Q.Q5_0, 32, 256, seed=1)),
                                     (Q.Q5_1, _quantized(Q.Q5_1, 32, 256, seed=2)),
                                     (Q.Q5_K, _random_q5_k(32, 256, seed=3))]:  # fmt: skip
        groups = load_gguf_groups(data, ggml_type, shape)
        assert isinstance(groups, Int4Groups) and groups.bits == 5
        assert torch.equal(groups.dequantize(), dequantize(data, ggml_type, shape))
    data, shape = _quantized(Q.Q5_0, 32, 256, seed=4)
    tensor = GGUFTensor("token_embd.weight", shape, Q.Q5_0, data)
    embedding = GGUFWeight(tensor, tensor.name, None, 0.0, True, torch.float32).load()
    assert isinstance(embedding, Int8Groups)  # an embedding lookup reads its rows as 8-bit codes


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
    fifth_bits = shape[0] * shape[1] // 8 if groups.bits == 5 else 0  # one bit a weight
    assert packed.nbytes == shape[0] * shape[1] // 2 + fifth_bits + 2 * 2 * shape[0] * shape[1] // 32


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


def test_fused_layer_of_shards_in_different_formats_keeps_each_packed():
    """gemma3's file: q and k in Q5_0, v in Q8_0. The 5-bit rows join into one 4-bit tile set with a fifth bit
    plane, v stays 8-bit, and the layer multiplies by both."""
    layer = MergedLinear(256, {"q": 128, "k": 64, "v": 64})
    dense = []
    for i, (shard, size, ggml_type) in enumerate([("q", 128, Q.Q5_0), ("k", 64, Q.Q5_0), ("v", 64, Q.Q8_0)]):
        data, shape = _quantized(ggml_type, size, 256, seed=i)
        layer.weight_loader(layer.weight, load_gguf_groups(data, ggml_type, shape), shard)
        dense.append(dequantize(data, ggml_type, shape))
    assert isinstance(layer.packed, ConcatRows) and layer.weight.numel() == 0
    first, second = layer.packed.parts
    assert isinstance(first, PackedInt4) and first.bits == 5 and first.shape == (192, 256)
    assert isinstance(second, PackedInt8) and second.shape == (64, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    expected = x.double() @ torch.cat(dense).double().t()
    assert (layer(x).double() - expected).abs().max() <= 1e-3 * expected.abs().max()
    assert set_activation_bits(nn.Sequential(layer), 8) == 2  # each block of rows takes the setting
    assert not first.exact_activations and not second.exact_activations


def test_4_and_5_bit_shards_join_as_5_bit():
    layer = MergedLinear(256, {"gate": 64, "up": 64})
    for i, (shard, ggml_type) in enumerate([("gate", Q.Q4_1), ("up", Q.Q5_1)]):
        data, shape = _quantized(ggml_type, 64, 256, seed=10 + i)
        layer.weight_loader(layer.weight, int4_groups(unpack(data, ggml_type, shape), shape), shard)
    assert isinstance(layer.packed, PackedInt4) and layer.packed.bits == 5


def test_plain_linear_on_an_unsupported_dtype_stays_dense():
    layer = Linear(128, 64).to(torch.float64)
    groups, weight = _groups_for(64, 128, seed=2)
    layer.weight_loader(layer.weight, groups)
    assert layer.packed is None
    torch.testing.assert_close(layer.weight.data, weight.double())
