"""The llama.cpp peer of `folio bench structured`: the same chat requests against `llama-server`, first
with `response_format: json_schema` (llama.cpp turns the schema into a GBNF grammar), then
unconstrained with EOS ignored and each request held to the token count of its constrained run.

All requests of a run are sent at once, one per slot, so llama-server batches them as folio does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from folio_tools.bench.peers.llama_cpp_build import build_llama_cpp
from folio_tools.bench.peers.llama_cpp_server import running_llama_server
from folio_tools.bench.structured.schemas import SCHEMAS

Chat = list[dict[str, str]]
SLOT_TOKENS = 64  # per slot beyond the longest prompt + output: the chat template's own tokens


@dataclass
class PeerRun:
    elapsed_s: float
    completion_tokens: list[int]
    texts: list[str]
    finish_reasons: list[str]


def _post_all(base_url: str, bodies: list[dict[str, Any]]) -> PeerRun:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

    def post(body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=3600)
        response.raise_for_status()
        return response.json()

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        replies = list(pool.map(post, bodies))
    elapsed = time.perf_counter() - start
    return PeerRun(
        elapsed,
        [int(r["usage"]["completion_tokens"]) for r in replies],
        [r["choices"][0]["message"]["content"] or "" for r in replies],
        [r["choices"][0]["finish_reason"] for r in replies],
    )


def run_llama_structured(
    model_path: Path,
    chats: list[tuple[str, Chat]],
    longest_prompt: int,
    max_tokens: int,
    temperature: float,
    seed: int,
    threads: int,
) -> tuple[PeerRun, PeerRun, dict[str, Any]]:
    """(constrained run, unconstrained run, build info) on a fresh llama-server."""
    binaries = build_llama_cpp()
    parallel = len(chats)
    ctx_size = parallel * (longest_prompt + max_tokens + SLOT_TOKENS)

    def body(i: int, chat: Chat, **extra: Any) -> dict[str, Any]:
        return {"messages": chat, "temperature": temperature, "seed": seed + i, "cache_prompt": False, **extra}

    with running_llama_server(binaries, model_path, ctx_size=ctx_size, parallel=parallel, threads=threads) as url:
        _post_all(url, [body(0, chats[0][1], max_tokens=1)])  # warm-up: first-request setup is not the grammar's
        constrained = _post_all(url, [
            body(i, chat, max_tokens=max_tokens, response_format={
                "type": "json_schema", "json_schema": {"name": name.replace(" ", "_"), "schema": SCHEMAS[name]}})
            for i, (name, chat) in enumerate(chats)
        ])  # fmt: skip
        free = _post_all(url, [
            body(i, chat, max_tokens=n, ignore_eos=True)
            for i, ((_, chat), n) in enumerate(zip(chats, constrained.completion_tokens, strict=True))
        ])  # fmt: skip
    if free.completion_tokens != constrained.completion_tokens:
        raise RuntimeError("llama-server's unconstrained run decoded a different number of tokens")
    info = {"llama_cpp_version": binaries.version, "llama_cpp_commit": binaries.commit, "parallel": parallel,
            "ctx_size": ctx_size, "threads": threads}  # fmt: skip
    return constrained, free, info


def count_valid(run: PeerRun, chats: list[tuple[str, Chat]], is_valid: Callable[[str, dict[str, Any]], bool]) -> int:
    return sum(is_valid(text, SCHEMAS[name]) for text, (name, _) in zip(run.texts, chats, strict=True))
