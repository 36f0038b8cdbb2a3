"""A Responses stream: the API's typed events, numbered, as the answer arrives. Each output item is
added, filled by deltas, and done; `response.completed` (or `.incomplete`) carries the whole response."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from folio.server.chat_answer import AnswerPiece
from folio.server.engine_client.protocol import GenerationStream
from folio.server.errors import APIError
from folio.server.openai.chat.prompt import PreparedChat
from folio.server.openai.logprobs_format import TokenText, chat_logprobs
from folio.server.openai.responses.items import ResponseShell, call_item, message_item, reasoning_item, usage


class ResponseEvents:
    def __init__(self, shell: ResponseShell, prepared: PreparedChat, token_text: TokenText | None) -> None:
        self.shell = shell
        self.prepared = prepared
        self.token_text = token_text
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being filled
        self.sequence = 0

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    @staticmethod
    def error_event(error: APIError) -> str:
        payload = {"type": "error", "sequence_number": 0, "code": error.code, "message": error.message,
                   "param": error.param}  # fmt: skip
        return f"event: error\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def run(self, generation: GenerationStream) -> AsyncIterator[str]:
        yield self._event("response.created", response=self.shell.whole([], "in_progress", None))
        yield self._event("response.in_progress", response=self.shell.whole([], "in_progress", None))
        answer, output_tokens = self.prepared.prompt.reader.stream(), 0
        async for _, update in generation:
            output_tokens += len(update.new_token_ids)
            logprobs = self._logprobs(update.new_logprobs)
            for event in self._piece(answer.feed(update.text), logprobs) if update.text else []:
                yield event
            if update.finished:
                for event in [*self._piece(answer.finish(), []), *self._close()]:
                    yield event
                status = "incomplete" if update.finish_reason == "length" else "completed"
                counts = usage(len(self.prepared.prompt.token_ids), output_tokens)
                yield self._event(f"response.{status}", response=self.shell.whole(self.output, status, counts))

    def _logprobs(self, entries: list) -> list[dict[str, Any]]:
        if self.token_text is None or not entries:
            return []
        return list(chat_logprobs(self.token_text, entries)["content"])

    def _index(self) -> int:
        return len(self.output)

    def _item_event(self, kind: str, **fields: Any) -> str:
        """An event about the item being filled."""
        assert self.open is not None
        return self._event(kind, item_id=self.open["id"], output_index=self._index(), **fields)

    def _open(self, item: dict[str, Any], part: dict[str, Any] | None = None) -> list[str]:
        """Finish the item being filled and start `item`, with its empty content `part` if it has one."""
        events = self._close()
        self.open = item
        events.append(self._event("response.output_item.added", output_index=self._index(), item=item))
        if part is not None:
            events.append(self._item_event("response.content_part.added", content_index=0, part=part))
        return events

    def _piece(self, piece: AnswerPiece, logprobs: list[dict[str, Any]]) -> list[str]:
        events: list[str] = []
        if piece.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._open(reasoning_item("", "in_progress"), {"type": "reasoning_text", "text": ""})
            self.open["content"][0]["text"] += piece.reasoning
            events.append(self._item_event("response.reasoning_text.delta", content_index=0, delta=piece.reasoning))
        if piece.content:
            if self.open is None or self.open["type"] != "message":
                empty = {"type": "output_text", "text": "", "annotations": []}
                events += self._open(message_item("", [], "in_progress"), empty)
            part = self.open["content"][0]
            part["text"] += piece.content
            part["logprobs"] += logprobs
            events.append(self._item_event("response.output_text.delta", content_index=0, delta=piece.content,
                                           logprobs=logprobs))  # fmt: skip
        for call in piece.tool_calls:
            events += self._open({**call_item(call, "in_progress"), "arguments": ""})
            self.open["arguments"] = call.arguments
            events.append(self._item_event("response.function_call_arguments.delta", delta=call.arguments))
            events += self._close()
        return events

    def _close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        item["status"] = "completed"
        if item["type"] == "function_call":
            events = [self._item_event("response.function_call_arguments.done", arguments=item["arguments"])]
        else:
            part = item["content"][0]  # its type names its events: output_text or reasoning_text
            done = {"text": part["text"], **({"logprobs": part["logprobs"]} if "logprobs" in part else {})}
            events = [self._item_event(f"response.{part['type']}.done", content_index=0, **done),
                      self._item_event("response.content_part.done", content_index=0, part=part)]  # fmt: skip
        events.append(self._event("response.output_item.done", output_index=self._index(), item=item))
        self.output.append(item)
        self.open = None
        return events
