"""The request fields that ask for structured output: OpenAI's `response_format` and vLLM's extensions
(`structured_outputs`, and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from folio.server.errors import APIError
from folio.structured.params import StructuredOutputParams


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # folio always enforces the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` object: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StructuredFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self, max_bytes: int | None = None) -> StructuredOutputParams | None:
        """The one constraint this request asks for (400 if it asks for several, an invalid one, or one
        over `max_bytes` as JSON: compiling a grammar costs time that grows with its size)."""
        asked: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        if self.response_format is not None and self.response_format.json_schema is not None:
            schema = self.response_format.json_schema.schema_
            asked.append(("response_format", {"json": schema if schema is not None else {}}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True)
            fields = {("json" if k == "json_" else k): v for k, v in fields.items() if v is not False}
            asked.append(("structured_outputs", fields))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                asked.append((f"guided_{name}", {name: value}))
        if not asked:
            return None
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise APIError(400, f"ask for one kind of structured output, not several ({names})", param=asked[1][0])
        param, fields = asked[0]
        size = len(json.dumps(fields, ensure_ascii=False).encode())
        if max_bytes is not None and size > max_bytes:
            raise APIError(400, f"the structured-output constraint is {size} bytes; at most {max_bytes} are allowed",
                           param=param)  # fmt: skip
        try:
            return StructuredOutputParams(**fields)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from exc
