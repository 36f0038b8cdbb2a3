"""What every route handler needs: the engine, the tokenizer, the served name, admission and limits;
`ChatOptions`, how chat answers are read (which tool-call format, whether to split out reasoning); and
`AdmittedCall`, one API call's hold on the server, answered as a stream or as its collected choices."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType

from folio.loaders.tokenizer import Tokenizer
from folio.reasoning import REASONING_CHOICES
from folio.server.admission import Admission, Reservation
from folio.server.created_models import ModelPreset
from folio.server.engine_client.protocol import EngineClient, GenerationStream
from folio.server.engine_client.updates import ChoiceResult
from folio.server.errors import APIError, engine_errors
from folio.server.lifetime import ClosingStreamingResponse
from folio.server.limits import RequestLimits
from folio.server.model_card import ModelCard
from folio.server.sse import guarded, openai_error_event
from folio.tool_calls.registry import PARSER_CHOICES


@dataclass(frozen=True)
class ChatOptions:
    tool_call_parser: str = "auto"  # auto: from the chat template (folio's own prompt if it shows no tools)
    reasoning_parser: str = "auto"  # auto: split <think> when the chat template mentions it

    def __post_init__(self) -> None:
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; choose one of "
                             f"{', '.join(PARSER_CHOICES)}")  # fmt: skip
        if self.reasoning_parser not in REASONING_CHOICES:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose one of "
                             f"{', '.join(REASONING_CHOICES)}")  # fmt: skip


class AdmittedCall:
    """One API call's admission slots and engine requests, given back together by `close()`
    (idempotent). As a context manager it closes on every exit, unless the handler handed the call
    to a streaming response (`stream`), whose own cleanup closes it when the stream ends."""

    def __init__(self, reservation: Reservation, generation: GenerationStream) -> None:
        self.reservation = reservation
        self.generation = generation
        self._handed_off = False

    def close(self) -> None:
        self.generation.close()
        self.reservation.release()

    def stream(
        self, events: AsyncIterator[str], error_event: Callable[[APIError], str] = openai_error_event,
        media_type: str = "text/event-stream",
    ) -> ClosingStreamingResponse:  # fmt: skip
        """The answer as a stream of `events` (sse.guarded: a failure becomes `error_event`) that gives the
        call back when it ends."""
        self._handed_off = True
        return ClosingStreamingResponse(guarded(events, error_event), on_close=self.close, media_type=media_type)

    async def collect(self, num_choices: int) -> list[ChoiceResult]:
        """Every choice's whole result; a failed choice or a dead engine raises its APIError."""
        results = [ChoiceResult() for _ in range(num_choices)]
        with engine_errors():
            async for index, update in self.generation:
                results[index].add(update)
        return results

    def __enter__(self) -> AdmittedCall:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None or not self._handed_off:
            self.close()


@dataclass
class ServerContext:
    engine: EngineClient
    tokenizer: Tokenizer
    model_name: str
    vocab_size: int
    hidden_size: int  # the length of an embedding
    admission: Admission
    limits: RequestLimits = field(default_factory=RequestLimits)
    chat: ChatOptions = field(default_factory=ChatOptions)
    model_card: ModelCard | None = None  # what Ollama's model routes say about the served model
    lora_name: str | None = None  # a LoRA adapter's name: the calls of this context run with it
    preset: ModelPreset | None = None  # a created model's system prompt and default options (Ollama's routes)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_prompt(self, ids: list[int], param: str = "prompt", generates: bool = True) -> None:
        """Refuse prompts the engine could not run, before anything is streamed. An input that generates
        nothing (an embedding's) may fill the whole context."""
        if not ids:
            raise APIError(400, f"the {param} is empty", param=param)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"{param} token ids must be in [0, {self.vocab_size})", param=param)
        if len(ids) > self.max_model_len - (1 if generates else 0):
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the {param} has {len(ids)} "
                "tokens" + (", leaving no room to generate" if generates else ""),
                param=param,
                code="context_length_exceeded",
            )

    def default_max_tokens(self, prompt_len: int) -> int:
        return self.max_model_len - prompt_len

    def open_call(self, num_sequences: int, param: str) -> AdmittedCall:
        """Admission for `num_sequences` engine requests: 503 if the engine has died, 400 if the request
        alone exceeds the server's capacity, 429 if the server is full."""
        if not self.engine.is_alive:
            raise APIError(503, "the engine has stopped after an internal error", code="engine_dead")
        return AdmittedCall(self.admission.reserve(num_sequences, param), self.engine.generation(self.lora_name))
