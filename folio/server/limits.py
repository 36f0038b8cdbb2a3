"""What one request may cost the server. Each limit has a `folio serve` flag (named beside it); a request
over one gets a 400 that names the field, a body over the size limit a 413.

The defaults admit anything an interactive or batch client sends in practice and refuse what can only
be an attack or a mistake: a 100 MB body, a thousand stop strings (each held back and searched on every
token), a grammar that takes seconds to compile, or logprobs that would make a response of gigabytes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from folio.server.errors import APIError


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 4 * 2**20  # --max-request-bytes: the HTTP body (413 beyond)
    max_stop_strings: int = 16  # --max-stop-strings
    max_stop_chars: int = 512  # --max-stop-length: characters in one stop string
    max_logit_bias: int = 1024  # --max-logit-bias: entries
    max_grammar_bytes: int = 128 * 1024  # --max-grammar-bytes: a JSON schema, regex, grammar or choices, as JSON
    max_logprobs: int = 2**20  # --max-logprobs-per-request: choices x (top alternatives + 1) x max_tokens
    max_inputs: int = 2048  # --max-request-inputs: prompts of a completion, inputs of an embedding (as OpenAI's)
    max_prompt_tokens: int = 300_000  # --max-request-tokens: a request's prompts together (OpenAI's embedding cap)
    # --scheduling-policy priority [--priority-range LOW:HIGH]: the priorities a client may ask for; None (fcfs,
    # the default) takes none but 0, since any client could otherwise put itself ahead of every other.
    priority_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for limit in fields(self):
            value = getattr(self, limit.name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"{limit.name} must be at least 1, got {value}")
        if self.priority_range is not None and self.priority_range[0] > self.priority_range[1]:
            raise ValueError(f"the priority range's low end must not pass its high end, got {self.priority_range}")

    def check_stop(self, stops: list[str]) -> None:
        if len(stops) > self.max_stop_strings:
            raise APIError(400, f"at most {self.max_stop_strings} stop strings are allowed, got {len(stops)}",
                           param="stop")  # fmt: skip
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_chars:
            raise APIError(400, f"stop strings may have at most {self.max_stop_chars} characters, got {longest}",
                           param="stop")  # fmt: skip

    def check_logit_bias(self, num_entries: int) -> None:
        if num_entries > self.max_logit_bias:
            raise APIError(400, f"logit_bias may have at most {self.max_logit_bias} entries, got {num_entries}",
                           param="logit_bias")  # fmt: skip

    def check_logprobs(self, num_choices: int, num_top: int | None, max_tokens: int, param: str) -> None:
        """Logprobs are returned per token: their count bounds the response's size."""
        if num_top is None:
            return
        entries = num_choices * (num_top + 1) * max_tokens
        if entries > self.max_logprobs:
            raise APIError(
                400,
                f"this request could return {entries} logprobs ({num_choices} choices x {num_top + 1} per token x "
                f"{max_tokens} tokens); at most {self.max_logprobs} are allowed: lower max_tokens, n or {param}",
                param=param,
            )

    def check_inputs(self, count: int, param: str) -> None:
        """Before anything is tokenized: how many prompts (or inputs) one request holds."""
        if count > self.max_inputs:
            raise APIError(400, f"a request may hold at most {self.max_inputs} {param}s (--max-request-inputs), this "
                           f"one holds {count}", param=param)  # fmt: skip

    def check_prompt_tokens(self, total: int, param: str) -> None:
        if total > self.max_prompt_tokens:
            raise APIError(400, f"this request's {param}s hold {total} tokens together; at most "
                           f"{self.max_prompt_tokens} are allowed (--max-request-tokens)", param=param)  # fmt: skip

    def check_priority(self, priority: int) -> None:
        if priority == 0:
            return
        if self.priority_range is None:
            raise APIError(400, "this server schedules requests first come, first served: priority must be 0 "
                           "(its operator can allow priorities: --scheduling-policy priority)",
                           param="priority")  # fmt: skip
        low, high = self.priority_range
        if not low <= priority <= high:
            raise APIError(400, f"priority must be in [{low}, {high}] on this server, got {priority}", param="priority")
