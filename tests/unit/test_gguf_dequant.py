"""folio's GGUF dequantization against the gguf package's numpy reference (`gguf.quants.dequantize`).

Equality is exact: every format's value is an f16 scale (11 significant bits) times a code of at
most 8 bits, possibly times a small integer sub-scale, which float32 represents exactly; the only
rounding is the final add of a min, the same single rounding the reference does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize

from folio.loaders.gguf_file import GGUFFile, GGUFTensor
from folio.weight_formats.gguf_dequant import SUPPORTED_TYPES, dequantize, dequantize_tensor, unpack

Q = GGMLQuantizationType

# Byte offsets of the f16 scale/min fields inside one block; everything else is free payload.
F16_FIELDS = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}
FLOAT_NUMPY = {Q.F32: np.float32, Q.F16: np.float16}
SHAPE = (6, 1024)  # 6144 values: 24 k-quant super-blocks, 192 legacy blocks


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 values spanning normal and subnormal magnitudes, both signs."""
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-7, 3, n)).astype(np.float16)


def random_bytes(ggml_type: GGMLQuantizationType, numel: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if ggml_type == Q.BF16:  # the top halves of finite float32s
        wide = (rng.standard_normal(numel) * 10.0 ** rng.integers(-30, 30, numel)).astype(np.float32)
        return np.ascontiguousarray(wide.view(np.uint16)[1::2]).view(np.uint8)
    if ggml_type in FLOAT_NUMPY:
        return (rng.standard_normal(numel) * 100).astype(FLOAT_NUMPY[ggml_type]).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (numel // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        blocks[:, offset : offset + 2] = finite_f16(rng, len(blocks)).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def reference(data: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    values = reference_dequantize(np.asarray(data), ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def test_every_supported_type_has_a_random_block_generator() -> None:
    assert set(F16_FIELDS) | {Q.F32, Q.F16, Q.BF16} == SUPPORTED_TYPES


@pytest.mark.parametrize("ggml_type", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_matches_reference_exactly(ggml_type: GGMLQuantizationType) -> None:
    data = random_bytes(ggml_type, SHAPE[0] * SHAPE[1])
    expected = reference(data, ggml_type, SHAPE)
    assert torch.isfinite(expected).all()
    out = dequantize(data, ggml_type, SHAPE)
    assert out.dtype == torch.float32 and out.shape == SHAPE
    assert torch.equal(out, expected)
    # Same bytes handed over as a torch tensor.
    assert torch.equal(dequantize(torch.from_numpy(data.copy()), ggml_type, SHAPE), expected)
    # A narrower dtype is the float32 result rounded once.
    assert torch.equal(dequantize(data, ggml_type, SHAPE, torch.bfloat16), expected.to(torch.bfloat16))


def test_chunked_path_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors longer than one chunk, including a ragged final chunk, come out whole and in order."""
    import folio.weight_formats.gguf_dequant as gguf_dequant

    monkeypatch.setattr(gguf_dequant, "_CHUNK_ELEMENTS", 1280)  # 5 super-blocks, 40 legacy blocks
    for ggml_type in (Q.Q8_0, Q.Q5_1, Q.Q4_K, Q.Q6_K):
        data = random_bytes(ggml_type, SHAPE[0] * SHAPE[1], seed=1)
        assert torch.equal(dequantize(data, ggml_type, SHAPE), reference(data, ggml_type, SHAPE))


@pytest.mark.parametrize(
    ("ggml_type", "group_size", "bits", "low", "high", "has_bias"),
    [
        (Q.Q4_0, 32, 4, -8, 7, False),
        (Q.Q4_1, 32, 4, 0, 15, True),
        (Q.Q5_0, 32, 5, -16, 15, False),
        (Q.Q5_1, 32, 5, 0, 31, True),
        (Q.Q8_0, 32, 8, -128, 127, False),
        (Q.Q4_K, 32, 4, 0, 15, True),
        (Q.Q5_K, 32, 5, 0, 31, True),
        (Q.Q6_K, 16, 6, -32, 31, False),
    ],
    ids=lambda v: v.name if isinstance(v, GGMLQuantizationType) else None,
)
def test_unpack_gives_affine_groups(
    ggml_type: GGMLQuantizationType, group_size: int, bits: int, low: int, high: int, has_bias: bool
) -> None:
    numel = SHAPE[0] * SHAPE[1]
    data = random_bytes(ggml_type, numel, seed=2)
    groups = unpack(data, ggml_type, SHAPE)
    assert groups.group_size == group_size and groups.bits == bits
    assert groups.codes.shape == (numel // group_size, group_size)
    assert groups.scales.shape == (numel // group_size, 1) and groups.scales.dtype == torch.float32
    assert (groups.biases is not None) == has_bias
    # Random payload bytes reach both ends of the code range and never leave it.
    assert int(groups.codes.min()) == low and int(groups.codes.max()) == high
    # Rebuilt independently in float64; rounding that once more to float32 is still exact, since one
    # add rounded to 53 bits and then to 24 cannot differ from rounding straight to 24 (53 >= 2*24+2).
    rebuilt = groups.codes.double() * groups.scales.double()
    if groups.biases is not None:
        rebuilt += groups.biases.double()
    expected = reference(data, ggml_type, SHAPE)
    assert torch.equal(rebuilt.float().reshape(SHAPE), expected)
    assert torch.equal(groups.dequantize().reshape(SHAPE), expected)


def test_unsupported_type_is_named() -> None:
    with pytest.raises(ValueError, match="Q2_K"):
        dequantize(np.zeros(84, dtype=np.uint8), Q.Q2_K, (256,))
    with pytest.raises(ValueError, match="F16"):
        unpack(np.zeros(64, dtype=np.uint8), Q.F16, (32,))


def test_size_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="shape"):
        dequantize(np.zeros(34, dtype=np.uint8), Q.Q8_0, (64,))  # one block, two blocks' worth asked
    with pytest.raises(ValueError, match="shape"):
        dequantize(np.zeros(34, dtype=np.uint8), Q.Q8_0, (16,))  # not a whole block


def test_result_does_not_alias_read_only_input(tmp_path: Path) -> None:
    path = tmp_path / "values.bin"
    np.arange(64, dtype=np.float32).tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    out = dequantize(mapped, Q.F32, (8, 8))
    out.zero_()  # would crash writing through a read-only mapping
    assert np.array_equal(mapped.view(np.float32), np.arange(64, dtype=np.float32))


def _samples(tensors: list[GGUFTensor]) -> list[GGUFTensor]:
    """Per type: the smallest tensor whole, and the first 64 rows of the largest (rows are whole blocks)."""
    samples = []
    for ggml_type in {t.ggml_type for t in tensors}:
        of_type = sorted((t for t in tensors if t.ggml_type == ggml_type), key=lambda t: t.num_elements)
        samples.append(of_type[0])
        big = of_type[-1]
        if len(big.shape) == 2 and big.shape[0] > 64:
            row_bytes = big.data.nbytes // big.shape[0]
            samples.append(GGUFTensor(big.name, (64, big.shape[1]), ggml_type, big.data[: 64 * row_bytes]))
    return samples


@pytest.mark.parametrize(
    ("fixture", "expected_types"),
    [
        ("smollm2_gguf", {Q.F32, Q.Q8_0, Q.Q4_1}),
        ("gemma3_gguf", {Q.F32, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K}),
    ],
)
def test_real_model_tensors_match_reference(
    fixture: str, expected_types: set[GGMLQuantizationType], request: pytest.FixtureRequest
) -> None:
    gguf_file = GGUFFile(request.getfixturevalue(fixture))
    samples = _samples(list(gguf_file.tensors.values()))
    assert {t.ggml_type for t in samples} == expected_types
    for t in samples:
        expected = reference(t.data, t.ggml_type, t.shape)
        assert torch.equal(dequantize_tensor(t), expected), t.name
