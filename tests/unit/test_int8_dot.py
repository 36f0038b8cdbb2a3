"""The int8 dot-product kernels (folio/csrc/int8_dot.cpp) against float64 oracles written here.

Activations are coded in blocks of 32 as int8 codes plus int8 residuals (their rounding error in 1/256ths of
a step), so products are checked twice: against the same arithmetic on the kernel's own coded activations
(the integer block dot products must be exact, leaving only float32 accumulation error) and against the
uncoded product (the rounding must stay small). Shapes cover the row tiles of 4 (M = 1..5, 8), output rows
split across threads and a last tile of 16 rows only partly filled (N = 50), each group-size branch (Q6_K's
16 for 8-bit weights), 4- and 5-bit codes (a fifth bit plane beside the nibbles), float16 and float32
scales, bfloat16 activations, -128 weight codes, and the tiled layouts of the 4-bit and 8-bit codes and the
fifth bits.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from folio import ops
from folio.weight_formats.int8_dot import (
    quantize_activations,
    tile_codes,
    tile_fifth_bits,
    tile_groups,
    tile_int8_codes,
    untile_codes,
    untile_fifth_bits,
    untile_groups,
    untile_int8_codes,
)

N = 50  # not a multiple of the 16-row tiles
SHAPES = [(608, 32), (1536, 128), (640, 64), (96, 32)]  # (K, group): tail + pairs of groups, wide groups, one run
INT8_SHAPES = [*SHAPES, (608, 16), (2048, 16)]  # 8-bit weights also come in Q6_K's groups of 16 (with a tail)
ROWS = [1, 2, 3, 4, 5, 8, 13]  # 13: 4-row passes over a widened tile, then a 1-row pass
_NO_FIFTH_BITS = torch.empty(0, dtype=torch.uint8)  # a 4-bit weight's


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    module = ops.load("int8_dot")
    assert module is not None, "the int8 dot-product kernel must build: a C++ compiler is part of the setup"
    return module


def _x(m: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _int4(
    k: int, group: int, seed: int, bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tiles, fifth bits (empty for 4 bits), tiled scales, tiled mins) and the float64 weight code * scale +
    min, for codes of `bits` bits."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (N, k), generator=gen)
    if bits == 5:
        codes[:, ::5] = 31  # every bit set somewhere in each mask
    scales = (torch.rand(N, k // group, generator=gen) * 0.02 + 0.001).half()
    mins = (-8 * scales.float() + torch.randn(N, k // group, generator=gen) * 0.01).half()
    weight = codes.double() * _per_column(scales, group) + _per_column(mins, group)
    high = tile_fifth_bits(codes) if bits == 5 else torch.empty(0, dtype=torch.uint8)
    return tile_codes(codes & 15), high, tile_groups(scales), tile_groups(mins), weight


def _int8(k: int, group: int, seed: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (N, k), generator=gen, dtype=torch.int8)
    codes[:, ::7] = -128  # stored as 0 once offset by 128
    return codes, (torch.rand(N, k // group, generator=gen) * 0.02 + 0.001).to(scale_dtype)


def _int8_linear(kernel: ModuleType, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int):
    """The 8-bit kernel on row-major codes and scales, tiled as PackedInt8 holds them."""
    return kernel.int8_linear(x, tile_int8_codes(codes), tile_groups(scales, scales.dtype), group, codes.shape[0])


def _per_column(groups: torch.Tensor, group: int) -> torch.Tensor:
    return groups.double().repeat_interleave(group, dim=1)


def _dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: scale * (code + residual / 256)."""
    codes, scales, residuals = quantize_activations(x.float())  # bfloat16 -> float32 is exact
    return (codes.double() + residuals.double() / 256) * _per_column(scales, 32)


def _assert_close(got: torch.Tensor, want: torch.Tensor, relative: float) -> None:
    error = (got.double() - want).abs().max().item()
    assert error <= relative * want.abs().max().item(), f"max error {error:.3g} vs max |y| {want.abs().max():.3g}"


