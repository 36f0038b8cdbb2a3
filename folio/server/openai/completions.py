"""POST /v1/completions: prompts (text, texts, token ids) -> text, streamed or whole."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from folio.outputs import TokenLogprob
from folio.sampling_params import SamplingParams
from folio.server.context import ServerContext
from folio.server.engine_client.protocol import GenerationStream
from folio.server.engine_client.updates import ChoiceResult
from folio.server.openai.logprobs_format import TokenText, completion_logprobs, prompt_positions, vllm_prompt_logprobs
from folio.server.openai.protocol import CompletionRequest
from folio.server.sse import DONE, event, usage


def _prompts(ctx: ServerContext, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per prompt; text is None for prompts given as ids. Their count is checked before
    any is tokenized, their tokens together after."""
    prompt = body.prompt
    if isinstance(prompt, str):
        given: list = [prompt]
    elif prompt and isinstance(prompt[0], str | list):
        given = prompt
    else:
        given = [prompt]  # one prompt of token ids
    ctx.limits.check_inputs(len(given), "prompt")
    prompts = [(p, ctx.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)) for p in given]
    ctx.limits.check_prompt_tokens(sum(len(ids) for _, ids in prompts), "prompt")
    return prompts


@dataclass
class PreparedCompletion:
    """A completion request checked whole: nothing is reserved yet."""

    prompts: list[tuple[str | None, list[int]]]
    choice_params: list[SamplingParams]  # one per sample of each prompt
    echoes: list[str]  # per prompt: the text echoed before each choice's ("" without echo)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)


def _prepare(ctx: ServerContext, body: CompletionRequest) -> PreparedCompletion:
    """Everything checked and tokenized (on a worker thread: a request may hold thousands of prompts)."""
    body.reject_unsupported()
    prompts = _prompts(ctx, body)
    for _, ids in prompts:
        ctx.check_prompt(ids)
    n, samples = body.n, body.num_samples
    # best_of ranks samples by the sum of their tokens' logprobs, so it needs them even if not asked.
    logprobs = body.logprobs if samples == n else max(body.logprobs or 0, 0)
    limit = body.max_tokens or 16
    shortest = min(len(ids) for _, ids in prompts)
    ctx.limits.check_logprobs(len(prompts) * samples, body.logprobs, min(limit, ctx.default_max_tokens(shortest)),
                              "logprobs")  # fmt: skip
    longest = max(len(ids) for _, ids in prompts)
    ctx.limits.check_logprobs(len(prompts), body.num_prompt_logprobs, longest, "prompt_logprobs")
    choice_params = body.choice_params(ctx.limits, ctx.vocab_size, limit, samples, logprobs, body.num_prompt_logprobs)
    echoes = [(text if text is not None else ctx.tokenizer.decode(ids)) if body.echo else "" for text, ids in prompts]
    return PreparedCompletion(prompts, choice_params, echoes)


