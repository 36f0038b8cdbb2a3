"""`folio bench overload`: many more clients than the server can hold, for a while, and what it does.

Each client sends requests back to back (completions and chats, streamed or not, a few dozen tokens);
after a 429 it waits about the Retry-After the server sent and tries again. The bar: every
answer is 200 or 429, no stream ends with an error, the server's resident memory stays bounded, and
when the load stops the server is alive and holds nothing (admission, running, waiting, KV all zero).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from folio_tools.bench.robustness.run import RobustnessRun, stream_error

if TYPE_CHECKING:
    import httpx

RETRY_PAUSE_S = (0.5, 1.5)  # after a 429: the server's Retry-After (1 s), jittered as clients do


@dataclass(frozen=True)
class OverloadConfig:
    model: str  # the name the server answers to
    duration_s: float = 60.0
    concurrency: int = 80  # clients at once (10 x the default server's 4 running + 4 queued)
    max_tokens: tuple[int, int] = (4, 48)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.concurrency < 1 or not 1 <= self.max_tokens[0] <= self.max_tokens[1]:
            raise ValueError("the duration must be positive, the concurrency at least 1, max tokens LOW:HIGH >= 1")


@dataclass(kw_only=True)
class OverloadReport(RobustnessRun):
    config: OverloadConfig
    memory_mib: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the run, server RSS)

    def memory_summary(self) -> dict[str, float] | None:
        """RSS after the first tenth of the run (warm), at its peak and at the end, in MiB."""
        if not self.memory_mib:
            return None
        warm_from = self.elapsed_s / 10
        warm = next((mib for t, mib in self.memory_mib if t >= warm_from), self.memory_mib[0][1])
        return {"warm": warm, "peak": max(m for _, m in self.memory_mib), "end": self.memory_mib[-1][1]}

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "memory_summary": self.memory_summary()}


def _request(config: OverloadConfig, rng: random.Random) -> tuple[str, dict[str, Any]]:
    max_tokens = rng.randint(*config.max_tokens)
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        body = {"model": config.model, "prompt": f"Story {rng.randint(0, 10**6)}:", "max_tokens": max_tokens}
        return "/v1/completions", {**body, "stream": stream, "ignore_eos": True}
    messages = [{"role": "user", "content": f"Tell me fact {rng.randint(0, 10**6)} about the sea."}]
    return "/v1/chat/completions", {"model": config.model, "messages": messages, "max_tokens": max_tokens,
                                    "stream": stream}  # fmt: skip


async def _send(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """(status, problem or None)."""
    import httpx  # imported only where a server is asked

    try:
        if body["stream"]:
            async with http.stream("POST", path, json=body) as response:
                text = "".join([chunk async for chunk in response.aiter_text()])
        else:
            response = await http.post(path, json=body)
            text = response.text
    except httpx.HTTPError as exc:
        return "no answer", f"no answer: {type(exc).__name__}: {exc}"
    status = str(response.status_code)
    if response.status_code not in (200, 429):
        return status, f"{status}: {text[:300]}"
    if body["stream"] and response.status_code == 200 and (error := stream_error(text)) is not None:
        return status, f"stream error: {error}"
    return status, None


async def _client(config: OverloadConfig, base_url: str, index: int, deadline: float, report: OverloadReport) -> None:
    import httpx

    rng = random.Random(config.seed * 100_003 + index)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        while time.monotonic() < deadline:
            status, problem = await _send(http, *_request(config, rng))
            report.record(status, problem)
            if status == "429":
                await asyncio.sleep(rng.uniform(*RETRY_PAUSE_S))


def _watch_memory(read: Callable[[], float | None], start: float, stop: threading.Event, into: list) -> None:
    while not stop.wait(1.0):
        if (mib := read()) is not None:
            into.append((round(time.monotonic() - start, 1), round(mib, 1)))


def run_overload(config: OverloadConfig, base_url: str, read_memory: Callable[[], float | None]) -> OverloadReport:
    """Load the server at `base_url` for `config.duration_s`; `read_memory` gives its RSS in MiB."""
    report = OverloadReport(config=config)
    start = time.monotonic()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_memory, args=(read_memory, start, stop, report.memory_mib), daemon=True)
    watcher.start()

    async def load() -> None:
        deadline = start + config.duration_s
        await asyncio.gather(*(_client(config, base_url, i, deadline, report) for i in range(config.concurrency)))

    try:
        asyncio.run(load())
    finally:
        stop.set()
        watcher.join()
    report.elapsed_s = round(time.monotonic() - start, 1)
    report.settle(base_url)
    return report
