"""NF4 weights (QLoRA's 4-bit NormalFloat, double-quantized block absmax): the codebook is bitsandbytes',
each weight takes the nearest codebook value of w / absmax, the nibbles sit where bitsandbytes puts them,
the 8-bit absmax stays within half a step, the kernel and dense paths equal dequantize-then-matmul, and
the tensors round-trip through safetensors at ~4.13 bits per weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from folio import ops
from folio.layers.weight_storage import ConcatRows, RowStaging
from folio.weight_formats import nf4
from folio.weight_formats.nf4 import BLOCK_SIZE, NF4_CODEBOOK, SCALE_BLOCK_SIZE, NF4Weight

# bitsandbytes `functional.get_4bit_type("nf4")` (and csrc `nf4_data`), QLoRA arXiv 2305.14314.
PUBLISHED_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]
ROWS, COLS = 301, 256  # 1204 absmax blocks: five scales, the last one partial; 301 rows leave a kernel tail


def _unpacked(codes: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] bytes -> [N, K] codes, the high nibble first."""
    return torch.stack([codes >> 4, codes & 15], dim=-1).flatten(-2)


def _absmax_tolerance(q: NF4Weight, true_absmax: torch.Tensor) -> torch.Tensor:
    """Half an 8-bit step per block: each run of 256 absmax values is coded around the offset with its
    largest deviation / 127 as the step."""
    centered = F.pad(true_absmax - q.absmax_offset, (0, -true_absmax.numel() % SCALE_BLOCK_SIZE))
    half_step = centered.view(-1, SCALE_BLOCK_SIZE).abs().amax(dim=1) / 254
    return half_step.repeat_interleave(SCALE_BLOCK_SIZE)[: true_absmax.numel()] * (1 + 1e-5) + 1e-7


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)) * 0.02


@pytest.fixture(scope="module")
def q(weight) -> NF4Weight:
    return NF4Weight.quantize(weight)


def test_the_codebook_is_bitsandbytes_nf4():
    assert NF4_CODEBOOK.dtype == torch.float32
    assert torch.equal(NF4_CODEBOOK, torch.tensor(PUBLISHED_NF4, dtype=torch.float32))
    assert NF4_CODEBOOK[7] == 0 and NF4_CODEBOOK[0] == -1 and NF4_CODEBOOK[15] == 1


