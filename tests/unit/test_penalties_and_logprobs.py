"""Penalties (transformers' repetition penalty, OpenAI presence/frequency) and the logprobs the sampler
returns, checked against transformers and hand-written formulas on random logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.sample.logprobs import gather_logprobs
from folio.sample.penalties import PenaltyBatch
from folio.sample.sampler import SamplingBatch, sample
from folio.sampling_params import MAX_LOGPROBS, SamplingParams

transformers = pytest.importorskip("transformers")

FAST = settings(max_examples=40, deadline=None)

token_lists = st.lists(st.integers(0, 39), max_size=25)
row = st.tuples(
    token_lists,  # prompt
    token_lists,  # output
    st.sampled_from([1.0, 1.0, 0.5, 0.9, 1.3, 2.0]),  # repetition
    st.sampled_from([0.0, -2.0, -0.7, 0.5, 2.0]),  # presence
    st.sampled_from([0.0, -1.5, 0.3, 1.0, 2.0]),  # frequency
)


def _logits(seed: int, rows: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[:, 0] = 0.0  # a logit of exactly zero: neither divided nor multiplied in a visible way
    return logits


def _batch(params: list[SamplingParams], prompts=None, outputs=None, vocab: int = 40, seeds=None) -> SamplingBatch:
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * len(params))]
    return SamplingBatch.from_params(params, generators, prompts, outputs, vocab)


# -- repetition penalty ----------------------------------------------------------------------------


@FAST
@given(rows=st.lists(row, min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1))
def test_repetition_penalty_equals_transformers(rows, seed):
    vocab = 40
    logits = _logits(seed, len(rows), vocab)
    params = [SamplingParams(repetition_penalty=rep) for _, _, rep, _, _ in rows]
    got = PenaltyBatch.build(params, [r[0] for r in rows], [r[1] for r in rows], vocab).apply(logits.clone())
    for i, (prompt, output, rep, _, _) in enumerate(rows):
        processor = transformers.RepetitionPenaltyLogitsProcessor(float(rep))
        ids = torch.tensor([prompt + output], dtype=torch.long)
        expected = processor(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], expected)
        if rep == 1.0:
            assert torch.equal(got[i], logits[i])  # untouched, bit for bit
        untouched = [t for t in range(vocab) if t not in prompt and t not in output]
        assert torch.equal(got[i, untouched], logits[i, untouched])


# -- presence and frequency penalties --------------------------------------------------------------


def _expected(logits_row: torch.Tensor, prompt, output, rep: float, presence: float, frequency: float):
    """The formula written out token by token: repetition (prompt + output), then OpenAI's
    `logit -= frequency * count + presence * (count > 0)` with counts over the output only."""
    out = logits_row.clone()
    for token in range(out.shape[0]):
        value = float(out[token])
        if token in prompt or token in output:
            value = value / rep if value > 0 else value * rep
        count = output.count(token)
        value -= frequency * count + presence * (1.0 if count else 0.0)
        out[token] = value
    return out


@FAST
@given(rows=st.lists(row, min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1))
def test_all_penalties_equal_the_formula(rows, seed):
    vocab = 40
    logits = _logits(seed, len(rows), vocab)
    params = [SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f) for _, _, r, p, f in rows]
    got = PenaltyBatch.build(params, [r[0] for r in rows], [r[1] for r in rows], vocab).apply(logits.clone())
    for i, (prompt, output, rep, presence, frequency) in enumerate(rows):
        torch.testing.assert_close(got[i], _expected(logits[i], prompt, output, rep, presence, frequency))


def test_presence_and_frequency_count_repeats_and_ignore_the_prompt():
    logits = torch.zeros(2, 10)
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams(presence_penalty=0.75)]
    prompts = [[1, 1, 1, 2, 9], [1, 1, 1, 2, 9]]  # prompt-only tokens (1, 2, 9) are never penalised by these
    outputs = [[3, 3, 3, 4, 2], [3, 3, 3, 4, 2]]
    got = PenaltyBatch.build(params, prompts, outputs, 10).apply(logits)
    freq = [0.0, 0.0, -0.5, -1.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0]  # token 3 three times, 4 and 2 once
    pres = [0.0, 0.0, -0.75, -0.75, -0.75, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert got.tolist() == [freq, pres]


def test_rows_without_penalties_are_untouched_in_a_penalised_batch():
    logits = _logits(3, 3, 40)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5), SamplingParams()]
    prompts, outputs = [[1, 2, 3]] * 3, [[4, 4, 5]] * 3
    batch = _batch(params, prompts, outputs)
    assert batch.penalties is not None
    got = batch.penalties.apply(logits.clone())
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


def test_no_penalties_means_no_penalty_batch_and_no_ids_needed():
    batch = SamplingBatch.from_params([SamplingParams(temperature=0)], [None])
    assert batch.penalties is None
    with pytest.raises(ValueError, match="penalties need"):
        SamplingBatch.from_params([SamplingParams(presence_penalty=1.0)], [None])


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
def test_greedy_with_the_largest_penalty_never_repeats(name):
    vocab, steps = 64, 40
    generator = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0, **{name: 2.0})]
    prompt = list(range(vocab))  # a prompt holding every token changes nothing: these penalties ignore it
    output: list[int] = []
    for _ in range(steps):
        logits = torch.rand(1, vocab, generator=generator) * 1.9  # spread < 2: any repeat loses to any new token
        logits[0, 7] = 1.95  # a favourite that would win every step without the penalty
        token = int(sample(logits, _batch(params, [prompt], [output], vocab)).token_ids[0])
        output.append(token)
    assert len(set(output)) == steps, output
    assert output[0] == 7


def test_penalised_greedy_is_the_argmax_of_the_penalised_logits():
    logits = _logits(5, 4, 40)
    params = [SamplingParams(temperature=0, repetition_penalty=1.8, presence_penalty=0.4, frequency_penalty=0.6)] * 4
    prompts = [[int(logits[i].argmax()), 3] for i in range(4)]  # the raw favourite is in each prompt
    outputs = [[int(logits[i].argmax()), 5, 5] for i in range(4)]
    batch = _batch(params, prompts, outputs)
    expected = torch.stack([_expected(logits[i], prompts[i], outputs[i], 1.8, 0.4, 0.6) for i in range(4)]).argmax(-1)
    assert torch.equal(sample(logits, batch).token_ids, expected)


# -- logprobs --------------------------------------------------------------------------------------


def _check_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top, result) -> None:
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert len(result) == len(num_top)
    for i, k in enumerate(num_top):
        if k is None:
            assert result[i] is None
            continue
        lp = result[i]
        assert lp.token_id == int(tokens[i])
        assert lp.logprob == pytest.approx(float(reference[i, lp.token_id]), abs=1e-5)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        best = reference[i].topk(k)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert values == pytest.approx(best.values.tolist(), abs=1e-5)
        for token, value in lp.top:
            assert value == pytest.approx(float(reference[i, token]), abs=1e-5)


@FAST
@given(
    num_top=st.lists(st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)), min_size=1, max_size=6),
    vocab=st.integers(MAX_LOGPROBS, 80),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_logprobs_is_log_softmax_at_the_token_plus_the_top_k(num_top, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(num_top), vocab, generator=generator) * 4
    tokens = torch.randint(0, vocab, (len(num_top),), generator=generator)  # any token, not only the best
    result = gather_logprobs(logits, tokens, num_top)
    _check_logprobs(logits, tokens, num_top, result)


def test_logprobs_zero_gives_the_token_and_no_alternatives():
    logits = _logits(1, 2, 40)
    out = sample(logits, _batch([SamplingParams(temperature=0, logprobs=0)] * 2))
    for i in range(2):
        lp = out.logprobs[i]
        assert lp.top == [] and lp.token_id == int(logits[i].argmax())
        assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[i], -1).max()), abs=1e-6)


def test_rows_without_logprobs_get_none():
    logits = _logits(2, 3, 40)
    out = sample(logits, _batch([SamplingParams(temperature=0)] * 3))
    assert out.logprobs == [None, None, None]
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=20)]  # fmt: skip
    mixed = sample(logits, _batch(params))
    assert mixed.logprobs[1] is None
    assert len(mixed.logprobs[0].top) == 2 and len(mixed.logprobs[2].top) == 20


def test_logprobs_describe_the_raw_logits_whatever_the_sampler_does():
    """Temperature, top-k/p and penalties change which token is drawn, never the logprobs reported."""
    vocab = 40
    logits = _logits(4, 6, vocab)
    prompts = [[int(logits[i].argmax()), 1, 2] for i in range(6)]
    outputs = [[int(logits[i].argmax()), 3, 3] for i in range(6)]
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0, logprobs=5, repetition_penalty=2.0),  # the raw favourite is penalised
        SamplingParams(temperature=0, logprobs=5, presence_penalty=2.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.3, logprobs=5, seed=1),
        SamplingParams(temperature=5.0, logprobs=5, top_k=10, seed=2),
        SamplingParams(temperature=1.5, logprobs=5, top_p=0.5, min_p=0.05, repetition_penalty=0.7, seed=3),
    ]
    batch = _batch(params, prompts, outputs, vocab, seeds=[None, None, None, 1, 2, 3])
    out = sample(logits, batch)
    _check_logprobs(logits, out.token_ids, [5] * 6, out.logprobs)
    # Penalised greedy rows drew another token than the raw argmax, yet report the raw distribution.
    assert int(out.token_ids[1]) != int(logits[1].argmax())
    assert out.logprobs[1].top[0][0] == int(logits[1].argmax())
    # Same raw logits, wildly different settings: the same top list on every row that saw the same logits.
    same = logits[:1].repeat(6, 1)
    out_same = sample(same, _batch(params, prompts, outputs, vocab, seeds=[None, None, None, 1, 2, 3]))
    tops = [lp.top for lp in out_same.logprobs]
    assert all(top == tops[0] for top in tops)
