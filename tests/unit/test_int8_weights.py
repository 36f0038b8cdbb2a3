"""8-bit GGUF weights (Q8_0) kept as codes and scales: exact against the GGUF dequantization, and the
two C++ kernels (int8 dot products for few rows, float for more), the dense fallback and embedding
lookups equal dequantize-then-matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants

from folio import ops
from folio.layers.embedding import LMHead, VocabEmbedding
from folio.quant import int8
from folio.quant.gguf_dequant import dequantize, unpack
from folio.quant.int8 import int8_groups


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


def test_the_kernel_is_built():
    assert ops.load("q8_linear") is not None  # a C++ compiler is part of the project's setup


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows", [1, 5, int8.DOT_MAX_ROWS, int8.DOT_MAX_ROWS + 1, int8.KERNEL_MAX_ROWS, int8.KERNEL_MAX_ROWS + 1, 200]
)
def test_kernel_and_dense_paths_equal_dequantize_then_matmul(q8, dtype, rows):
    groups, weight = q8
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(320).to(dtype)
    expected = F.linear(x.double(), weight.double(), bias.double())
    got = groups.linear(x, bias)
    assert got.dtype == dtype and got.shape == (rows, 320)
    # bf16: the output's rounding; up to DOT_MAX_ROWS, activations coded in 8 + 8 bits (int8_dot's tests
    # check that kernel's integer arithmetic exactly).
    tolerance = (1e-5 if rows > int8.DOT_MAX_ROWS else 1e-4) if dtype == torch.float32 else 1e-2
    assert (got.double() - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def test_embedding_and_tied_head_keep_the_weight_quantized(q8):
    groups, weight = q8
    embedding = VocabEmbedding(320, 256)
    embedding.weight.weight_loader(embedding.weight, groups)
    head = LMHead(320, 256, tied_to=embedding)
    assert embedding.weight.numel() == 0 and embedding.packed is groups
    ids = torch.tensor([[0, 7, 319], [5, 5, 1]])
    assert torch.equal(embedding(ids), F.embedding(ids, weight))
    hidden = torch.randn(3, 256)
    expected = hidden @ weight.t()  # activations coded in 8 + 8 bits by the dot-product kernel
    assert (head(hidden) - expected).abs().max() <= 1e-4 * expected.abs().max()
