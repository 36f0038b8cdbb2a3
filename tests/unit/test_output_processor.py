"""IncrementalDetokenizer on the real SmolLM2 tokenizer (byte-level BPE): streamed text equals a
one-shot decode, and stop strings cut the text exactly where a reference built from plain decodes does."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from folio.engine.output_processor import IncrementalDetokenizer
from folio.loaders.gguf_file import GGUFFile
from folio.loaders.tokenizer import Tokenizer

FAST = settings(max_examples=40, deadline=None)

# Characters that make tokens of every shape: words, spaces, newlines, punctuation runs, and multi-byte
# characters that byte-level BPE splits over several tokens.
ALPHABET = list("abcdeSTOP xyz,.!#\n\t0123") + ["é", "日本", "😀", "👍🏽", "  ", " ##", "the ", "ing "]
texts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=30).map("".join)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_gguf))


def _run(tokenizer, ids, groups=None, **kwargs) -> tuple[IncrementalDetokenizer, list[str], int]:
    """Feed `ids` in groups of the given sizes (one at a time by default); return the detokenizer, the
    emitted deltas (the last from the finishing call) and the largest amount of text ever held back."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, held, start = [], 0, 0
    for size in groups or [1] * len(ids):
        deltas.append(detok.add(ids[start : start + size]))
        start += size
        held = max(held, len(detok.text) - len("".join(deltas)))
    deltas.append(detok.add(ids[start:], finished=True))
    return detok, deltas, held


def _reference(tokenizer, ids, stops, include) -> tuple[str, int, bool]:
    """Generation ends at the first token after which the decoded text contains a stop string; the text is
    cut at the earliest such string (list order breaks ties), before it or, with `include`, after it.
    Text is visible once its characters are complete: a token holding ' ' plus the first byte of a
    three-byte character shows neither until the character's last byte arrives, or the text ends (then
    the ' ' shows)."""
    text = ""
    for n in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:n])
        text = decoded.rstrip("\ufffd") if n == len(ids) else text if decoded.endswith("\ufffd") else decoded
        hits = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        if hits:
            at, _, stop = min(hits)
            return text[: at + len(stop) if include else at], n, True
    return tokenizer.decode(ids), len(ids), False


def _assert_decodes_alike(streamed: str, decoded: str) -> None:
    """Equal, except that tokenizer.decode renders bytes that never complete a character at the very end
    as U+FFFD, while the streaming decoder (still waiting for the rest) leaves them out."""
    assert decoded.startswith(streamed) and set(decoded[len(streamed) :]) <= {"\ufffd"}, (streamed, decoded)
    if not decoded.endswith("\ufffd"):
        assert streamed == decoded


# -- no stop strings -------------------------------------------------------------------------------


@FAST
@given(text=st.one_of(texts, st.text(max_size=40)), data=st.data())
def test_deltas_join_to_the_decoded_text_in_any_grouping(tokenizer, text, data):
    ids = tokenizer.encode(text)
    assume(ids)
    expected = tokenizer.decode(ids)
    detok, deltas, held = _run(tokenizer, ids)
    assert "".join(deltas) == detok.text
    _assert_decodes_alike(detok.text, expected)
    assert held == 0  # nothing is held back without stop strings
    assert not detok.stopped and detok.num_tokens == len(ids)
    sizes = data.draw(st.lists(st.integers(0, 5), max_size=len(ids)))
    _, grouped, _ = _run(tokenizer, ids, groups=sizes)
    assert "".join(grouped) == detok.text


def test_random_ids_decode_like_decode_but_an_unfinished_last_character_is_dropped(tokenizer):
    """Arbitrary ids hit lone byte pieces and characters cut off at the end (see _assert_decodes_alike)."""
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 20))]
        detok, deltas, _ = _run(tokenizer, ids)
        assert "".join(deltas) == detok.text
        _assert_decodes_alike(detok.text, tokenizer.decode(ids))


@pytest.mark.parametrize("text", [" 日", "\x83日", "a 😀"])
def test_a_text_cut_inside_a_character_keeps_the_complete_ones_before_it(tokenizer, text):
    """Tokens that end inside a character (' ' with the first bytes of '日') are held back whole while
    more may come; when the request finishes there, its complete characters are released."""
    ids = tokenizer.encode(text)[:-1]
    complete = tokenizer.decode(ids).rstrip("\ufffd")
    assert complete and tokenizer.decode(ids).endswith("\ufffd")
    for groups in (None, [len(ids)]):
        detok, deltas, _ = _run(tokenizer, ids, groups=groups)
        assert detok.text == "".join(deltas) == complete


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    detok, deltas, _ = _run(tokenizer, ids)
    assert "".join(deltas) == "user\nhi" == tokenizer.decode(ids)


