"""The server's engine interface on a tiny model: closing or dropping a generation aborts its requests,
one request's fault reaches only its caller, and an engine thread that dies (any BaseException) fails
every waiting caller at once, refuses new work and reports its death."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from folio import LLM, SamplingParams
from folio.server.engine_client.thread import AsyncEngine
from folio.server.engine_client.updates import EngineDeadError, RequestFailedError
from folio.worker import model_runner
from tests.tiny_models import make_tiny_model

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


class Panic(BaseException):
    """Stands in for a native panic (PyO3's PanicException derives from BaseException)."""


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    return LLM(make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama"), kv_cache_memory="16MiB")


class Endings:
    """Observer: how each request ended."""

    def __init__(self) -> None:
        self.reasons: list[str | None] = []

    def on_step(self, updated, now) -> None:
        pass

    def on_finished(self, request, now) -> None:
        self.reasons.append(request.finish_reason.value if request.finish_reason else None)


@pytest.fixture
def engine(tiny_llm):
    deaths: list[BaseException] = []
    endings = Endings()
    async_engine = AsyncEngine(tiny_llm.engine, tiny_llm.tokenizer, frozenset(), endings, on_death=deaths.append)
    async_engine.deaths = deaths  # type: ignore[attr-defined]
    async_engine.endings = endings  # type: ignore[attr-defined]
    yield async_engine
    async_engine.shutdown()
    for request_id in list(tiny_llm.engine.scheduler.requests):  # a dead engine leaves its requests behind
        tiny_llm.engine.abort_request(request_id)


def _idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished() or engine.engine.kv.pool.num_free_blocks != engine.engine.kv.pool.num_blocks:
        assert time.monotonic() < deadline, "the engine kept running a request nobody waits for"
        time.sleep(0.01)


def test_closing_a_generation_aborts_its_requests(engine):
    async def run() -> None:
        generation = engine.generation()
        generation.add([1, 2, 3], [LONG, LONG])
        await anext(generation)
        generation.close()
        generation.close()  # idempotent

    asyncio.run(run())
    _idle(engine)
    assert engine.endings.reasons == ["abort", "abort"]


def test_a_generation_dropped_unclosed_aborts_its_requests(engine):
    async def run() -> None:
        generation = engine.generation()
        generation.add([1, 2, 3], [LONG])
        await anext(generation)

    asyncio.run(run())  # the generation goes out of scope mid-request
    gc.collect()
    _idle(engine)
    assert engine.endings.reasons == ["abort"]


def test_a_failed_request_raises_for_its_caller_only(engine, monkeypatch):
    real = model_runner.sample_rows

    def fail_victim(logits, specs):
        result = real(logits, specs)
        for row, spec in enumerate(specs):
            if spec.sampling_params.top_k == 99:
                result.failures[row] = "injected"
        return result

    monkeypatch.setattr(model_runner, "sample_rows", fail_victim)

    async def run() -> tuple[BaseException | None, int]:
        victim, other = engine.generation(), engine.generation()
        victim.add([1, 2, 3], [SamplingParams(max_tokens=20, top_k=99, ignore_eos=True)])
        other.add([4, 5, 6], [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)])
        error = None
        try:
            async for _ in victim:
                pass
        except RequestFailedError as exc:
            error = exc
        tokens = sum([len(update.new_token_ids) async for _, update in other])
        return error, tokens

    error, tokens = asyncio.run(run())
    assert str(error) == "injected" and tokens == 20
    _idle(engine)


def test_an_engine_thread_that_dies_fails_every_caller_and_refuses_new_work(engine, tiny_llm, monkeypatch):
    resume = threading.Event()
    stepping = threading.Event()
    real_step = tiny_llm.engine.step

    def step():
        if resume.is_set():
            raise Panic("injected panic")
        stepping.set()
        resume.wait(10)
        return real_step()

    monkeypatch.setattr(tiny_llm.engine, "step", step)

    async def run() -> list[BaseException]:
        running = engine.generation()
        running.add([1, 2, 3], [LONG])
        await asyncio.to_thread(stepping.wait, 10)
        waiting = engine.generation()  # still in the inbox when the engine dies
        waiting.add([4, 5, 6], [LONG])
        resume.set()
        errors = []
        for generation in (running, waiting):
            try:
                async with asyncio.timeout(10):
                    async for _ in generation:
                        pass
            except EngineDeadError as exc:
                errors.append(exc)
        return errors

    errors = asyncio.run(run())
    assert len(errors) == 2
    assert not engine.is_alive and isinstance(engine.dead, Panic)
    # The engine thread fails the callers first and reports its death after: it may still be on its way.
    deadline = time.monotonic() + 10
    while not engine.deaths and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [type(d) for d in engine.deaths] == [Panic]

    async def submit_after_death() -> None:
        engine.generation().add([1], [LONG])

    with pytest.raises(EngineDeadError):
        asyncio.run(submit_after_death())


def test_a_call_runs_on_the_engine_thread_between_steps(engine):
    """AsyncEngine.call: the function's result or exception comes back to the caller, it runs on the
    engine thread, a request in flight keeps going, and after the engine dies a call is refused."""

    async def run() -> None:
        generation = engine.generation()
        generation.add([1, 2, 3], [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)])
        where = await engine.call(lambda core: (threading.current_thread().name, len(core.scheduler.running)))
        assert where[0] == "folio-engine"
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda core: 1 / 0)
        finished = [update async for _, update in generation if update.finished]
        assert finished and finished[0].finish_reason == "length"

    asyncio.run(run())
    engine.shutdown()

    async def after_shutdown() -> None:
        engine.dead = RuntimeError("stopped")  # as the engine thread records its death
        await engine.call(lambda core: None)

    with pytest.raises(EngineDeadError):
        asyncio.run(after_shutdown())
