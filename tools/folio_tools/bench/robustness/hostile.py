"""The hostile shapes `folio bench fuzz` sends beside schemathesis's cases: JSON that fits no schema and
that schemathesis never writes, at any POST route of any API (OpenAI, Ollama, Anthropic, Responses).

- nesting past Python's recursion limit, past json's own, and just past folio's depth cap;
- a list of hundreds of thousands of texts (a 4 MB body of one-character prompts), or of numbers;
- lone UTF-16 surrogates, in values and in keys;
- NaN, Infinity, and numbers that overflow to infinity.
Each goes into a field the route knows (or one it does not), at the top of the body or inside a message.
A shape that no route may take is a failure when answered 2xx; every answer must be a 4xx in its API's
error format (the same check as schemathesis's cases), and the server must keep serving.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PLACEHOLDER = "\x00folio-hostile\x00"  # json.dumps writes it as an escaped string; the raw text replaces it


@dataclass(frozen=True)
class HostileCase:
    shape: str
    path: str
    body: bytes
    refused: bool  # no route may answer this shape 2xx


def _deep(rng: random.Random) -> str:
    depth = rng.choice([65, 300, 990, 2_000, 100_000])
    return "[" * depth + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth


def _texts(rng: random.Random) -> str:
    return json.dumps([rng.choice(["a", "Hi", "\u00e9"])] * rng.choice([65_537, 200_000, 900_000]))


def _numbers(rng: random.Random) -> str:
    return "[" + ",".join(["1"] * rng.choice([70_000, 500_000, 1_500_000])) + "]"


def _surrogate(rng: random.Random) -> str:
    escape = f"\\u{rng.choice(['d800', 'dbff', 'dc00', 'dfff'])}"
    return rng.choice([f'"{escape}"', f'"text {escape} more"', f'{{"{escape}": 1}}', f'["ok", "{escape}"]'])


def _not_finite(rng: random.Random) -> str:
    return rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "[1, NaN]", '{"t": Infinity}'])


# shape -> (raw JSON text maker, whether every route must refuse it)
SHAPES: dict[str, tuple[Callable[[random.Random], str], bool]] = {
    "deep nesting": (_deep, True),
    "huge list of texts": (_texts, True),
    "huge list of numbers": (_numbers, False),  # token ids: a route may take a long list of them
    "lone surrogate": (_surrogate, True),
    "NaN or infinity": (_not_finite, True),
}


def _posts(schema: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(path, the top-level properties of its JSON body) of every POST operation in the OpenAPI schema."""
    components = schema.get("components", {}).get("schemas", {})
    posts = []
    for path, methods in sorted(schema.get("paths", {}).items()):
        if "post" not in methods:
            continue
        body = (methods["post"].get("requestBody") or {}).get("content", {}).get("application/json", {})
        ref = body.get("schema", {}).get("$ref", "")
        posts.append((path, sorted(components.get(ref.rsplit("/", 1)[-1], {}).get("properties", {}))))
    return posts


def hostile_cases(schema: dict[str, Any], count: int, seed: int, model: str) -> list[HostileCase]:
    """`count` cases over the schema's POST operations, shapes and places drawn from `seed`."""
    rng = random.Random(seed)
    posts = _posts(schema)
    cases = []
    for index in range(count):
        path, fields = posts[index % len(posts)]
        shape = rng.choice(sorted(SHAPES))
        make, refused = SHAPES[shape]
        field = rng.choice([*fields, "x"])
        value: Any = PLACEHOLDER
        if rng.random() < 0.3:  # one level down, where messages and inputs keep their text
            value = [{"role": "user", "content": PLACEHOLDER}]
        body = {"model": model, field: value}
        text = json.dumps(body).replace(json.dumps(PLACEHOLDER), make(rng))
        cases.append(HostileCase(shape, path, text.encode(), refused))
    return cases
