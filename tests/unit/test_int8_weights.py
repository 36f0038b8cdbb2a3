"""8-bit GGUF weights (Q8_0) kept as codes and scales: exact against the GGUF dequantization; tiled for
the int8 dot-product kernel (`PackedInt8`) and as loaded (`Int8Groups`, the float kernel), every path
(kernels, widened GEMM, embedding lookups) equals dequantize-then-matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants

from folio import ops
from folio.layers.embedding import LMHead, VocabEmbedding
from folio.weight_formats import int8
from folio.weight_formats.gguf_dequant import dequantize, unpack
from folio.weight_formats.int8 import Int8Groups, PackedInt8, int8_groups, packed_for_kernel


@pytest.fixture(scope="module")
def q8():
    data = np.random.default_rng(0).standard_normal((320, 256)).astype(np.float32)
    raw = quants.quantize(data, Q.Q8_0)
    groups = int8_groups(unpack(raw, Q.Q8_0, (320, 256)), (320, 256))
    return groups, dequantize(raw, Q.Q8_0, (320, 256))


def test_groups_equal_the_gguf_dequantization_exactly(q8):
    groups, weight = q8
    assert torch.equal(groups.dequantize(), weight)
    assert groups.group_size == 32 and groups.nbytes == 320 * 256 + 4 * 320 * 256 // 32


def test_q5_0_codes_fit_int8_exactly():
    data = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    raw = quants.quantize(data, Q.Q5_0)
    groups = int8_groups(unpack(raw, Q.Q5_0, (64, 256)), (64, 256))
    assert groups.group_size == 32 and groups.codes.abs().max() <= 16
    assert torch.equal(groups.dequantize(), dequantize(raw, Q.Q5_0, (64, 256)))


def test_formats_with_a_bias_are_refused():
    for kind in (Q.Q4_1, Q.Q5_1):
        raw = quants.quantize(np.zeros((64, 64), dtype=np.float32), kind)
        assert int8_groups(unpack(raw, kind, (64, 64)), (64, 64)) is None


def test_the_kernels_are_built():
    assert ops.load("q8_linear") is not None  # a C++ compiler is part of the project's setup
    assert ops.load("int8_dot") is not None


def test_packed_form_is_exact_and_keeps_float16_scales_only_where_exact(q8):
    groups, weight = q8
    packed = packed_for_kernel(groups)
    assert isinstance(packed, PackedInt8) and packed.scales.dtype == torch.float16  # Q8_0's scales are float16
    assert torch.equal(packed.codes(), groups.codes) and torch.equal(packed.dequantize(), weight)
    assert packed.nbytes == 320 * 256 + 2 * 320 * 256 // 32
    finer = Int8Groups(groups.codes, groups.scales * (1 + 2**-20))  # not a float16 value any more
    assert packed_for_kernel(finer).scales.dtype == torch.float32
    assert torch.equal(packed_for_kernel(finer).dequantize(), finer.dequantize())
    odd = Int8Groups(groups.codes[:, :48].contiguous(), groups.scales[:, :1] * 0 + 1)  # groups of 48
    assert packed_for_kernel(odd) is odd


@pytest.mark.parametrize("form", ["packed", "loaded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, int8.KERNEL_MAX_ROWS, int8.DOT_MAX_ROWS_BF16 + 1])
def test_kernel_and_dense_paths_equal_dequantize_then_matmul(q8, dtype, rows, form):
    groups, weight = q8
    weights = packed_for_kernel(groups) if form == "packed" else groups
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(320).to(dtype)
    expected = F.linear(x.double(), weight.double(), bias.double())
    got = weights.linear(x, bias)
    assert got.dtype == dtype and got.shape == (rows, 320)
    # bf16: the output's rounding; the dot-product kernel codes activations in 8 + 8 bits (int8_dot's tests
    # check its integer arithmetic exactly).
    dot = form == "packed" and rows <= int8.dot_max_rows(dtype)
    tolerance = (1e-4 if dot else 1e-5) if dtype == torch.float32 else 1e-2
    assert (got.double() - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def test_embedding_and_tied_head_keep_the_weight_quantized(q8):
    groups, weight = q8
    embedding = VocabEmbedding(320, 256)
    embedding.weight.weight_loader(embedding.weight, groups)
    head = LMHead(320, 256, tied_to=embedding)
    assert embedding.weight.numel() == 0 and isinstance(embedding.packed, PackedInt8)
    ids = torch.tensor([[0, 7, 319], [5, 5, 1]])
    assert torch.equal(embedding(ids), F.embedding(ids, weight))
    hidden = torch.randn(3, 256)
    expected = hidden @ weight.t()  # activations coded in 8 + 8 bits by the dot-product kernel
    assert (head(hidden) - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 32])
def test_the_embedding_kernel_widens_the_rows_as_the_tensor_ops_do(dtype, group):
    """The C++ lookup (one call a decode step) against the indexing it replaces, with float16 scales (Q8_0) and
    float32 ones in groups of 16 (Q6_K), in float32 and bfloat16; a row past the weight is refused."""
    gen = torch.Generator().manual_seed(group)
    codes = torch.randint(-128, 128, (50, 96), generator=gen, dtype=torch.int8)
    scales = torch.rand(50, 96 // group, generator=gen) * 0.02
    packed = PackedInt8(Int8Groups(codes, scales.half().float() if group == 32 else scales))
    ids = torch.tensor([[0, 49, 17], [17, 3, 32]])
    flat = ids.flatten()
    by_tensor_ops = packed._widen(int8.untile_int8_codes(packed.tiles, flat, 96), packed._row_scales(flat), dtype)
    got = packed.embedding(ids, dtype)
    assert got.dtype == dtype and torch.equal(got, by_tensor_ops.view(2, 3, 96))
    assert torch.equal(packed.embedding(torch.tensor([7]), dtype)[0], packed.dequantize(dtype)[7])
    with pytest.raises(RuntimeError, match="row indices below 50"):
        packed.embedding(torch.tensor([50]), dtype)


@pytest.mark.parametrize("quantized", [True, False])
def test_transient_logits_equal_the_heads_and_reuse_one_buffer(q8, quantized):
    groups, weight = q8
    head = LMHead(320, 256)
    head.own.weight.weight_loader(head.own.weight, groups if quantized else weight)
    hidden = torch.randn(5, 256)
    first = head.transient_logits(hidden)
    assert torch.equal(first, head.local_logits(hidden))
    # Fewer rows: the same memory, rewritten; more rows: a larger buffer.
    fewer = head.transient_logits(hidden[:2] * 2)
    assert fewer.data_ptr() == first.data_ptr() and torch.equal(fewer, head.local_logits(hidden[:2] * 2))
    both = torch.cat([hidden, hidden])
    more = head.transient_logits(both)
    assert more.shape == (10, 320) and torch.equal(more, head.local_logits(both))
    if quantized:  # bfloat16 activations: the head's own result, widened
        assert torch.equal(head.transient_logits(hidden.bfloat16()), head.local_logits(hidden.bfloat16()).float())