# -- stop strings ----------------------------------------------------------------------------------


def test_a_stop_string_spanning_tokens_cuts_at_its_first_occurrence(tokenizer):
    text = "Hello world, this is a test. STOP here ### end. STOP again"
    ids = tokenizer.encode(text)
    stop = "STOP here"  # ' ST' + 'OP' + ' here': three tokens
    assert len(tokenizer.encode(" " + stop)) == 3
    for include, expected in [
        (False, "Hello world, this is a test. "),
        (True, "Hello world, this is a test. STOP here"),
    ]:
        detok, deltas, held = _run(tokenizer, ids, stop=[stop], include_stop_str_in_output=include)
        assert detok.stopped
        assert detok.text == "".join(deltas) == expected
        assert 0 < held <= len(stop) - 1
        assert detok.num_tokens == ids.index(tokenizer.encode(" here")[0]) + 1  # nothing after the stop


def test_the_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("one two three four five")
    for stops in (["four", "two"], ["two", "four"], ["wo th", "three four"]):
        detok, deltas, _ = _run(tokenizer, ids, stop=stops)
        assert detok.text == "".join(deltas) == ("one t" if stops[0] == "wo th" else "one ")
    # Two stops completed by the same token: the one that starts earlier wins, with or without itself.
    detok, _, _ = _run(tokenizer, ids, stop=["ree", "two three"], include_stop_str_in_output=True)
    assert detok.text == "one two three"


def test_tokens_after_the_stop_are_not_consumed(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta epsilon")
    detok = IncrementalDetokenizer(tokenizer, stop=["gamma"])
    first = detok.add(ids)  # everything at once, as after a multi-token step
    assert detok.stopped and first == detok.text == "alpha beta "
    consumed = detok.num_tokens
    assert tokenizer.decode(ids[:consumed]).endswith("gamma") and consumed < len(ids)
    assert detok.add(ids[consumed:]) == "" and detok.add([], finished=True) == ""
    assert detok.num_tokens == consumed and detok.text == "alpha beta "


def test_text_is_held_back_only_while_it_could_start_a_stop_string(tokenizer):
    ids = tokenizer.encode("abc ## def ### ghi")
    detok = IncrementalDetokenizer(tokenizer, stop=["###", "x"])
    emitted = ""
    for token in ids:
        emitted += detok.add([token])
        if detok.stopped:
            break
        assert len(detok.text) - len(emitted) <= 2  # len("###") - 1
        assert detok.text.startswith(emitted)
    assert emitted == detok.text == "abc ## def "


def test_a_stop_string_never_seen_changes_nothing_but_holds_until_the_end(tokenizer):
    ids = tokenizer.encode("a quiet sentence with no end marker")
    detok, deltas, held = _run(tokenizer, ids, stop=["<<END>>"])
    assert not detok.stopped and detok.num_tokens == len(ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)
    assert held == len("<<END>>") - 1 and len(deltas[-1]) >= held  # the finishing call flushes the tail


@FAST
@given(text=texts, data=st.data(), include=st.booleans())
def test_stop_strings_match_the_reference_in_any_grouping(tokenizer, text, data, include):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    assume(len(full) >= 2)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        start = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[start : start + data.draw(st.integers(1, 8))])
    if data.draw(st.booleans()):
        stops.append("@never@")
    expected_text, expected_tokens, expected_stopped = _reference(tokenizer, ids, stops, include)
    sizes = data.draw(st.one_of(st.none(), st.lists(st.integers(1, 4), max_size=len(ids))))
    detok, deltas, held = _run(tokenizer, ids, groups=sizes, stop=stops, include_stop_str_in_output=include)
    assert detok.stopped == expected_stopped
    assert detok.text == expected_text
    assert "".join(deltas) == expected_text  # nothing emitted was later taken back
    assert held <= max(len(s) for s in stops) - 1
    assert detok.num_tokens == expected_tokens  # whatever the grouping, nothing after the stop is consumed