def test_codebook_values_times_a_block_absmax_round_trip():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (ROWS, COLS), generator=gen)
    codes[:, ::BLOCK_SIZE] = torch.randint(0, 2, (ROWS, COLS // BLOCK_SIZE), generator=gen) * 15  # a +-1 per block
    absmax = torch.rand(ROWS * COLS // BLOCK_SIZE, generator=gen) * 2 + 0.01
    weight = (NF4_CODEBOOK[codes].view(-1, BLOCK_SIZE) * absmax.unsqueeze(1)).view(ROWS, COLS)
    q = NF4Weight.quantize(weight)
    assert torch.equal(_unpacked(q.codes).long(), codes)
    tolerance = _absmax_tolerance(q, absmax)
    assert ((q.block_absmax() - absmax).abs() <= tolerance).all()
    error = (q.dequantize() - weight).view(-1, BLOCK_SIZE).abs()
    assert (error <= tolerance.unsqueeze(1) * NF4_CODEBOOK[codes].abs().view(-1, BLOCK_SIZE) + 1e-6).all()
    assert tolerance.max() < 2 / 254 * 1.01  # the bound itself is small: absmax in [0.01, 2.01]


def test_each_code_is_the_nearest_codebook_value_and_the_error_is_small(weight, q):
    blocks = weight.view(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    nearest = ((blocks / absmax).unsqueeze(-1) - NF4_CODEBOOK).abs().argmin(dim=-1)  # brute force
    assert torch.equal(_unpacked(q.codes).view(-1, BLOCK_SIZE).long(), nearest)
    tolerance = _absmax_tolerance(q, absmax.squeeze(1))
    assert ((q.block_absmax() - absmax.squeeze(1)).abs() <= tolerance).all()
    # Half the widest codebook gap (between 0.723 and 1.0), plus the absmax's own error.
    half_gap = (NF4_CODEBOOK[1:] - NF4_CODEBOOK[:-1]).max() / 2
    error = (q.dequantize() - weight).view(-1, BLOCK_SIZE).abs()
    assert (error <= absmax * half_gap + tolerance.unsqueeze(1) + 1e-7).all()
    assert (q.dequantize() - weight).norm() / weight.norm() < 0.1  # ~0.092 for normal weights


def test_the_even_k_sits_in_the_high_nibble():
    weight = torch.zeros(2, 64)
    weight[0, :4] = torch.tensor([1.0, -1.0, 0.0, PUBLISHED_NF4[13]])  # codes 15, 0, 7, 13; 0.0 is code 7
    weight[1, 62:] = torch.tensor([PUBLISHED_NF4[1], 1.0])  # codes 1, 15
    q = NF4Weight.quantize(weight)
    assert q.codes.shape == (2, 32) and q.codes.dtype == torch.uint8
    assert q.codes[0, :3].tolist() == [0xF0, 0x7D, 0x77] and (q.codes[0, 2:] == 0x77).all()
    assert (q.codes[1, :31] == 0x77).all() and q.codes[1, 31].item() == 0x1F
    assert torch.equal(q.block_absmax(), torch.ones(2))  # both absmax equal the offset: code 128, scale 0
    assert q.absmax_codes.tolist() == [128, 128] and q.absmax_offset == 1.0
    assert torch.equal(q.dequantize(), weight)


def test_the_kernel_is_built():
    assert ops.load("nf4_linear") is not None  # a C++ compiler is part of the project's setup


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_the_kernel_equals_dequantize_then_matmul(q, rows):
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows))
    got = ops.load("nf4_linear").nf4_linear(x, q.codes, q.absmax_codes, q.absmax_scales, q.absmax_offset, NF4_CODEBOOK)
    expected = x.double() @ q.dequantize().double().t()
    assert (got.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows", [1, 3, 64, nf4.KERNEL_MAX_ROWS_16BIT + 1, nf4.KERNEL_MAX_ROWS, nf4.KERNEL_MAX_ROWS + 1]
)
def test_linear_equals_dequantize_then_matmul(q, rows, dtype, with_bias):
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(ROWS, generator=torch.Generator().manual_seed(7)).to(dtype) if with_bias else None
    expected = F.linear(x.double(), q.dequantize().double(), None if bias is None else bias.double())
    got = q.linear(x, bias)
    assert got.dtype == dtype and got.shape == (rows, ROWS)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the weight's and the output's rounding
    assert (got.double() - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def test_linear_keeps_leading_dimensions(q):
    x = torch.randn(2, 3, COLS)
    torch.testing.assert_close(q.linear(x), (x.view(6, COLS) @ q.dequantize().t()).view(2, 3, ROWS))


def test_tensors_round_trip_through_safetensors(q, tmp_path):
    path = tmp_path / "nf4.safetensors"
    save_file(q.to_tensors(), str(path))
    tensors = load_file(str(path))
    assert set(tensors) == {
        "weight_nf4",
        "weight_absmax_codes",
        "weight_absmax_scales",
        "weight_absmax_offset",
        "weight_shape",
    }
    assert tensors["weight_absmax_offset"].shape == () and tensors["weight_shape"].tolist() == [ROWS, COLS]
    loaded = NF4Weight.from_tensors(tensors)
    assert loaded.shape == q.shape and loaded.absmax_offset == q.absmax_offset
    assert torch.equal(loaded.codes, q.codes) and torch.equal(loaded.absmax_codes, q.absmax_codes)
    assert torch.equal(loaded.absmax_scales, q.absmax_scales)
    assert torch.equal(loaded.dequantize(), q.dequantize())


def test_shards_of_a_fused_layer_stay_side_by_side_exactly(q):
    """NF4's absmax scales run across rows, so a fused layer keeps its shards apart (ConcatRows)
    instead of re-encoding them: the kept layer equals its shards exactly."""
    parts = [q, NF4Weight.quantize(torch.randn(64, COLS, generator=torch.Generator().manual_seed(3)))]
    staging = RowStaging(ROWS + 64)
    staging.put(ROWS, parts[1])
    staging.put(0, parts[0])
    kept = staging.build()
    assert isinstance(kept, ConcatRows) and kept.shape == (ROWS + 64, COLS)
    assert kept.rows(ROWS, 64) is parts[1] and kept.nbytes == q.nbytes + parts[1].nbytes
    assert torch.equal(kept.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, COLS)
    torch.testing.assert_close(kept.linear(x), torch.cat([p.linear(x) for p in parts], dim=-1))
    with pytest.raises(ValueError):
        kept.rows(0, 100)


def test_mismatched_tensors_and_shapes_are_refused(q):
    with pytest.raises(ValueError):
        NF4Weight.quantize(torch.randn(4, 96))
    tensors = q.to_tensors()
    tensors["weight_absmax_codes"] = tensors["weight_absmax_codes"][:-1]
    with pytest.raises(ValueError):
        NF4Weight.from_tensors(tensors)


def test_storage_is_about_4_13_bits_per_weight(q):
    blocks = ROWS * COLS // BLOCK_SIZE
    assert q.absmax_scales.numel() == 5 == -(-blocks // SCALE_BLOCK_SIZE)
    assert q.nbytes == ROWS * COLS // 2 + blocks + 4 * 5 + 4
    bits = 8 * q.nbytes / (ROWS * COLS)
    assert abs(bits - (4 + 8 / BLOCK_SIZE + 32 / (BLOCK_SIZE * SCALE_BLOCK_SIZE))) < 0.002  # 4.1270
