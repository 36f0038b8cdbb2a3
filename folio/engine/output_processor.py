"""Turns a request's token ids into text as they arrive, and ends it at a stop string.

`OutputProcessor` is the one place that does this for every caller (the offline LLM, its stream,
the server's async engine): it feeds each updated request's new tokens to its detokenizer, aborts a
request whose text reached a stop string (so its blocks are freed in the same step), and ends a
request whose tokens cannot be decoded with an error, never its batch.

Stop strings are matched on decoded text, not on token ids, because one string can span several
tokens and a token can hold the end of one string and the start of the next text. While a request
runs, the last `len(longest stop) - 1` characters are held back: they could still turn out to be the
start of a stop string, and text once sent to a client cannot be taken back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from folio.engine.engine_core import EngineCore
from folio.engine.request import FinishReason, Request
from folio.loaders.tokenizer import Tokenizer
from folio.outputs import TokenLogprob

logger = logging.getLogger("folio")


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = tokenizer.decode_stream(skip_special_tokens)
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # decoded so far (cut at the stop string once one matched)
        self.num_tokens = 0  # tokens consumed; tokens after a stop string are not
        self.stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the text
        self._released = 0

    def add(self, token_ids: Sequence[int], finished: bool = False) -> str:
        """Feed new tokens; return the text that is now safe to emit."""
        for token_id in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            delta = self._decoder.step(token_id)
            if delta:
                self._append(delta)
        if finished and not self.stopped and (tail := self._decoder.finish()):
            self._append(tail)
        done = finished or self.stopped
        end = len(self.text) if done else max(self._released, len(self.text) - self._hold)
        released, self._released = self.text[self._released : end], end
        return released

    def _append(self, delta: str) -> None:
        # A stop string may begin up to len(stop) - 1 characters before the new text.
        search_from = max(0, len(self.text) - self._hold)
        self.text += delta
        best: tuple[int, int] | None = None
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, at + len(stop))
                self.matched_stop = stop
        if best is not None:
            self.text = self.text[: best[1] if self._include_stop else best[0]]
            self.stopped = True


def detokenize_step(detokenizer: IncrementalDetokenizer, request: Request, new_token_ids: list[int]) -> str:
    """Feed a request's new tokens; return the text now safe to emit.

    The token that ended a request on EOS or a stop token id is not text. A stop string completed by a
    request's last token still makes its finish reason "stop". The caller aborts a request that is
    still running when `detokenizer.stopped` turns true.
    """
    text_tokens = new_token_ids
    params = request.sampling_params
    if request.finish_reason == FinishReason.STOP and text_tokens:
        last = text_tokens[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in request.eos_token_ids):
            text_tokens = text_tokens[:-1]
    was_stopped = detokenizer.stopped
    text = detokenizer.add(text_tokens, finished=request.is_finished)
    if detokenizer.stopped and not was_stopped and request.is_finished:
        request.finish_reason = FinishReason.STOP
    return text


@dataclass
class OutputDelta:
    """What one request produced since the last delta."""

    request: Request
    text: str  # safe to show: stop strings cut, characters that may start one held back
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None = None  # in a request's first delta, if it asked
    stop_reason: str | None = None  # the stop string that ended the request


@dataclass
class _Tracked:
    detokenizer: IncrementalDetokenizer | None  # None: text decoded once, at the end
    num_sent: int = 0
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    def __init__(self, engine: EngineCore, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._tracked: dict[str, _Tracked] = {}

    def add(self, request: Request, stream_text: bool = True) -> None:
        """Track a request. Without `stream_text`, and without stop strings that need the text as it
        grows, its text is decoded once at the end (`text`), which costs less."""
        params = request.sampling_params
        detokenizer = None
        if stream_text or params.stop:
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        self._tracked[request.request_id] = _Tracked(detokenizer)

    def forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def process(self, updated: list[Request]) -> list[OutputDelta]:
        """The deltas of the tracked requests among a step's updated ones."""
        return [self._delta(r, tracked) for r in updated if (tracked := self._tracked.get(r.request_id))]

    def text(self, request: Request) -> str:
        """The request's whole text so far."""
        tracked = self._tracked.get(request.request_id)
        if tracked is not None and tracked.detokenizer is not None:
            return tracked.detokenizer.text
        return self.tokenizer.decode(request.output_token_ids)

    def _delta(self, request: Request, tracked: _Tracked) -> OutputDelta:
        sent = tracked.num_sent
        text = ""
        if tracked.detokenizer is not None:
            try:
                text = detokenize_step(tracked.detokenizer, request, request.output_token_ids[sent:])
            except Exception:
                logger.exception("could not decode the output of request %s", request.request_id)
                self.fail(request, "the output could not be decoded")
                return OutputDelta(request, "", [], [])
            if tracked.detokenizer.stopped:
                # A step that added several tokens (speculative decoding) may have run past the stop
                # string: the tokens after it are not part of the output.
                kept = tracked.detokenizer.num_tokens
                del request.output_token_ids[kept:], request.output_logprobs[kept:]
                if not request.is_finished:
                    self.engine.abort_request(request.request_id, FinishReason.STOP)
        tracked.num_sent = len(request.output_token_ids)
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None and not tracked.sent_prompt_logprobs:
            prompt_logprobs, tracked.sent_prompt_logprobs = list(request.prompt_logprobs), True
        stop = tracked.detokenizer.matched_stop if tracked.detokenizer is not None else None
        new_tokens, new_logprobs = request.output_token_ids[sent:], request.output_logprobs[sent:]
        return OutputDelta(request, text, new_tokens, new_logprobs, prompt_logprobs, stop)

    def fail(self, request: Request, error: str) -> None:
        """End one request with an error, however far it got."""
        if not request.is_finished:
            self.engine.abort_request(request.request_id, FinishReason.ERROR)
        request.finish_reason, request.error = FinishReason.ERROR, error
