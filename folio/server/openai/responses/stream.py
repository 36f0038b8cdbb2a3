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

    def _open(self, item: dict[str, Any]) -> list[str]:
        self.open = item
        return [self._event("response.output_item.added", output_index=self._index(), item=item)]

    def _piece(self, piece: AnswerPiece, logprobs: list[dict[str, Any]]) -> list[str]:
        events: list[str] = []
        if piece.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._close() + self._open(reasoning_item("", "in_progress"))
                events.append(self._event("response.content_part.added", item_id=self.open["id"],
                                          output_index=self._index(), content_index=0,
                                          part={"type": "reasoning_text", "text": ""}))  # fmt: skip
            self.open["content"][0]["text"] += piece.reasoning
            events.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                      output_index=self._index(), content_index=0, delta=piece.reasoning))  # fmt: skip
        if piece.content:
            if self.open is None or self.open["type"] != "message":
                events += self._close() + self._open(message_item("", [], "in_progress"))
                events.append(self._event("response.content_part.added", item_id=self.open["id"],
                                          output_index=self._index(), content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": []}))  # fmt: skip
            part = self.open["content"][0]
            part["text"] += piece.content
            part["logprobs"] += logprobs
            events.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                      output_index=self._index(), content_index=0, delta=piece.content,
                                      logprobs=logprobs))  # fmt: skip
        for call in piece.tool_calls:
            events += self._close() + self._open({**call_item(call, "in_progress"), "arguments": ""})
            self.open["arguments"] = call.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=self._index(), delta=call.arguments))  # fmt: skip
            events += self._close()
        return events

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        index, events = self._index(), []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))  # fmt: skip
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"], logprobs=part["logprobs"]))  # fmt: skip
            else:
                events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"]))  # fmt: skip
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))  # fmt: skip
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events