def _tile_oracle(codes: torch.Tensor) -> torch.Tensor:
    """Byte (tile, block, j, i, t) = value 4j + t of the block for row 16 * tile + i (low nibble), and value
    16 + 4j + t (high nibble); rows past N are zero."""
    rows, k = codes.shape
    tiles = -(-rows // 16)
    out = torch.zeros(tiles, k // 32, 4, 16, 4, dtype=torch.long)
    for n in range(rows):
        for b in range(k // 32):
            for j in range(4):
                for t in range(4):
                    out[n // 16, b, j, n % 16, t] = codes[n, 32 * b + 4 * j + t] | (
                        codes[n, 32 * b + 16 + 4 * j + t] << 4
                    )
    return out.reshape(tiles, -1).to(torch.uint8)


@pytest.mark.parametrize(("rows", "k"), [(16, 32), (50, 64), (3, 96)])
def test_codes_follow_the_tile_layout_and_round_trip(rows: int, k: int) -> None:
    codes = torch.randint(0, 16, (rows, k), generator=torch.Generator().manual_seed(k))
    tiles = tile_codes(codes)
    assert tiles.shape == (-(-rows // 16), k // 32 * 256) and tiles.dtype == torch.uint8
    assert torch.equal(tiles, _tile_oracle(codes))
    assert torch.equal(untile_codes(tiles, rows, k).long(), codes)
    groups = torch.rand(rows, k // 32)
    assert torch.equal(untile_groups(tile_groups(groups), rows), groups.half())


@pytest.mark.parametrize(("rows", "k"), [(16, 32), (50, 64), (3, 96)])
def test_int8_codes_follow_their_tile_layout_and_round_trip(rows: int, k: int) -> None:
    codes = torch.randint(-128, 128, (rows, k), generator=torch.Generator().manual_seed(k), dtype=torch.int8)
    tiles = tile_int8_codes(codes)
    assert tiles.shape == (-(-rows // 16), k // 32 * 512) and tiles.dtype == torch.uint8
    n, b, j, t = rows - 1, k // 32 - 1, 5, 2  # value 32b + 4j + t of the last row, at byte (j, i, t) of block b
    assert tiles[n // 16, b * 512 + j * 64 + (n % 16) * 4 + t].item() == codes[n, 32 * b + 4 * j + t].item() + 128
    assert torch.equal(untile_int8_codes(tiles, rows, k), codes)
    picked = torch.tensor([rows - 1, 0, rows // 2, 0])
    assert torch.equal(untile_int8_codes(tiles, picked, k), codes[picked])
    if rows % 16:
        assert (tiles.view(-1, k // 32, 8, 16, 4)[-1, :, :, rows % 16 :] == 128).all()  # padding rows: code 0


def test_tile_hand_checked_byte() -> None:
    codes = torch.zeros(2, 32, dtype=torch.long)
    codes[1, 4], codes[1, 20] = 3, 9  # row 1, block 0, j = 1, t = 0: low value 4, high value 16 + 4
    assert tile_codes(codes)[0, 64 * 1 + 4 * 1].item() == 0x93


def test_activation_quantization_rounds_half_to_even_per_block(kernel: ModuleType) -> None:
    x = _x(5, 608, seed=1)
    x[1, 64:96] = 0  # an all-zero block: scale 0, codes 0
    x[0, :32] = 0
    x[0, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, 1.5, -0.5])  # scale exactly 1: ties to even
    codes, scales, residuals = quantize_activations(x)
    blocks = x.double().reshape(5, -1, 32)
    want_scales = blocks.abs().amax(dim=-1) / 127
    steps = blocks / want_scales.clamp_min(1e-300).unsqueeze(-1)
    want_codes = torch.round(steps).reshape(5, -1)
    assert torch.equal(codes.long(), want_codes.long())
    # The residual: the rounding error in 1/256ths of a step (float32 arithmetic may tip a tie by one).
    want_residuals = torch.round((steps.reshape(5, -1) - want_codes) * 256).clamp(-127, 127)
    assert (residuals.long() - want_residuals.long()).abs().max() <= 1
    assert residuals[0, :6].tolist() == [0, 127, 127, 127, -127, -127]  # ties: half a step, clamped
    assert not residuals[1, 64:96].any()
    assert codes[0, :6].tolist() == [127, 2, -4, 0, 2, 0]
    assert scales[1, 2].item() == 0 and not codes[1, 64:96].any()
    assert ((scales.double() - want_scales).abs() <= 1e-7 * want_scales).all()


def test_activation_quantization_of_a_tiny_block(kernel: ModuleType) -> None:
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1e-37, -4e-38  # 1 / scale would overflow to inf
    codes, _, _ = quantize_activations(x)
    assert codes[0, :2].tolist() == [127, -51]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("k", "group"), SHAPES)
def test_integer_block_products_are_exact(kernel: ModuleType, k: int, group: int, m: int, dtype: torch.dtype) -> None:
    x = _x(m, k, seed=k + m, dtype=dtype)
    xq = _dequantized_activations(x)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # float32 accumulation, or rounding to bfloat16
    for bits in (4, 5):
        tiles, high, scales, mins, _ = _int4(k, group, seed=k, bits=bits)
        codes4 = untile_codes(tiles, N, k).double()
        if bits == 5:
            codes4 += untile_fifth_bits(high, N, k).double()
        scales4, mins4 = untile_groups(scales, N), untile_groups(mins, N)
        want = xq @ (codes4 * _per_column(scales4, group)).T + x.double() @ _per_column(mins4, group).T
        got = kernel.int4_linear(x, tiles, high, scales, mins, group, N)
        assert got.dtype == dtype and got.shape == (m, N)
        _assert_close(got, want, tolerance)
    codes, scales8 = _int8(k, group, seed=k, scale_dtype=torch.float16)
    got = _int8_linear(kernel, x, codes, scales8, group)
    assert got.dtype == dtype and got.shape == (m, N)
    _assert_close(got, xq @ (codes.double() * _per_column(scales8, group)).T, tolerance)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 5])
def test_int8_negative_codes_and_scale_dtypes(kernel: ModuleType, m: int, scale_dtype: torch.dtype) -> None:
    for k, group in INT8_SHAPES:
        x = _x(m, k, seed=m)
        codes, scales = _int8(k, group, seed=k + 1, scale_dtype=scale_dtype)
        want = _dequantized_activations(x) @ (codes.double() * _per_column(scales, group)).T
        _assert_close(_int8_linear(kernel, x, codes, scales, group), want, 1e-5)
    # All -128 against x = 1 (codes 127, scale 1/127): y = -128 * K.
    lowest = torch.full((N, 608), -128, dtype=torch.int8)
    got = _int8_linear(kernel, torch.ones(m, 608), lowest, torch.ones(N, 19, dtype=scale_dtype), 32)
    assert torch.allclose(got.double(), torch.full((m, N), -128.0 * 608, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("m", [1, 4, 5])
def test_the_largest_codes_against_the_largest_activations_do_not_overflow(kernel: ModuleType, m: int, sign: int):
    """Without VNNI the 4- and 5-bit products add in 16-bit lanes over a block: codes of 31 against activation
    codes of 127 (every value of a block at its maximum) and residuals of 127 (126.5 steps, half way, rounds
    to 126 and a residual of 128, kept at 127) are those sums' largest."""
    k, group = 256, 32
    x = torch.full((m, k), float(sign))
    x[:, 1::2] = sign * 126.5 / 127  # odd values: code 126 and residual 127; even ones: 127, residual 0
    x[m - 1, 64:] *= -1  # a row whose later blocks change sign
    for bits, exact in [(4, True), (5, True), (5, False)]:
        codes = torch.full((N, k), (1 << bits) - 1)
        scales = torch.ones(N, k // group).half()
        mins = torch.zeros(N, k // group).half()
        high = tile_fifth_bits(codes) if bits == 5 else _NO_FIFTH_BITS
        xq = _dequantized_activations(x) if exact else _quantized_codes_only(x)
        tiles, tiled_scales, tiled_mins = tile_codes(codes & 15), tile_groups(scales), tile_groups(mins)
        got = kernel.int4_linear(x, tiles, high, tiled_scales, tiled_mins, group, N, exact)
        _assert_close(got, xq @ codes.double().T, 1e-6)


def _quantized_codes_only(x: torch.Tensor) -> torch.Tensor:
    codes, scales, _ = quantize_activations(x)
    return codes.double() * _per_column(scales, 32)


@pytest.mark.parametrize("m", [1, 4, 5])
@pytest.mark.parametrize(("k", "group"), SHAPES)
def test_error_against_the_unquantized_product_is_small(kernel: ModuleType, k: int, group: int, m: int) -> None:
    x = _x(m, k, seed=100 + m)
    for bits in (4, 5):
        tiles, high, scales, mins, weight = _int4(k, group, seed=k + 2, bits=bits)
        # Codes and residuals give activations 15 significant bits.
        _assert_close(kernel.int4_linear(x, tiles, high, scales, mins, group, N), x.double() @ weight.T, 1e-4)
    codes, scales8 = _int8(k, group, seed=k + 3, scale_dtype=torch.float16)
    weight8 = codes.double() * _per_column(scales8, group)
    _assert_close(_int8_linear(kernel, x, codes, scales8, group), x.double() @ weight8.T, 1e-4)


@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize(("k", "group"), [*SHAPES, (32, 32)])
def test_int4_dequantize(kernel: ModuleType, k: int, group: int, bits: int) -> None:
    tiles, high, scales, mins, weight = _int4(k, group, seed=k + 4, bits=bits)
    wide = kernel.int4_dequantize(tiles, high, scales, mins, group, N, k, torch.float32)
    assert wide.dtype == torch.float32 and torch.allclose(wide.double(), weight, rtol=0, atol=1e-7)
    bf16 = kernel.int4_dequantize(tiles, high, scales, mins, group, N, k, torch.bfloat16)
    assert torch.equal(bf16, wide.to(torch.bfloat16))


@pytest.mark.parametrize("m", [1, 8, 13])
def test_5_bit_tiles_of_signed_codes_fold_their_mins_in(kernel: ModuleType, m: int) -> None:
    """Q5_0's weights are scale * (code - 16): every min is -16 * its scale. From 8 rows the kernel widens a
    tile to 8 bits as code - 16 and skips the mins' products, so the coded activations multiply the whole
    weight (as the 8-bit tiles do); one tile whose mins differ (rows 16-31) takes them apart, against the
    uncoded activations."""
    k, group = 640, 32
    tiles, high, scales, _, _ = _int4(k, group, seed=m, bits=5)
    codes = untile_codes(tiles, N, k).double() + untile_fifth_bits(high, N, k).double()
    scales16 = untile_groups(scales, N).float()
    mins16 = (-16 * scales16).half()
    mins16[16:32] = (mins16[16:32].float() * 1.01).half()
    x = _x(m, k, seed=m)
    scaled, mins = codes * _per_column(scales16, group), _per_column(mins16, group)
    xq = _dequantized_activations(x)
    want = xq @ (scaled + mins).T
    if m >= 8:
        want[:, 16:32] = xq @ scaled[16:32].T + x.double() @ mins[16:32].T
    else:  # unwidened: every tile's mins against the uncoded activations
        want = xq @ scaled.T + x.double() @ mins.T
    got = kernel.int4_linear(x, tiles, high, scales, tile_groups(mins16), group, N)
    _assert_close(got, want, 1e-5)


def test_fifth_bits_follow_their_layout_and_round_trip() -> None:
    """Mask 2j + h of block b holds in bit 4i + t the fifth bit of value 32b + 16h + 4j + t of row i."""
    codes = torch.zeros(20, 64, dtype=torch.uint8)
    codes[3, 32 + 16 + 4 * 2 + 1] = 16  # row 3, block 1, h 1, j 2, t 1: mask 5, bit 13
    codes[19, 0] = 31  # tile 1, row 3, block 0, mask 0, bit 12
    high = tile_fifth_bits(codes)
    assert high.shape == (2, 2 * 64)
    masks = high.view(2, 2, 8, 8)  # [tile, block, mask, byte]
    assert masks[0, 1, 5, 1].item() == 1 << 5 and masks.count_nonzero() == 2
    assert masks[1, 0, 0, 1].item() == 1 << 4
    assert torch.equal(untile_fifth_bits(high, 20, 64), codes & 16)


def test_a_wrongly_sized_fifth_bit_plane_is_refused(kernel: ModuleType) -> None:
    tiles, high, scales, mins, _ = _int4(64, 32, seed=1, bits=5)
    with pytest.raises(RuntimeError, match="high_bits"):
        kernel.int4_linear(_x(1, 64, seed=1), tiles, high[:, :-8].contiguous(), scales, mins, 32, N)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("k", "group"), [*INT8_SHAPES, (32, 32)])
def test_int8_dequantize(kernel: ModuleType, k: int, group: int, scale_dtype: torch.dtype) -> None:
    codes, scales = _int8(k, group, seed=k + 6, scale_dtype=scale_dtype)
    tiled = tile_groups(scales, scale_dtype)
    wide = kernel.int8_dequantize(tile_int8_codes(codes), tiled, group, N, k, torch.float32)
    assert torch.equal(wide, (codes.double() * _per_column(scales, group)).float())
    bf16 = kernel.int8_dequantize(tile_int8_codes(codes), tiled, group, N, k, torch.bfloat16)
    assert torch.equal(bf16, wide.to(torch.bfloat16))


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("k", [608, 2048])
def test_int8_groups_of_16_against_the_unquantized_product(kernel: ModuleType, k: int, m: int) -> None:
    x = _x(m, k, seed=200 + m, dtype=torch.bfloat16)
    codes, scales = _int8(k, 16, seed=k + 5, scale_dtype=torch.float32)
    weight = codes.double() * _per_column(scales, 16)
    _assert_close(_int8_linear(kernel, x, codes, scales, 16), x.double() @ weight.T, 1e-2)


@pytest.mark.parametrize(("k", "group"), [(48, 48), (192, 96)])
def test_bad_shapes_are_refused(kernel: ModuleType, k: int, group: int) -> None:
    x = torch.ones(2, k)
    tiled = torch.ones(4, k // group, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError):
        kernel.int4_linear(x, torch.zeros(4, k // 32 * 256, dtype=torch.uint8), _NO_FIFTH_BITS, tiled, tiled, group, N)
    with pytest.raises(RuntimeError):
        kernel.int8_linear(x, torch.zeros(4, k // 32 * 512, dtype=torch.uint8), tiled, group, N)


def test_groups_of_16_are_8_bit_only(kernel: ModuleType) -> None:
    tiled = torch.ones(4, 4, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="16 for 8-bit"):
        kernel.int4_linear(torch.ones(2, 64), torch.zeros(4, 2 * 256, dtype=torch.uint8), _NO_FIFTH_BITS, tiled, tiled,
                           16, N)  # fmt: skip


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("k", "group"), INT8_SHAPES)
def test_8_bit_activations_multiply_the_codes_alone(kernel: ModuleType, k: int, group: int, m: int) -> None:
    # exact=False: llama.cpp's Q8 activations, scale * code, the residuals dropped.
    x = _x(m, k, seed=7 * k + m)
    codes_x, scales_x, _ = quantize_activations(x)
    x8 = codes_x.double() * _per_column(scales_x, 32)
    codes, scales8 = _int8(k, group, seed=k + 5, scale_dtype=torch.float16)
    got = kernel.int8_linear(x, tile_int8_codes(codes), tile_groups(scales8, scales8.dtype), group, N, False)
    want = x8 @ (codes.double() * _per_column(scales8, group)).T
    _assert_close(got, want, 1e-5)
    exact = _dequantized_activations(x) @ (codes.double() * _per_column(scales8, group)).T
    assert not torch.allclose(got.double(), exact, rtol=0, atol=1e-6)  # the residuals were not taken
    if group != 16:  # 4-bit weights take no groups of 16
        for bits in (4, 5):
            tiles, high, scales, mins, weight = _int4(k, group, seed=k + 6, bits=bits)
            scales4, mins4 = untile_groups(scales, N), untile_groups(mins, N)
            codes4 = (weight - _per_column(mins4, group)) / _per_column(scales4, group)
            want4 = x8 @ (codes4.round() * _per_column(scales4, group)).T + x.double() @ _per_column(mins4, group).T
            _assert_close(kernel.int4_linear(x, tiles, high, scales, mins, group, N, False), want4, 1e-5)
