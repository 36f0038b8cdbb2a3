"""Turns a request's token ids into text as they arrive, and ends it at a stop string.

Stop strings are matched on decoded text, not on token ids, because one string can span several
tokens and a token can hold the end of one string and the start of the next text. While a request
runs, the last `len(longest stop) - 1` characters are held back: they could still turn out to be the
start of a stop string, and text once sent to a client cannot be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence

from folio.engine.request import FinishReason, Request
from folio.loaders.tokenizer import Tokenizer


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
