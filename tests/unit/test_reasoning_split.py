"""Thinking split from the answer: whole and streamed (cut anywhere) agree, for answers that open their
own <think> and for prompts that already opened it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.reasoning import ReasoningStream, prompt_opens_thinking, reasoning_enabled, split_reasoning


def test_whole_answers_split() -> None:
    assert split_reasoning("<think>2+2 is 4</think>\n\nFour.", False).__dict__ == {"reasoning": "2+2 is 4",
                                                                                  "content": "Four."}  # fmt: skip
    assert split_reasoning("Four.", False).__dict__ == {"reasoning": None, "content": "Four."}
    assert split_reasoning("2+2 is 4</think>Four.", True).__dict__ == {"reasoning": "2+2 is 4", "content": "Four."}
    # Cut by max_tokens while thinking: all of it is reasoning.
    assert split_reasoning("<think>still going", False).__dict__ == {"reasoning": "still going", "content": None}
    assert split_reasoning("<think>done</think>", False).__dict__ == {"reasoning": "done", "content": None}


def test_auto_follows_the_template() -> None:
    assert reasoning_enabled("auto", "{% if enable_thinking %}<think>{% endif %}")
    assert not reasoning_enabled("auto", "<|im_start|>{{ message.content }}")
    assert not reasoning_enabled("none", "<think>")
    assert reasoning_enabled("think", None)
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")


ANSWERS = ["<think>Let me see: 2 < 3.</think>\n\nYes, 2 < 3.", "  Plain answer </think> not thinking",
           "<think>unfinished <", "<thin", "", "\n\n", "<think></think>"]  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(
    text=st.sampled_from(ANSWERS),
    inside=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=10),
)
def test_a_stream_cut_anywhere_splits_as_the_whole_answer(text: str, inside: bool, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream = ReasoningStream(inside)
    thinking, content = "", ""
    for a, b in zip(points, points[1:], strict=False):
        r, c = stream.feed(text[a:b])
        thinking, content = thinking + r, content + c
    r, c = stream.finish()
    thinking, content = thinking + r, content + c
    whole = split_reasoning(text, inside)
    assert thinking == (whole.reasoning or "")
    assert content == (whole.content or "")
