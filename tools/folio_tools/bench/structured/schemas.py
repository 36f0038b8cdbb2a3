"""The JSON schemas `folio bench structured` asks for: flat and nested objects, enums, arrays,
patterns, optional and nullable fields."""

from __future__ import annotations

from typing import Any

_SHORT = {"type": "string", "maxLength": 40}

SCHEMAS: dict[str, dict[str, Any]] = {
    "user profile": {
        "type": "object",
        "properties": {
            "name": _SHORT,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z]{1,15}\\.(com|org|net)$"},
            "interests": {"type": "array", "items": _SHORT, "maxItems": 4},
        },
        "required": ["name", "age", "email", "interests"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "customer": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "tier": {"enum": ["free", "pro", "enterprise"]}},
                "required": ["id", "tier"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                        "price": {"type": "number"},
                    },
                    "required": ["sku", "quantity", "price"],
                    "additionalProperties": False,
                },
            },
            "gift": {"type": "boolean"},
        },
        "required": ["customer", "items", "gift"],
        "additionalProperties": False,
    },
    "weather report": {
        "type": "object",
        "properties": {
            "city": _SHORT,
            "forecast": {"type": "array", "items": {"type": "number"}, "maxItems": 7},
            "alert": {"anyOf": [_SHORT, {"type": "null"}]},
            "unit": {"enum": ["C", "F"]},
        },
        "required": ["city", "forecast", "alert"],
        "additionalProperties": False,
    },
    "book review": {
        "type": "object",
        "properties": {
            "title": _SHORT,
            "author": _SHORT,
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "summary": {"type": "string", "maxLength": 200},
            "recommended": {"type": "boolean"},
        },
        "required": ["title", "author", "rating", "summary", "recommended"],
        "additionalProperties": False,
    },
}
