"""The one check every API's request body goes through before its fields are read (OpenAI, Ollama,
Anthropic, Responses, and folio's own routes): `RequestBody` is the base of each top-level body model.

JSON text can carry values no route can use, and each once reached code that failed on it with a 500:
- a lone UTF-16 surrogate ("\\ud800"), which is no Unicode text: tokenizers and encoders fail on it;
- NaN or Infinity (Python's json accepts both, and 1e999 becomes infinity) inside free-form objects such
  as a tool's schema, where no float field refuses it;
- nesting deep enough to overflow a recursive reader (json.loads accepts up to ~1,000 levels);
- a container of a million texts or objects, which pydantic then validates on the event loop for seconds.
The walk is iterative, so depth costs it nothing, and it stops at the first fault. Lists of numbers (token
ids) are exempt from the item cap: they cost little to validate, and the context length bounds them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

MAX_JSON_DEPTH = 64  # levels of objects and lists; a tool's JSON schema needs a dozen
MAX_JSON_ITEMS = 65_536  # entries of one object, or of one list that holds texts or objects

# What `_validation_message` (app.py) reads: the error types raised here, each with a "param" in its ctx.
BODY_ERROR_TYPES = frozenset({"lone_surrogate", "not_finite", "too_deep", "too_many_items"})

_PATH_KEYS = 8  # a path longer than this is cut short in the message
_Node = tuple[Any, str | int | None, "Any", int]  # (value, its key in its parent, the parent's node, depth)


def _path(node: _Node | None) -> str:
    keys = []
    while node is not None and node[1] is not None:
        keys.append(str(node[1]))
        node = node[2]
    keys.reverse()
    return ".".join(keys[:_PATH_KEYS]) + ("..." if len(keys) > _PATH_KEYS else "") or "body"


def _fault(kind: str, message: str, node: _Node | None) -> PydanticCustomError:
    return PydanticCustomError(kind, "{param}: " + message, {"param": _path(node)})


def check_json_value(value: Any) -> None:
    """Raise a PydanticCustomError (one of BODY_ERROR_TYPES) naming where `value` first breaks a rule."""
    stack: list[_Node] = [(value, None, None, 0)]
    while stack:
        node = stack.pop()
        item, _, _, depth = node
        if isinstance(item, dict):
            entries: Any = item.items()
        elif isinstance(item, list):
            if len(item) > MAX_JSON_ITEMS and not all(type(x) is int for x in item):
                raise _fault("too_many_items", f"a list may hold at most {MAX_JSON_ITEMS} texts or objects, this one "
                             f"holds {len(item)}", node)  # fmt: skip
            entries = enumerate(item)
        else:
            _check_scalar(item, node)
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _fault("too_deep", f"JSON nested more than {MAX_JSON_DEPTH} levels deep", node)
        if isinstance(item, dict) and len(item) > MAX_JSON_ITEMS:
            raise _fault("too_many_items", f"an object may hold at most {MAX_JSON_ITEMS} entries, this one holds "
                         f"{len(item)}", node)  # fmt: skip
        for key, child in entries:
            if type(key) is str:
                _check_scalar(key, node)
            if type(child) is int:
                continue  # the common case of a long list (token ids): nothing to check
            child_node = (child, key, node, depth + 1)
            if isinstance(child, dict | list):
                stack.append(child_node)
            else:
                _check_scalar(child, child_node)


def _check_scalar(item: Any, node: _Node) -> None:
    if isinstance(item, str):
        if not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise _fault("lone_surrogate", "the text holds a lone UTF-16 surrogate, which is not valid Unicode",
                             node) from None  # fmt: skip
    elif isinstance(item, float) and not math.isfinite(item):
        raise _fault("not_finite", f"{item} is not a JSON number", node)


def load_json_text(text: str) -> Any:
    """JSON that a client sent inside a string (a tool call's arguments), under the same rules as a body;
    ValueError for anything else (RecursionError included: json.loads recurses)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    try:
        check_json_value(value)
    except PydanticCustomError as exc:
        raise ValueError(exc.message()) from None
    return value


class RequestBody(BaseModel):
    """A whole request body: unknown fields, NaN/infinity, lone surrogates, deep nesting and huge
    containers are refused (400) before any field is validated."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _sound_json(cls, data: Any) -> Any:
        check_json_value(data)
        return data
