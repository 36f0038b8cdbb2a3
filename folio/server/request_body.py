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

# The faults found here, in the order the json_shape kernel numbers them (1, 2, ...): the error types
# `_validation_message` (app.py) reads, each with a "param" in its ctx.
BODY_FAULTS = ("too_deep", "too_many_items", "not_finite", "lone_surrogate")
BODY_ERROR_TYPES = frozenset(BODY_FAULTS)

_PATH_KEYS = 8  # a path longer than this is cut short in the message
_Node = tuple[Any, str | int | None, "Any", int]  # (value, its key in its parent, the parent's node, depth)


def _path(node: _Node | None) -> str:
    keys = []
    while node is not None and node[1] is not None:
        keys.append(str(node[1]))
        node = node[2]
    keys.reverse()
    return ".".join(keys[:_PATH_KEYS]) + ("..." if len(keys) > _PATH_KEYS else "") or "body"


def body_fault(
    kind: str, param: str, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS
) -> PydanticCustomError:
    """The error for a fault of `kind` (one of BODY_FAULTS) at `param`, found here or by the kernel."""
    message = {
        "too_deep": f"JSON nested more than {max_depth} levels deep",
        "too_many_items": f"a list or object may hold at most {max_items} entries (a list of integers alone more)",
        "not_finite": "NaN and Infinity are not JSON numbers",
        "lone_surrogate": "the text holds a lone UTF-16 surrogate, which is not valid Unicode",
    }[kind]
    return PydanticCustomError(kind, "{param}: " + message, {"param": param})


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS) -> None:
    """Raise a PydanticCustomError (one of BODY_FAULTS) naming where `value` first breaks a rule."""
    stack: list[_Node] = [(value, None, None, 0)]
    while stack:
        node = stack.pop()
        item, _, _, depth = node
        if isinstance(item, dict):
            entries: Any = item.items()
        elif isinstance(item, list):
            if len(item) > max_items and not all(type(x) is int for x in item):
                raise body_fault("too_many_items", _path(node), max_depth, max_items)
            entries = enumerate(item)
        else:
            _check_scalar(item, node)
            continue
        if depth >= max_depth:
            raise body_fault("too_deep", _path(node), max_depth, max_items)
        if isinstance(item, dict) and len(item) > max_items:
            raise body_fault("too_many_items", _path(node), max_depth, max_items)
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
                raise body_fault("lone_surrogate", _path(node)) from None
    elif isinstance(item, float) and not math.isfinite(item):
        raise body_fault("not_finite", _path(node))


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


class StrictModel(BaseModel):
    """A part of a request body: unknown fields are refused (400)."""

    model_config = ConfigDict(extra="forbid")


class RequestBody(StrictModel):
    """A whole request body: unknown fields, NaN/infinity, lone surrogates, deep nesting and huge
    containers are refused (400) before any field is validated."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _sound_json(cls, data: Any) -> Any:
        check_json_value(data)
        return data
