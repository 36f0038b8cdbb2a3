"""The fused CPU ops (folio/csrc/fused_ops.cpp) against their PyTorch definitions, which are the oracle:
RMSNorm.reference, apply_rotary_reference and the *_and_mul_reference activations.

float32 must agree to float rounding. In bfloat16 the fused ops compute in float32 and round where the PyTorch
path rounds, or once where PyTorch rounds after each op (rotary), so they may differ by an ulp or two.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from folio import ops
from folio.layers import fused_ops
from folio.layers.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from folio.layers.lora import LoRABatch, LoRASlots
from folio.layers.norm import RMSNorm
from folio.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_reference

BF16_ULP = 2**-7  # bfloat16 epsilon: one ulp of a value v is at most BF16_ULP * |v|
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _norm(dim: int, offset: float, weight_dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, eps=1e-6, weight_offset=offset)
    norm.weight.data = _randn(dim, seed=seed, dtype=weight_dtype)
    return norm


def _assert_norm_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # at most one bf16 ulp of the value
        torch.testing.assert_close(got.float(), expected.float(), rtol=BF16_ULP, atol=1e-6)


def test_extension_builds() -> None:
    assert fused_ops.fused_ops_for(torch.zeros(1)) is not None


def test_env_var_switches_the_ops_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOLIO_DISABLE_KERNELS", "fused_ops")
    assert ops.load.__wrapped__("fused_ops") is None  # the uncached loader; the global cache is left alone


NORM_INPUTS: dict[str, Callable[[int, torch.dtype], torch.Tensor]] = {
    "1x576": lambda seed, dt: _randn(1, 576, seed=seed, dtype=dt),
    "7x64": lambda seed, dt: _randn(7, 64, seed=seed, dtype=dt),
    "7x64-strided-rows": lambda seed, dt: _randn(7, 128, seed=seed, dtype=dt)[:, :64],
    "5x3x64": lambda seed, dt: _randn(5, 3, 64, seed=seed, dtype=dt),
    # Gemma's q_norm over the heads of a slice of a wider row: reshape copies
    "5x3x64-sliced-rows": lambda seed, dt: _randn(5, 3 * 64 * 2, seed=seed, dtype=dt)[:, : 3 * 64].view(5, 3, 64),
    # heads cut from wider heads: reshape stays a view with row stride 128
    "5x3x64-sliced-heads": lambda seed, dt: _randn(5, 3, 128, seed=seed, dtype=dt)[..., :64],
}
NORM_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize(("dtype", "weight_dtype"), NORM_DTYPES, ids=["f32", "bf16", "bf16-f32weight"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("layout", list(NORM_INPUTS))
def test_rms_norm_matches_reference(layout: str, offset: float, dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    x = NORM_INPUTS[layout](1, dtype)
    before = x.clone()
    norm = _norm(x.shape[-1], offset, weight_dtype, seed=2)
    _assert_norm_close(norm(x), norm.reference(x), dtype)
    assert torch.equal(x, before)


@pytest.mark.parametrize(("dtype", "weight_dtype"), NORM_DTYPES, ids=["f32", "bf16", "bf16-f32weight"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (6, 64)])
def test_add_and_norm_updates_residual_in_place(
    rows: int, dim: int, offset: float, dtype: torch.dtype, weight_dtype: torch.dtype
) -> None:
    x = _randn(rows, 2 * dim, seed=3, dtype=dtype)[:, :dim]  # rows strided by 2 * dim, like a column slice
    assert x.stride() == (2 * dim, 1)
    residual = _randn(rows, dim, seed=4, dtype=dtype)
    residual_before = residual.clone()
    norm = _norm(dim, offset, weight_dtype, seed=5)

    out, summed = norm.add_and_norm(x, residual)

    expected_sum = residual_before + x  # rounded to dtype, as the op must round it
    assert summed is residual  # the fused path hands back the caller's tensor, updated in place
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
    _assert_norm_close(out, norm.reference(expected_sum), dtype)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    return torch.roll(x, x.shape[-1] // 2, dims=-1)


def _assert_rotated(
    got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """|got - expected| within a few ulps of |x * cos| + |rotate_half(x) * sin| (the terms before any cancellation)."""
    x, cos, sin = x.float(), cos.float(), sin.float()
    scale = x.abs() * cos.abs() + _swap_halves(x).abs() * sin.abs()
    ulps = 4 * torch.finfo(torch.float32).eps if got.dtype == torch.float32 else 2 * BF16_ULP
    error = (got.float() - expected.float()).abs()
    worst = (error - ulps * scale - 1e-6).max().item()
    assert worst <= 0, f"rotary off by {error.max().item():.3g} (beyond tolerance by {worst:.3g})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scaling", [None, YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("tokens", [1, 9])
def test_rotary_in_place_on_qkv_views(
    tokens: int, head_dim: int, scaling: dict[str, object] | None, dtype: torch.dtype
) -> None:
    heads, kv_heads = 4, 2
    rope = RotaryEmbedding(head_dim, 256, 10000.0, scaling)
    assert (rope.multiplier != 1.0) == (scaling is not None)
    positions = torch.tensor([100, 0, 5, 3, 64, 1, 77, 2, 200])[:tokens]
    cos, sin = rope.cos_sin(positions, dtype)
    assert cos.shape == (tokens, 1, head_dim)

    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=6, dtype=dtype)
    before = qkv.clone()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    q0, k0 = q.clone(), k.clone()
    expected_q, expected_k = apply_rotary_reference(q0, k0, cos, sin)

    got_q, got_k = apply_rotary(q, k, cos, sin)

    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert not torch.equal(q, q0)  # rotated in place: the views into qkv changed
    _assert_rotated(q, expected_q, q0, cos, sin)
    _assert_rotated(k, expected_k, k0, cos, sin)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], before[:, (heads + kv_heads) * head_dim :])


ACTIVATIONS = {
    "silu": (silu_and_mul, silu_and_mul_reference),
    "gelu_tanh": (gelu_tanh_and_mul, gelu_tanh_and_mul_reference),
}
ACTIVATION_INPUTS: dict[str, Callable[[int, torch.dtype], torch.Tensor]] = {
    "1x3072": lambda seed, dt: _randn(1, 2 * 1536, seed=seed, dtype=dt),
    "6x128": lambda seed, dt: _randn(6, 2 * 64, seed=seed, dtype=dt),
    "6x128-strided-rows": lambda seed, dt: _randn(6, 3 * 64, seed=seed, dtype=dt)[:, : 2 * 64],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", list(ACTIVATION_INPUTS))
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_gated_activation_matches_reference(name: str, layout: str, dtype: torch.dtype) -> None:
    fused, reference = ACTIVATIONS[name]
    x = ACTIVATION_INPUTS[layout](7, dtype) * 2  # gates out to about +-8: both tails of the activation
    got, expected = fused(x), reference(x)
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:  # within two bf16 ulps
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 * BF16_ULP, atol=1e-5)


def _lora_slots(dtype: torch.dtype) -> LoRASlots:  # dtype: the adapters' matrices
    """Three parts (a fused q|k|v of uneven widths, none a multiple of the kernel's 64-row chunks), six slots
    of adapters of ranks 8 and 5 (below the slots' 8 in one: zero columns), inputs 72 wide (not a multiple of
    the kernel's 16-float steps)."""
    parts = [(0, 80), (80, 24), (104, 24)]
    cpu = torch.device("cpu")
    slots = LoRASlots(72, 128, parts, num_slots=6, max_rank=8, batch=LoRABatch(), dtype=dtype, device=cpu)
    for slot in range(6):
        rank = 5 if slot % 2 else 8
        for part, (_, rows) in enumerate(parts):
            seed = 100 + 10 * slot + part
            slots.load(slot, part, _randn(rank, 72, seed=seed), _randn(rows, rank, seed=seed + 5), scale=0.5)
    return slots


def _lora_exact(slots: LoRASlots, x: torch.Tensor, out: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    """out + each adapter row's low-rank product, in float64 from the slots' own matrices."""
    expected = out.double().clone()
    rank = slots.max_rank
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        shrunk = slots.a[slot].double() @ x[t].double()
        for part, (first, rows) in enumerate(slots.parts):
            b = slots.b[slot, :, first : first + rows].double()
            expected[t, first : first + rows] += shrunk[part * rank : (part + 1) * rank] @ b
    return expected


@pytest.mark.parametrize(("dtype", "weights"), [(torch.float32,) * 2, (torch.bfloat16,) * 2,
                                               (torch.float32, torch.bfloat16)],
                         ids=["f32", "bf16", "f32-bf16-adapters"])  # fmt: skip
@pytest.mark.parametrize("token_slots", [[3], [-1, 0, 5, 0, 2, -1, 5], [1] * 9, [i % 7 - 1 for i in range(16)]],
                         ids=["one", "mixed", "one-adapter-nine-rows", "sixteen"])  # fmt: skip
def test_lora_add_matches_each_rows_adapter_product(
    token_slots: list[int], dtype: torch.dtype, weights: torch.dtype
) -> None:
    slots = _lora_slots(weights)
    slots.batch.set(token_slots, torch.device("cpu"))
    x = _randn(len(token_slots), 72, seed=1, dtype=dtype)
    out = _randn(len(token_slots), 128, seed=2, dtype=dtype)
    expected = _lora_exact(slots, x, out, token_slots)

    got = fused_ops.fused_ops_for(x).lora_add(x, out_kernel := out.clone(), slots.a, slots.b, slots.batch.token_slots,
                                              slots.flat_parts)  # fmt: skip
    by_groups = slots.add_by_groups(x, out.clone())

    assert got is None
    base_rows = [t for t, slot in enumerate(token_slots) if slot < 0]
    assert torch.equal(out_kernel[base_rows], out[base_rows])  # the base model's rows untouched
    if dtype == torch.float32:
        torch.testing.assert_close(out_kernel.double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(by_groups.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # the kernel rounds each output once: within an ulp of the exact sum
        scale = expected.abs().clamp(min=1.0)
        assert ((out_kernel.double() - expected).abs() <= BF16_ULP * scale).all()


def test_lora_add_refuses_a_slot_outside_the_slots() -> None:
    slots = _lora_slots(torch.float32)
    x, out = _randn(2, 72, seed=1), _randn(2, 128, seed=2)
    with pytest.raises(RuntimeError, match="slot 6 outside"):
        fused_ops.fused_ops_for(x).lora_add(x, out, slots.a, slots.b, torch.tensor([0, 6]), slots.flat_parts)
