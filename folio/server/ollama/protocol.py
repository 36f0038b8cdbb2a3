"""Request bodies of Ollama's native API (/api/chat, /api/generate, /api/embed, ...), and how their
`options` become folio's sampling fields.

Ollama's defaults are kept where folio has the same knob (temperature 0.8, top_k 40, top_p 0.9).
Options folio does not implement are a 400 naming them: the load-time ones (num_gpu, num_thread, ...)
are set once by `folio serve`'s flags, and mirostat, tfs_z and typical_p have no sampler here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from folio.sampling_params import INT64_MAX, INT64_MIN
from folio.server.errors import APIError
from folio.server.openai.chat.protocol import ToolParam
from folio.server.request_body import RequestBody, StrictModel

OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# Options that size or place the model: folio sets them when it starts.
LOAD_OPTIONS = {
    "num_gpu": "--device", "main_gpu": "--device", "low_vram": "--kv-cache-memory", "num_thread": None,
    "num_batch": "--max-num-batched-tokens", "numa": None, "use_mmap": None, "use_mlock": None, "vocab_only": None,
    "embedding_only": None, "logits_all": None, "f16_kv": "--kv-cache-dtype",
}  # fmt: skip
# Sampler settings folio has no sampler for, and the value that means "off".
UNSAMPLED = {"mirostat": 0, "mirostat_tau": None, "mirostat_eta": None, "tfs_z": 1.0, "typical_p": 1.0,
             "penalize_newline": None, "num_keep": None}  # fmt: skip


class OllamaOptions(BaseModel):
    """The sampling options folio applies; anything else in `options` is checked by `check_extras`."""

    model_config = ConfigDict(extra="allow")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    num_predict: int | None = Field(None, ge=-2)  # -1: until the context ends; -2: fill the context
    num_ctx: int | None = Field(None, ge=1)
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(None, gt=0.0)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)

    def check_extras(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if value is None:  # clients send every option they know, unset ones as null
                continue
            if name in LOAD_OPTIONS:
                flag = LOAD_OPTIONS[name]
                how = f"set by `folio serve {flag}`" if flag else "decided by folio"
                raise APIError(400, f"option '{name}' is not per request here: the model is loaded once ({how})",
                               param=f"options.{name}")  # fmt: skip
            if name in UNSAMPLED and value not in (UNSAMPLED[name], None):
                raise APIError(400, f"option '{name}' is not supported by this server", param=f"options.{name}")
            if name not in UNSAMPLED:
                raise APIError(400, f"unknown option '{name}'", param=f"options.{name}")
        if self.repeat_last_n not in (None, -1, 0):
            raise APIError(400, "repeat_last_n windows are not supported: the repeat penalty covers the whole "
                           "context (-1), or 0 turns it off", param="options.repeat_last_n")  # fmt: skip
        if self.num_predict == 0:
            raise APIError(400, "num_predict must be positive, -1 (until the context ends) or -2 (fill it)",
                           param="options.num_predict")  # fmt: skip

    def sampling_fields(self) -> dict[str, Any]:
        """The OpenAI-style sampling fields these options ask for (Ollama's defaults where unset)."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in OLLAMA_DEFAULTS}
        fields = {name: OLLAMA_DEFAULTS[name] if value is None else value for name, value in fields.items()}
        fields.update(min_p=self.min_p, seed=self.seed, stop=self.stop or None, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty)  # fmt: skip
        if self.repeat_penalty is not None and self.repeat_last_n != 0:
            fields["repetition_penalty"] = self.repeat_penalty
        if self.num_predict is not None and self.num_predict > 0:
            fields["max_tokens"] = self.num_predict
        return fields


class _OllamaBody(RequestBody):
    model: str = Field(min_length=1)
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    keep_alive: float | str | None = None  # the model stays loaded for the server's life


class GeneratingBody(_OllamaBody):
    format: Literal["", "json"] | dict[str, Any] | None = None
    stream: bool = True
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    images: list[str] | None = None  # refused: no vision models here

    def response_format(self) -> dict[str, Any] | None:
        if not self.format:
            return None
        if self.format == "json":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": self.format}}


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")  # newer Ollama versions add an index and an id

    class Function(BaseModel):
        model_config = ConfigDict(extra="allow")
        name: str
        arguments: dict[str, Any]

    function: Function


class OllamaMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # earlier thinking: accepted, not shown to the model
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # which tool a tool message is the result of


class OllamaChatRequest(GeneratingBody):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[ToolParam] | None = None


class OllamaGenerateRequest(GeneratingBody):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None  # the tokens of an earlier exchange (deprecated by Ollama, still sent)
    suffix: str | None = None  # refused: no fill-in-the-middle
    template: str | None = None  # refused: Go templates are Ollama's own


class OllamaEmbedRequest(_OllamaBody):
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)


class OllamaEmbeddingsRequest(_OllamaBody):
    """The older single-prompt route, /api/embeddings."""

    prompt: str


class OllamaModelRequest(RequestBody):
    model: str | None = None
    name: str | None = None  # older clients send "name"
    verbose: bool = False
    insecure: bool = False
    stream: bool = True

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""
