"""The greedy pick over an 8-bit LM head from its 8-bit product (or its codes' six high bits) and the
rows near the top (folio/csrc/int8_greedy.h, six_bit_pass.h, PackedInt8.greedy, LMHead.greedy_best)
against the full product's argmax:
the same token and the same float value in every row, ties and all; rows it cannot bound (non-finite
activations, too many rows near the top) are left to the full product, which then decides them."""

from __future__ import annotations

import math

import pytest
import torch

from folio import LLM, SamplingParams, ops
from folio.layers.embedding import LMHead
from folio.layers.split_argmax import local_best
from folio.weight_formats.int8 import Int8Groups, PackedInt8

pytestmark = pytest.mark.skipif(ops.load("int8_dot") is None, reason="needs the int8 dot-product kernel")


def _packed(rows: int, cols: int, group: int, seed: int, float16_scales: bool = True) -> PackedInt8:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)
    scales = torch.rand(rows, cols // group, generator=generator) * 1e-3 + 1e-4
    return PackedInt8(Int8Groups(codes, scales.half().float() if float16_scales else scales))


def _activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 3
    x[:, 5] = 40.0  # an outlier channel, as real activations have: its blocks' other values get coarse codes
    return x


def _full_best(packed: PackedInt8, x: torch.Tensor) -> torch.Tensor:
    return local_best(packed.linear(x).float(), 0)


@pytest.mark.parametrize(
    "rows, cols, group, float16_scales",
    [(1000, 640, 32, True), (4099, 576, 16, False), (515, 256, 128, True), (40000, 64, 64, False)],
)
@pytest.mark.parametrize("batch", [2, 3, 5, 64])
def test_the_pick_equals_the_full_products_argmax(rows, cols, group, float16_scales, batch):
    """Groups of 32 (Q8_0), 16 (Q6_K's, float32 scales), 128 and 64; a row count that is not a whole
    number of tiles; 2 to 64 activation rows."""
    packed = _packed(rows, cols, group, seed=rows + batch, float16_scales=float16_scales)
    x = _activations(batch, cols, seed=batch)
    best, decided = packed.greedy(x)
    assert bool(decided.all())
    assert torch.equal(best, _full_best(packed, x))  # the value's float bits and the first index


@pytest.mark.parametrize("batch", [2, 64, 128])
def test_bfloat16_activations_pick_among_the_rounded_logits(batch):
    """With bfloat16 activations the full product's logits come rounded to bfloat16, so rows a little
    apart tie once rounded, and the first of them is the pick: copies of the best row scaled 5% up, with
    scales 0.01% apart (closer than a bfloat16 step), scattered through the head, must give the full
    product's pick."""
    packed = _packed(6000, 640, 32, seed=11)
    # Whole numbers with 127 in every block: exact codes, no residuals, so the bound is far below a
    # bfloat16 step and only the lowered floor keeps the copies that round alike.
    x = torch.randint(-60, 61, (batch, 640), generator=torch.Generator().manual_seed(12)).float()
    x[:, ::32] = 127.0
    x = x.bfloat16()
    codes, scales = packed.codes(), packed._row_scales().clone()
    source = int(_full_best(packed, x)[0, 1])
    for j, target in enumerate(torch.randperm(6000, generator=torch.Generator().manual_seed(13))[:24].tolist()):
        codes[target], scales[target] = codes[source], scales[source] * 1.05 * (1 + 1e-4 * (j - 12))
    near = PackedInt8(Int8Groups(codes, scales))
    best, decided = near.greedy(x)
    assert bool(decided.all())
    assert torch.equal(best, _full_best(near, x))
    rounded = near.linear(x[:1]).float()
    assert int((rounded == rounded.max()).sum()) > 1  # the premise: rows tie at the top once rounded


def test_bfloat16_rows_past_the_kernels_reach_take_the_full_product():
    packed = _packed(300, 64, 32, seed=4)
    assert packed.greedy(_activations(129, 64, seed=1).bfloat16()) is None  # linear widens for a GEMM there


def test_ties_and_rows_only_the_residuals_tell_apart():
    """For each activation row, copies of its best weight row tie with it (the first index wins), and
    copies with one code moved up and another down, at two columns of one block whose activation codes
    are equal but whose rounding errors are not, have the same 8-bit product as the best row: only the
    recomputed rows can order them, and they must order them as the full product does."""
    packed = _packed(2000, 640, 32, seed=7)
    x = _activations(4, 640, seed=3)
    codes, scales = packed.codes(), packed._row_scales().clone()
    q_codes, _, residuals = ops.load("int8_dot").quantize_activations(x)
    best_rows = _full_best(packed, x)[:, 1].long().tolist()
    for m, source in enumerate(best_rows):
        c1, c2 = next(
            (a, b)
            for a in range(640)
            for b in range(a + 1, a - a % 32 + 32)
            if q_codes[m, a] == q_codes[m, b] and residuals[m, a] != residuals[m, b]
            and abs(int(codes[source, a])) < 127 and abs(int(codes[source, b])) < 127
        )  # fmt: skip
        for target, moved in ((100 + 9 * m, (c1, c2)), (1500 + m, None), (3 + m, None), (800 + m, (c2, c1))):
            row = codes[source].clone()
            if moved is not None:
                row[moved[0]] += 1
                row[moved[1]] -= 1
            codes[target], scales[target] = row, scales[source]
    nudged = PackedInt8(Int8Groups(codes, scales))
    best, decided = nudged.greedy(x)
    approx = ops.load("int8_dot").int8_linear(x, nudged.tiles, nudged.scales, 32, 2000, False)  # the 8-bit product
    assert bool(decided.all())
    assert torch.equal(best, _full_best(nudged, x))
    for m, source in enumerate(best_rows):  # the premise: one 8-bit value for all five rows
        assert len(set(approx[m, [source, 100 + 9 * m, 1500 + m, 3 + m, 800 + m]].tolist())) == 1
    assert best[:, 1].long().tolist() != best_rows  # and the residuals moved the pick to a nudged copy


def test_rows_it_cannot_bound_are_left_to_the_full_product():
    """A row with a NaN or an infinity among its activations, and a head whose rows are all one row (every
    tile near the top), come back undecided; the LM head then gives what the full product gives."""
    same = _packed(1, 128, 32, seed=1)
    flat = PackedInt8(Int8Groups(same.codes().repeat(4096, 1), same._row_scales().repeat(4096, 1)))
    x = _activations(4, 128, seed=2)
    x[1, 7] = math.nan
    x[2, 9] = math.inf
    best, decided = flat.greedy(x)
    assert decided.tolist() == [False, False, False, False]  # rows 0 and 3: all 4,096 rows tie at the top

    head = LMHead(4096, 128)
    head.own.int8 = flat
    picked = head.greedy_best(x)
    torch.testing.assert_close(picked, local_best(flat.linear(x).float(), 0), rtol=0, atol=0, equal_nan=True)
    assert picked[[0, 3], 1].tolist() == [0.0, 0.0]  # the first of the tied rows


def test_a_head_whose_values_climb_tile_after_tile():
    """Rows whose logits rise with their index keep every tile a candidate as it is met (each raises the
    floor, and is above it), so a thread's list passes the size at which it drops those under the floors;
    what is left must still hold the maximum."""
    rows, cols = 70000, 128
    code = torch.randint(-100, 101, (1, cols), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    scales = (1e-4 * (1 + torch.arange(rows, dtype=torch.float64) / rows)).float().unsqueeze(1).repeat(1, cols // 32)
    climbing = PackedInt8(Int8Groups(code.repeat(rows, 1), scales))
    x = code.float().repeat(8, 1) + torch.randn(8, cols, generator=torch.Generator().manual_seed(6))
    best, decided = climbing.greedy(x)
    assert bool(decided.all())
    assert torch.equal(best, _full_best(climbing, x))


def _six_bit(packed: PackedInt8) -> PackedInt8:
    packed.prepare_greedy()
    assert packed._six_bit is not None
    return packed


@pytest.mark.parametrize(
    "rows, cols, group, float16_scales",
    [(1000, 640, 32, True), (515, 256, 128, True), (40000, 64, 64, False), (4099, 576, 32, False)],
)
@pytest.mark.parametrize("batch", [1, 2, 3, 64])
def test_the_six_bit_first_pass_picks_what_the_full_product_picks(rows, cols, group, float16_scales, batch):
    """With the codes' six high bits as the first pass (from one activation row on), every row is still
    the full product's pick, value and token; groups of 32, 64 and 128, float16 and float32 scales. As
    a model's final hidden state does, each activation row leans toward one weight row (its logit ~6
    standard deviations of the others up), so that the bound can leave a few tiles."""
    packed = _six_bit(_packed(rows, cols, group, seed=rows + batch, float16_scales=float16_scales))
    x = _activations(batch, cols, seed=batch)
    leaning = packed.dequantize()[torch.randint(0, rows, (batch,), generator=torch.Generator().manual_seed(9))]
    logits = packed.linear(x)
    x += leaning / leaning.norm(dim=1, keepdim=True) ** 2 * 6 * logits.std(dim=1, keepdim=True)
    best, decided = packed.greedy(x)
    assert bool(decided.all())
    assert torch.equal(best, _full_best(packed, x))


def test_the_six_bit_tiles_hold_the_codes_high_bits_and_their_error():
    """int8_six_bit_tiles' row norms against the codes: ||W~|| and ||W - W~|| with W~ = s (4h + 1.5 - 128),
    h = (code + 128) >> 2, each rounded up by 0.01%; the bound's norms then cover both W and W~."""
    packed = _packed(300, 128, 32, seed=21)
    codes, scales = packed.codes().long(), packed._row_scales().double()
    exact = (codes.view(300, 4, 32) * scales[:, :, None]).view(300, 128)
    approx = ((4 * ((codes + 128) >> 2) + 1.5 - 128).view(300, 4, 32) * scales[:, :, None]).view(300, 128)
    six, approx_norms, residual_norms = ops.load("int8_dot").int8_six_bit_tiles(packed.tiles, packed.scales, 32, 300)
    assert six.numel() == packed.tiles.numel() * 3 // 4
    torch.testing.assert_close(approx_norms.double(), approx.norm(dim=1) * (1 + 1e-4), rtol=1e-6, atol=0)
    torch.testing.assert_close(residual_norms.double(), (exact - approx).norm(dim=1) * (1 + 1e-4), rtol=1e-6, atol=0)
    packed.prepare_greedy()
    assert packed._six_bit is not None and torch.equal(packed._six_bit, six)
    norms = packed.row_norms(ops.load("int8_dot")).double()
    assert bool((norms >= torch.maximum(approx.norm(dim=1), exact.norm(dim=1))).all())
    # Resident: both codes; a greedy step reads the copy, a sampled one the 8-bit tiles (MBU's counts).
    assert packed.nbytes == packed.tiles.nbytes + six.nbytes + packed.scales.nbytes
    assert packed.step_nbytes(greedy=True) == six.nbytes + packed.scales.nbytes
    assert packed.step_nbytes(greedy=False) == packed.tiles.nbytes + packed.scales.nbytes


def test_codes_of_few_bits_keep_the_8_bit_first_pass():
    """Codes that use 5 of the 8 bits (Q5_0 held as 8-bit, |code| <= 16) keep 3 bits in the top six: too
    coarse for the bound, so no six-bit tiles are made, and one activation row takes the full product."""
    generator = torch.Generator().manual_seed(8)
    codes = torch.randint(-16, 16, (500, 128), dtype=torch.int8, generator=generator)
    packed = PackedInt8(Int8Groups(codes, torch.rand(500, 4, generator=generator).half().float() + 0.1))
    packed.prepare_greedy()
    assert packed._six_bit is None
    assert packed.step_nbytes(greedy=True) == packed.nbytes == packed.tiles.nbytes + packed.scales.nbytes
    assert packed.greedy(_activations(1, 128, seed=2)) is None
    best, decided = packed.greedy(_activations(4, 128, seed=2))
    assert bool(decided.all()) and torch.equal(best, _full_best(packed, _activations(4, 128, seed=2)))


def test_one_row_and_8_bit_activations_take_the_full_product():
    packed = _packed(300, 64, 32, seed=4)
    assert packed.greedy(_activations(1, 64, seed=1)) is None
    packed.exact_activations = False  # --activation-bits 8: the 8-bit product is the full product
    assert packed.greedy(_activations(3, 64, seed=1)) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_files_head_picks_what_its_full_product_picks(gemma3_gguf, dtype):
    """The real Gemma 3 file's 262,144-row Q8_0 head (tied to its embedding), on the final hidden states
    of a batch of greedy requests: every step's pick is the full product's, value and token, and the
    bound decides nearly every row, batched or one at a time."""
    llm = LLM(gemma3_gguf, dtype=dtype, kv_cache_memory="32MiB")
    seen: list[torch.Tensor] = []
    pick = LMHead.greedy_best

    def recording(head: LMHead, hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.clone())
        return pick(head, hidden)

    prompts = [f"Chapter {i}. The old lighthouse keeper" for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    try:
        LMHead.greedy_best = recording
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        LMHead.greedy_best = pick
    head = llm.engine.runner.model.lm_head
    packed = head.source.int8
    assert isinstance(packed, PackedInt8) and packed.shape[0] == 262144
    assert len(seen) >= 6 and all(h.shape[0] == 6 for h in seen)
    assert packed._six_bit is not None  # a Q8_0 head: the first pass reads its six-bit tiles
    # What a step reads of the tied head (MBU's count): the copy when greedy, the 8-bit tiles when not.
    assert llm.loaded.step_weight_bytes(greedy=True) == llm.loaded.weight_bytes - packed.tiles.nbytes
    assert llm.loaded.step_weight_bytes(greedy=False) == llm.loaded.weight_bytes - packed._six_bit.nbytes
    undecided = 0
    for hidden in seen:
        best, decided = packed.greedy(hidden)
        full = local_best(head.transient_logits(hidden), 0)
        assert torch.equal(best[decided], full[decided])
        assert torch.equal(head.greedy_best(hidden), full)  # the rows left open: by the full product
        undecided += int((~decided).sum())
        for row in hidden.split(1):  # one request's step
            best, decided = packed.greedy(row)
            assert not bool(decided) or torch.equal(best, local_best(head.transient_logits(row), 0))
    # Six-bit codes widen the bound: a row whose top logits lie close (0.12 apart here, logits' standard
    # deviation ~4.6) can keep more tiles than the second pass takes, and goes to the full product.
    assert undecided <= len(seen) * 6 // 10
