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

    def __post_init__(self) -> None:
        for limit in fields(self):
            if getattr(self, limit.name) < 1:
                raise ValueError(f"{limit.name} must be at least 1, got {getattr(self, limit.name)}")

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
