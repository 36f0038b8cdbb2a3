"""Workloads whose requests share prefixes, to measure a prefix cache: `document`, `tenants` and `multi-turn`.

`document`: many questions about one long document. The document is ShareGPT assistant answers (prose, mostly
ASCII) joined in a seeded order and cut to `document_len` tokens; each request is that document followed by a
distinct seeded question of 10-40 tokens made from the document's own words, sent as one text prompt. Every
request shares the whole document as its prefix.

`tenants`: several tenants, each with its own long system prompt: `tenants` documents made as `document`'s is,
each from the answers in its own seeded order, so they differ from their first answer (unless two orders happen
to start with the same one). Each request picks its tenant at random (seeded) and is that tenant's document
followed by a distinct question about it: it shares its whole document with its tenant's other requests and
nothing with other tenants', the workload of a router that sends each prefix to the replica already holding it.

`multi-turn`: ShareGPT conversations of at least `turns` user turns. Turn k of a conversation sends the first k
user messages with the dataset's own assistant answers in between (never the model's, so every server gets the
same workload), so each turn's prompt extends the previous turn's. The client sends turn k+1 only after turn k
has finished (see `serve_client.run_rate`).

`agent`: `multi-turn` conversations, each behind one long system prompt that all of them share (an agent's
instructions and tool descriptions: a `document` of `document_len` tokens). Each session's history grows turn by
turn; with more sessions than the KV pool holds, a server recomputes a history the pool evicted, unless it keeps
it elsewhere (folio's --kv-offload-ram and --kv-cache-dir, llama-server's --cache-ram).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from folio_tools.bench.harness.datasets import LengthRange, output_lens
from folio_tools.bench.serve.client import ServeRequest
from folio_tools.eval.sharegpt import ASSISTANT_ROLES, USER_ROLES, sharegpt_conversations, sharegpt_path

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]
QUESTION_TOKENS = LengthRange(10, 40)
_QUESTIONS = (
    "Question {n}: summarise the part of the text above about",
    "Question {n}: what does the text above say about",
    "Question {n}: explain how the text above connects",
    "Question {n}: list the points the text above makes on",
)
_WORD = re.compile(r"[^\W\d_]{4,}")  # words of four letters or more: what the questions ask about


def _mostly_ascii(text: str) -> bool:
    return bool(text.strip()) and sum(c.isascii() for c in text) >= 0.98 * len(text)


def make_document(answers: list[str], encode: Encode, decode: Decode, num_tokens: int, seed: int) -> str:
    """`answers` in a seeded order, joined by blank lines until they hold `num_tokens` tokens, cut there."""
    order = np.random.default_rng([seed, 4]).permutation(len(answers))
    ids: list[int] = []
    for i in order:
        ids += encode(answers[i].strip() + "\n\n")
        if len(ids) >= num_tokens:
            break
    if len(ids) < num_tokens:
        raise ValueError(f"the dataset holds only {len(ids)} tokens of text; lower --document-len")
    # A cut inside a multi-byte character decodes to U+FFFD: drop it, and the whitespace before the question.
    return decode(ids[:num_tokens]).rstrip("\ufffd").rstrip()


def make_questions(document: str, encode: Encode, num: int, seed: int) -> list[str]:
    """`num` distinct questions, each grown word by word from the document until it reaches a seeded length
    of QUESTION_TOKENS tokens (the fixed wording alone may already be longer)."""
    words = list(dict.fromkeys(_WORD.findall(document) or document.split() or ["it"]))  # each word once
    rng = np.random.default_rng([seed, 5])
    targets = rng.integers(QUESTION_TOKENS.low, QUESTION_TOKENS.high + 1, size=num)
    questions = []
    for n, target in enumerate(targets, start=1):
        question = "\n\n" + _QUESTIONS[int(rng.integers(len(_QUESTIONS)))].format(n=n)
        while len(encode(question + "?")) < target:
            question += " " + words[int(rng.integers(len(words)))]
        questions.append(question + "?")
    return questions


def document_requests(
    answers: list[str],
    encode: Encode,
    decode: Decode,
    count: Encode,
    num: int,
    document_len: int,
    output_range: LengthRange,
    seed: int,
) -> tuple[list[ServeRequest], int]:
    """The requests and the document's length in tokens. `encode` tokenizes a piece of text alone (no BOS);
    `count` tokenizes a whole prompt as the server will (with BOS), for each request's prompt_len."""
    document = make_document(answers, encode, decode, document_len, seed)
    questions = make_questions(document, encode, num, seed)
    requests = [
        ServeRequest(document + question, len(count(document + question)), output_len)
        for question, output_len in zip(questions, output_lens(num, output_range, seed), strict=True)
    ]
    return requests, len(encode(document))


