"""Tokenizer facade over HF `tokenizers`: encode/decode, streaming decode, and the chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from folio.loaders.gguf_file import GGUFFile
from folio.loaders.gguf_tokenizer import load_gguf_tokenizer


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejected the messages."""


@dataclass
class Tokenizer:
    backend: HFTokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: frozenset[int]
    _renders_tools: bool | None = field(default=None, init=False, repr=False, compare=False)
    # The chat template compiled on first use (or why it would not compile), reused by every render.
    _template: jinja2.Template | Exception | None = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # Compiled template code does not pickle (the engine sends its tokenizer to the API side): the
        # receiving side compiles its own on first use.
        return {**self.__dict__, "_template": None}

    @classmethod
    def from_hf_folder(cls, folder: Path, extra_eos: list[int] | None = None) -> Tokenizer:
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        settings: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").exists():
            settings = json.loads((folder / "tokenizer_config.json").read_text())
        template = settings.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        bos, eos = _token_text(settings.get("bos_token")), _token_text(settings.get("eos_token"))
        return cls._build(backend, template, bos, eos, extra_eos or [])

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        backend = load_gguf_tokenizer(gguf.path)
        tokens = gguf.get("tokenizer.ggml.tokens") or []
        bos_id, eos_id = gguf.get("tokenizer.ggml.bos_token_id"), gguf.get("tokenizer.ggml.eos_token_id")
        bos = tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None
        eos = tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None
        extra = [int(eos_id)] if eos_id is not None else []
        return cls._build(backend, gguf.get("tokenizer.chat_template"), bos, eos, extra)

    @classmethod
    def _build(
        cls, backend: HFTokenizer, template: str | None, bos: str | None, eos: str | None, extra_eos: list[int]
    ) -> Tokenizer:
        eos_ids = set(extra_eos)
        if eos is not None and backend.token_to_id(eos) is not None:
            eos_ids.add(backend.token_to_id(eos))
        # Chat models end a turn with an end-of-turn token that may differ from EOS.
        for turn_end in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"):
            if template and turn_end in template and backend.token_to_id(turn_end) is not None:
                eos_ids.add(backend.token_to_id(turn_end))
        return cls(backend, template, bos, eos, frozenset(eos_ids))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> StreamingDecoder:
        return StreamingDecoder(self.backend, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render with the model's template, as transformers does: `tools` in the template's `tools`
        variable (OpenAI's {"type": "function", "function": ...} shape), `template_kwargs` as further
        variables (such as `enable_thinking`)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template (is it a base model?); use a plain prompt")
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        template = self._compiled_template()
        try:
            return template.render(
                **(template_kwargs or {}),
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as exc:  # the sandbox raises TemplateError, the template's own code anything
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def _compiled_template(self) -> jinja2.Template:
        """The chat template, compiled on first use (two threads may both compile it: the same result)."""
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.filters["tojson"] = _tojson  # as transformers: no HTML escaping, keeps non-ASCII
            try:
                self._template = env.from_string(self.chat_template or "")
            except Exception as exc:  # a syntax error: every render fails alike, none compiles it again
                self._template = exc
        if isinstance(self._template, Exception):
            raise ChatTemplateError(f"chat template failed: {self._template}") from self._template
        return self._template

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes BOS itself where the model wants one.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the model the tools it is given (many ignore them): checked
        once by rendering a probe tool and looking for its name."""
        if self._renders_tools is None:
            probe = {"type": "function", "function": {"name": "folio_probe_tool", "description": "probe",
                                                      "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
            try:
                text = self.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe])
            except ChatTemplateError:
                text = ""
            self._renders_tools = "folio_probe_tool" in text
        return self._renders_tools


class StreamingDecoder:
    """Turns a stream of token ids into text deltas, holding back partial UTF-8 characters (with the
    complete ones that came in the same tokens); `finish` gives those complete ones when no more come."""

    CONTEXT_TOKENS = 4  # released tokens decoded before the held ones, so that their spacing is as in the text

    def __init__(self, backend: HFTokenizer, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context: list[int] = []  # the last few tokens the deltas so far cover
        self._held: list[int] = []  # tokens since then, whose text DecodeStream holds back

    def step(self, token_id: int) -> str:
        text = self._stream.step(self._backend, token_id)
        if not text:
            self._held.append(token_id)
            return ""
        self._context = [*self._context, *self._held, token_id][-self.CONTEXT_TOKENS :]
        self._held = []
        return text

    def finish(self) -> str:
        """The complete characters of the tokens held back (a text cut inside a character: ' ' and the
        first byte of a three-byte one), less the U+FFFD that decode gives their incomplete bytes."""
        if not self._held:
            return ""
        before = self._backend.decode(self._context, skip_special_tokens=self._skip_special_tokens)
        whole = self._backend.decode(self._context + self._held, skip_special_tokens=self._skip_special_tokens)
        return whole[len(before) :].rstrip("\ufffd") if whole.startswith(before) else ""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)
