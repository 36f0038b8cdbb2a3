"""Structured-output constraints, token masks and the sampler's use of them, on SmolLM2's tokenizer
(no model): the masks must allow exactly the tokens that keep the text inside the language."""

from __future__ import annotations

import re

import pytest
import torch

from folio.engine.structured_output import StructuredOutputManager
from folio.loaders.gguf_file import GGUFFile
from folio.loaders.tokenizer import Tokenizer
from folio.sample.sampler import SamplingBatch, sample
from folio.sampling_params import SamplingParams
from folio.structured.grammar import GrammarCompiler, MaskTiming, allowed_tokens, unpack_bitmask
from folio.structured.params import StructuredOutputParams


@pytest.fixture(scope="module")
def compiler(smollm2_gguf) -> GrammarCompiler:
    tokenizer = Tokenizer.from_gguf(GGUFFile(smollm2_gguf))
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


@pytest.mark.parametrize(
    "fields",
    [{}, {"regex": "a", "choice": ["a"]}, {"regex": "("}, {"choice": []}, {"choice": ["", "x"]},
     {"json": "{not json"}, {"json": {"type": "wat"}}, {"grammar": "start: nothing_defined"}],
)  # fmt: skip
def test_invalid_constraints_raise_value_error(fields):
    with pytest.raises(ValueError):
        StructuredOutputParams(**fields)


def test_beam_search_refuses_structured_output():
    with pytest.raises(ValueError, match="structured output"):
        SamplingParams(use_beam_search=True, structured_output=StructuredOutputParams(regex="a+"))


def test_first_mask_of_a_choice_allows_exactly_the_prefixes(compiler):
    choices = ['say "hi"', "back\\slash", "plain"]  # quotes and backslashes must survive the Lark literal
    grammar = compiler.compile(StructuredOutputParams(choice=choices))
    [allowed] = allowed_tokens([grammar], compiler.vocab_size)
    decode = compiler.tokenizer.backend.decode
    texts = {t: decode([t], skip_special_tokens=False) for t in range(compiler.vocab_size)}
    expected = {t for t, text in texts.items() if text and any(c.startswith(text) for c in choices)}
    assert set(allowed.nonzero().flatten().tolist()) == expected


def test_masks_follow_each_row_and_leave_free_rows_alone(compiler):
    digits = compiler.compile(StructuredOutputParams(regex="[0-9]{2}"))
    word = compiler.compile(StructuredOutputParams(regex="[a-z]+"))
    timing = MaskTiming()
    allowed = allowed_tokens([digits, None, word], compiler.vocab_size, timing)
    decode = compiler.tokenizer.backend.decode
    assert allowed[1].all()
    for row, pattern in ((0, r"[0-9]{1,2}"), (2, r"[a-z]+")):
        ids = allowed[row].nonzero().flatten().tolist()
        assert ids and all(re.fullmatch(pattern, decode([t])) for t in ids)
    assert timing.num_masks == 2 and timing.num_steps == 1 and timing.seconds > 0
    assert allowed_tokens([None, None], compiler.vocab_size) is None


def test_a_grammar_advances_and_finishes(compiler):
    grammar = compiler.compile(StructuredOutputParams(regex="[0-9]+"))
    [one] = compiler.tokenizer.encode("1", add_special_tokens=False)
    assert grammar.accept(one) and not grammar.is_finished
    [allowed] = allowed_tokens([grammar], compiler.vocab_size)
    [eos] = compiler.tokenizer.eos_token_ids
    assert allowed[eos] and allowed[one]  # more digits, or the end
    assert grammar.accept(eos) and grammar.is_finished
    # A language that cannot go on ends without waiting for an EOS.
    choice = compiler.compile(StructuredOutputParams(choice=["yes", "no"]))
    [yes] = compiler.tokenizer.encode("yes", add_special_tokens=False)
    assert choice.accept(yes) and choice.is_finished


def test_sampler_never_picks_a_masked_token_whatever_the_bias(compiler):
    vocab = compiler.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[:, 100:110] = True
    favourite = int(logits[0].argmax())  # outside 100..110 almost surely; bias pushes it further
    params = [SamplingParams(temperature=0, logit_bias={favourite: 100.0}), SamplingParams(temperature=1.5),
              SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3)]  # fmt: skip
    generators = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    batch = SamplingBatch.from_params(params, generators, [[5]] * 3, [[favourite]] * 3, vocab, allowed=allowed)
    tokens = sample(logits, batch).token_ids.tolist()
    assert all(100 <= t < 110 for t in tokens)
    assert tokens[0] == 100 + int(logits[0, 100:110].argmax())  # greedy: the best allowed token


def test_drafts_are_cut_where_the_grammar_refuses_them_and_masked_row_by_row(compiler):
    """Speculation under structured output: the drafts kept are the prefix the grammar accepts, the
    verification rows get the masks after each draft in turn, and the grammar's state is unchanged."""
    grammar = compiler.compile(StructuredOutputParams(regex="[0-9]{1,3}"))
    encode = compiler.tokenizer.encode
    digits = [encode(d, add_special_tokens=False)[0] for d in "123"]
    [letter] = encode("x", add_special_tokens=False)
    assert grammar.valid_prefix([*digits[:2], letter, digits[2]]) == 2
    assert grammar.valid_prefix(digits) == 3 and grammar.valid_prefix([]) == 0
    manager = StructuredOutputManager(compiler.vocab_size)
    bitmask = manager.bitmask([("a", grammar, digits[:2])])
    assert bitmask.request_ids == ("a", "a", "a")
    masks = allowed_tokens([grammar], compiler.vocab_size)  # unchanged state: what may start the output
    rows = unpack_bitmask(bitmask.bits, compiler.vocab_size)
    assert torch.equal(rows[0], masks[0])
    [eos] = compiler.tokenizer.eos_token_ids
    assert not rows[0][eos] and rows[1][eos] and rows[2][eos]  # an empty number is not a number
    assert rows[2][digits[2]] and not rows[2][letter]
    assert grammar.accept(digits[0]) and grammar.accept(digits[1]) and grammar.accept(digits[2])
    assert grammar.valid_prefix([digits[0]]) == 0  # three digits: nothing more but the end