async def create_completion(ctx: ServerContext, body: CompletionRequest):
    # Everything is checked before the call takes admission slots or engine requests.
    prepared = await run_in_threadpool(_prepare, ctx, body)
    prompts, echoes = prepared.prompts, prepared.echoes
    n, samples = body.n, body.num_samples
    count = len(prompts) * samples
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name}  # fmt: skip
    param = "best_of" if samples > n else "beam_width" if body.use_beam_search else "n"
    with ctx.open_call(len(prompts) * body.num_sequences, param) as call:
        for _, ids in prompts:
            call.generation.add(ids, prepared.choice_params, body.cache_salt, body.priority)
        if body.stream:
            events = _stream(ctx, body, head, call.generation, prepared)
            return call.stream(events)
        results = await call.collect(count)
    completion_tokens = sum(len(r.token_ids) for r in results)  # best_of: every sample is paid for
    per_prompt = [results[i * samples : (i + 1) * samples] for i in range(len(prompts))]
    scores = [_prompt_scores(samples_of) for samples_of in per_prompt]
    cached = sum(max(r.num_cached_tokens for r in samples_of) for samples_of in per_prompt)
    if samples > n:
        results = [result for samples_of in per_prompt for result in _most_likely(samples_of, n)]
    token_text = TokenText(ctx.tokenizer)
    choices = []
    for index, result in enumerate(results):
        echo = echoes[index // n]
        choice = {"index": index, "text": echo + result.text, "logprobs": None, "finish_reason": result.finish_reason}
        positions = (
            prompt_positions(prompts[index // n][1], scores[index // n]) if body.num_prompt_logprobs is not None else []
        )
        if body.logprobs is not None:
            echoed = positions if body.echo else None
            choice["logprobs"], _ = completion_logprobs(token_text, result.logprobs, 0, echoed)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(token_text, positions)
        choices.append(choice)
    return {**head, "choices": choices, "usage": usage(prepared.prompt_tokens, completion_tokens, cached)}


def _prompt_scores(results: list[ChoiceResult]) -> list[TokenLogprob | None]:
    """A prompt's token logprobs: from the sample that computed the prompt (the others forked from it)."""
    return max((r.prompt_logprobs or [] for r in results), key=len, default=[])


def _most_likely(results: list[ChoiceResult], n: int) -> list[ChoiceResult]:
    """The n samples with the highest total logprob, best first (OpenAI's best_of)."""
    return sorted(results, key=lambda r: sum(lp.logprob for lp in r.logprobs), reverse=True)[:n]


async def _stream(
    ctx: ServerContext, body: CompletionRequest, head: dict, generation: GenerationStream, prepared: PreparedCompletion
) -> AsyncIterator[str]:
    prompts, echoes = prepared.prompts, prepared.echoes
    extra = {"usage": None} if body.include_usage else {}
    token_text = TokenText(ctx.tokenizer)
    n = body.n
    count = len(prompts) * n
    offsets = [0] * count
    completion_tokens = 0
    scores: dict[int, list[TokenLogprob | None]] = {}  # prompt index -> its token logprobs, once computed
    started: set[int] = set()
    cached: dict[int, int] = {}  # prompt index -> its tokens found in the prefix cache

    def chunk(index: int, text: str, logprobs: dict | None, finish_reason: str | None, **fields) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, **fields}
        return event({**head, "choices": [choice], **extra})

    def head_chunk(index: int) -> str:
        """A choice's first chunk: the echoed prompt, with its tokens' logprobs if asked for."""
        echo, positions = echoes[index // n], prompt_positions(prompts[index // n][1], scores.get(index // n, []))
        logprobs, fields = None, {}
        if body.echo and body.logprobs is not None:
            logprobs, offsets[index] = completion_logprobs(token_text, [], 0, positions)
        if body.prompt_logprobs is not None:
            fields["prompt_logprobs"] = vllm_prompt_logprobs(token_text, positions)
        return chunk(index, echo, logprobs, None, **fields)

    needs_scores = body.num_prompt_logprobs is not None
    if not needs_scores:  # the echo goes out at once; with logprobs it waits for the prompt's scores
        for index in range(count):
            offsets[index] = len(echoes[index // n])
            if echoes[index // n]:
                yield chunk(index, echoes[index // n], None, None)
    async for index, update in generation:
        if needs_scores and index not in started:
            if update.prompt_logprobs is not None and len(update.prompt_logprobs) > len(scores.get(index // n, [])):
                scores[index // n] = update.prompt_logprobs
            started.add(index)
            yield head_chunk(index)
        completion_tokens += len(update.new_token_ids)
        cached[index // n] = max(cached.get(index // n, 0), update.num_cached_tokens)
        logprobs = None
        if body.logprobs is not None:
            logprobs, offsets[index] = completion_logprobs(token_text, update.new_logprobs, offsets[index])
        if update.text or logprobs is not None or update.finished:
            yield chunk(index, update.text, logprobs, update.finish_reason if update.finished else None)
    if body.include_usage:
        usage_now = usage(prepared.prompt_tokens, completion_tokens, sum(cached.values()))
        yield event({**head, "choices": [], "usage": usage_now})
    yield DONE
