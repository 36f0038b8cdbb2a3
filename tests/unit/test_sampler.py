from __future__ import annotations

import math

import pytest
import torch

from folio.sample import race, top_k_top_p
from folio.sample.race import exponential_rows
from folio.sample.sampler import SamplingBatch, apply_top_k_top_p_min_p, row_problems
from folio.sample.sampler import sample_tokens as sample
from folio.sampling_params import SamplingParams


def _batch(params: list[SamplingParams], seeds: list[int | None] | None = None) -> SamplingBatch:
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * len(params))]
    return SamplingBatch.from_params(params, generators)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    tokens = sample(logits, _batch([SamplingParams(temperature=0)] * 5))
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_1_top_p_tiny_and_min_p_1_are_greedy():
    logits = torch.randn(3, 50)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)]
    for _ in range(5):
        assert torch.equal(sample(logits, _batch(params)), logits.argmax(-1))


def test_filters_keep_exactly_the_expected_sets():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(apply_top_k_top_p_min_p(logits, _batch([p])))[0].tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.8)) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(SamplingParams(top_p=0.81)) == [True, True, True, False]
    assert kept(SamplingParams(min_p=0.2)) == [True, True, True, False]  # 0.05 < 0.2 * 0.5


def test_seeded_rows_do_not_depend_on_their_batch():
    logits = torch.randn(4, 100)
    alone = sample(logits[2:3], _batch([SamplingParams(seed=7)], [7]))
    together = sample(logits, _batch([SamplingParams()] * 2 + [SamplingParams(seed=7)] * 2, [None, None, 7, 3]))
    assert together[2] == alone[0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().repeat(20000, 1)
    params = [SamplingParams(temperature=1.0)] * 20000
    tokens = sample(logits, _batch(params, list(range(20000))))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_temperature_sharpens():
    logits = torch.tensor([[0.0, 1.0]]).repeat(5000, 1)
    cold = sample(logits, _batch([SamplingParams(temperature=0.25)] * 5000, list(range(5000))))
    hot = sample(logits, _batch([SamplingParams(temperature=4.0)] * 5000, list(range(5000))))
    assert cold.float().mean() > 0.95 and 0.5 < hot.float().mean() < 0.65


def test_logit_bias_is_added_before_sampling_but_not_to_logprobs():
    from folio.sample.sampler import sample as sample_with_logprobs

    logits = torch.randn(3, 20)
    best = logits.argmax(-1)
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=1),
        SamplingParams(temperature=0, logit_bias={int(best[1]): -100.0}),
        SamplingParams(temperature=0),
    ]
    out = sample_with_logprobs(logits, _batch(params))
    assert out.token_ids[0] == 7 and out.token_ids[1] != best[1] and out.token_ids[2] == best[2]
    assert out.logprobs[0].logprob == torch.log_softmax(logits[0], -1)[7].item()


def test_row_problems_are_exact_where_a_row_sum_overflows_or_cancels():
    """The one-reduction screen flags rows whose sum or max is not finite; the exact test then decides."""
    big = torch.full((1, 4), 3e38)  # finite terms whose sum overflows: not a problem
    mixed = torch.tensor([[math.inf, -math.inf, 0.0, 1.0]])  # the sum is NaN: a problem
    plus_inf_only = torch.tensor([[math.inf, 0.0, 0.0, 0.0]])
    clean = torch.randn(1, 4)
    logits = torch.cat([big, mixed, plus_inf_only, clean])
    assert row_problems(logits, logits) == [None, "the model's logits were not finite",
                                            "the model's logits were not finite", None]  # fmt: skip
    adjusted = logits.clone()
    adjusted[0, :3] = -math.inf  # one finite logit left, whose max is +3e38: allowed
    adjusted[3] = -math.inf
    assert row_problems(logits, adjusted)[0] is None
    assert row_problems(logits, adjusted)[3] == "no token was allowed"
    with_inf_max = torch.tensor([[math.inf, -math.inf, -math.inf, -math.inf]])
    assert row_problems(torch.zeros(1, 4), with_inf_max) == ["no token was allowed"]  # no finite logit left


def test_exponential_noise_is_exp_1_positive_and_per_generator():
    rows = exponential_rows(200_000, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    assert rows.dtype == torch.float32 and bool((rows > 0).all())
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e
    assert abs(rows.mean().item() - 1) < 0.01 and abs(rows.var().item() - 1) < 0.02
    assert abs((rows > 1).float().mean().item() - math.exp(-1)) < 0.005
    again = exponential_rows(200_000, [torch.Generator().manual_seed(2)])
    assert torch.equal(again[0], rows[1])  # a row's noise is its generator's alone


def test_a_token_of_probability_zero_is_never_drawn():
    logits = torch.tensor([[0.0, float("-inf"), 0.0]]).repeat(4000, 1)
    tokens = sample(logits, _batch([SamplingParams(temperature=1.0)] * 4000, list(range(4000))))
    assert not bool((tokens == 1).any()) and set(tokens.tolist()) == {0, 2}


@pytest.mark.parametrize("prefix", [1024, 1])  # 1: the nucleus is wider than the prefix (a masked whole-row race)
def test_filtered_rows_draw_from_their_kept_set_in_proportion(monkeypatch, prefix):
    """Rows that filter race among their kept tokens only; the draws follow the renormalised set."""
    monkeypatch.setattr(top_k_top_p, "NUCLEUS_PREFIX", prefix)
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log().repeat(20000, 1)
    tokens = sample(logits, _batch([SamplingParams(top_k=3)] * 20000, list(range(20000))))
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85
    freq = torch.bincount(tokens, minlength=5).float() / 20000
    assert torch.allclose(freq, expected, atol=0.015)
    nucleus = sample(logits, _batch([SamplingParams(top_p=0.65)] * 20000, list(range(20000))))
    assert set(torch.unique(nucleus).tolist()) == {1, 3}  # 0.15 has 0.7 >= 0.65 before it


def test_seeded_filtered_rows_do_not_depend_on_their_batch():
    logits = torch.randn(5, 300) * 3
    params = [
        SamplingParams(seed=5, top_k=40),
        SamplingParams(seed=6, top_p=0.9),
        SamplingParams(seed=7),
        SamplingParams(temperature=0, top_k=2),
        SamplingParams(seed=8, top_k=250, top_p=0.99),
    ]
    seeds = [5, 6, 7, None, 8]
    together = sample(logits, _batch(params, seeds))
    for row, (p, seed) in enumerate(zip(params, seeds, strict=True)):
        alone = sample(logits[row : row + 1], _batch([p], [seed]))
        assert together[row] == alone[0]
    assert together[3] == logits[3].argmax()


def test_whole_rows_draw_from_head_and_tail_in_proportion(monkeypatch):
    """A row that keeps every token picks its head or its tail by their mass, then races within it."""
    monkeypatch.setattr(race, "HEAD", 2)
    probs = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.2])  # head: tokens 1 and 3 (0.65); tail: 0.35
    logits = probs.log().repeat(20000, 1)
    tokens = sample(logits, _batch([SamplingParams(temperature=1.0)] * 20000, list(range(20000))))
    freq = torch.bincount(tokens, minlength=5).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)
    masked = logits.clone()
    masked[:, [0, 2, 4]] = float("-inf")  # nothing left past the head
    tokens = sample(masked[:2000], _batch([SamplingParams(temperature=1.0)] * 2000, list(range(2000))))
    assert set(torch.unique(tokens).tolist()) == {1, 3}