def tenant_requests(
    answers: list[str],
    encode: Encode,
    decode: Decode,
    count: Encode,
    num: int,
    tenants: int,
    document_len: int,
    output_range: LengthRange,
    seed: int,
) -> tuple[list[ServeRequest], list[int]]:
    """The requests and each tenant's document length in tokens; `encode` and `count` as for document_requests.
    Tenant t's document and questions come from seed `seed * 1000 + t`: distinct within a run."""
    seeds = [seed * 1000 + t for t in range(tenants)]
    documents = [make_document(answers, encode, decode, document_len, s) for s in seeds]
    picks = [int(t) for t in np.random.default_rng([seed, 8]).integers(tenants, size=num)]
    questions = [make_questions(documents[t], encode, picks.count(t), seeds[t]) for t in range(tenants)]
    asked = [0] * tenants  # questions of each tenant used so far: each request gets the next one
    requests = []
    for t, output_len in zip(picks, output_lens(num, output_range, seed), strict=True):
        prompt = documents[t] + questions[t][asked[t]]
        asked[t] += 1
        requests.append(ServeRequest(prompt, len(count(prompt)), output_len))
    return requests, [len(encode(document)) for document in documents]


def sharegpt_answers(path: Path | None) -> list[str]:
    """The assistant answers of a ShareGPT file that are mostly ASCII text: the document's material."""
    return [
        str(turn["value"])
        for turns in sharegpt_conversations(path or sharegpt_path("document"))
        for turn in turns
        if turn.get("from") in ASSISTANT_ROLES and _mostly_ascii(str(turn.get("value", "")))
    ]


def sharegpt_dialogues(path: Path | None, turns: int) -> list[list[str]]:
    """The first `turns` user messages of each conversation that has them, with the assistant answers between
    them (2 * turns - 1 texts, user first); conversations that do not alternate that far are skipped."""
    dialogues = []
    for record in sharegpt_conversations(path or sharegpt_path("multi-turn")):
        head = record[: 2 * turns - 1]
        if len(head) == 2 * turns - 1 and all(
            turn.get("from") in (USER_ROLES if i % 2 == 0 else ASSISTANT_ROLES) and str(turn.get("value", "")).strip()
            for i, turn in enumerate(head)
        ):
            dialogues.append([str(turn["value"]) for turn in head])
    if not dialogues:
        raise ValueError(f"no conversation of the dataset has {turns} user turns; lower --turns")
    return dialogues


def _messages(texts: Iterable[str]) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(texts)]


def multi_turn_requests(
    dialogues: list[list[str]],
    encode: Encode,
    num: int,
    turns: int,
    input_range: LengthRange,
    output_range: LengthRange,
    seed: int,
) -> list[ServeRequest]:
    """`num` conversations of `turns` requests each, conversation by conversation and turn by turn. They are
    drawn in a seeded order among those whose last turn (the whole history) holds `input_range` tokens, counted
    as the messages' text without a chat template; cycled when too few fit."""
    chosen: list[tuple[list[str], list[int]]] = []
    for i in np.random.default_rng([seed, 6]).permutation(len(dialogues)):
        lengths = [len(encode(text)) for text in dialogues[i]]
        if input_range.low <= sum(lengths) <= input_range.high:
            chosen.append((dialogues[i], lengths))
            if len(chosen) == num:
                break
    if not chosen:
        raise ValueError(f"no {turns}-turn conversation is {input_range} tokens long; widen --input-len-range")
    outputs = output_lens(num * turns, output_range, seed)
    requests = []
    for c in range(num):
        texts, lengths = chosen[c % len(chosen)]
        for k in range(turns):
            shown = texts[: 2 * k + 1]  # k earlier user turns with their answers, then this turn's message
            prompt_len, output_len = sum(lengths[: 2 * k + 1]), outputs[c * turns + k]
            requests.append(ServeRequest(shown[-1], prompt_len, output_len, _messages(shown), conversation=c, turn=k))
    return requests


def agent_requests(
    answers: list[str],
    dialogues: list[list[str]],
    encode: Encode,
    decode: Decode,
    num: int,
    turns: int,
    document_len: int,
    input_range: LengthRange,
    output_range: LengthRange,
    seed: int,
) -> tuple[list[ServeRequest], int]:
    """`multi_turn_requests` with one shared system prompt of `document_len` tokens first in every request's
    messages; also returns the system prompt's length in tokens. `input_range` bounds each conversation's own
    history, without the system prompt."""
    system = make_document(answers, encode, decode, document_len, seed)
    system_len = len(encode(system))
    requests = [
        replace(r, prompt_len=r.prompt_len + system_len, messages=[{"role": "system", "content": system}, *r.messages])
        for r in multi_turn_requests(dialogues, encode, num, turns, input_range, output_range, seed)
        if r.messages is not None
    ]
    return requests, system_len
