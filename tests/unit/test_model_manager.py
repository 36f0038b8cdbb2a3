"""The many-model server's bookkeeping without engines: which names it serves, Ollama's keep_alive
values, and the manager's loads, least-recently-used unloads, waits and idle unloads, with a stand-in
for the engine process (tests/api/test_many_models.py runs the real thing)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from folio import platform
from folio.engine_args import EngineArgs
from folio.lora.adapter import LoRARequest
from folio.platform import default_kv_cache_memory
from folio.server.adapters import AdapterTable
from folio.server.admission import Admission
from folio.server.created_models import CreatedModels, ModelPreset
from folio.server.engine_starts import tokenizer_key
from folio.server.errors import APIError
from folio.server.metrics import MergedEngineMetrics
from folio.server.model_budget import ManagerOptions
from folio.server.model_manager import ModelManager
from folio.server.model_sources import ModelSources, parse_spec, scan_folder
from folio.server.served_models import keep_alive_seconds


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3), ("10", 10.0), (" 2.5s ", 2.5), (0, 0.0), ("0", 0.0),
     (90, 90.0), (-1, None), ("-1m", None), ("-1", None)],
)  # fmt: skip
def test_keep_alive_takes_ollamas_durations(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["", "5 minutes", "m", "5x", "1h 30m", True, float("inf"), "nan"])
def test_keep_alive_refuses_what_ollama_would(value):
    with pytest.raises(ValueError, match="keep_alive"):
        keep_alive_seconds(value)


def test_names_from_specs_and_aliases(tmp_path):
    assert parse_spec("smollm2-135m").name == "smollm2-135m"
    assert parse_spec(str(tmp_path / "Tiny-Q4.gguf")).name == "Tiny-Q4"
    assert parse_spec(str(tmp_path / "my-folder")).name == "my-folder"
    aliased = parse_spec(f"writer={tmp_path / 'x.gguf'}")
    assert (aliased.name, aliased.spec) == ("writer", str(tmp_path / "x.gguf"))
    odd = str(tmp_path / "a=b" / "m.gguf")  # an '=' inside a path is no alias
    assert parse_spec(odd).spec == odd
    with pytest.raises(ValueError, match="two models would be served as m"):
        ModelSources([str(tmp_path / "one" / "m.gguf"), str(tmp_path / "two" / "m.gguf")])


def test_a_models_folder_is_read_again_at_each_lookup(tmp_path):
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / ".hidden.gguf").write_bytes(b"GGUF")
    (tmp_path / "hf-model").mkdir()
    (tmp_path / "hf-model" / "config.json").write_text("{}")
    (tmp_path / "with-companions").mkdir()
    (tmp_path / "with-companions" / "weights.gguf").write_bytes(b"GGUF")
    (tmp_path / "empty").mkdir()
    assert [s.name for s in scan_folder(tmp_path)] == ["b", "hf-model", "with-companions"]
    sources = ModelSources([f"b={tmp_path / 'hf-model'}"], tmp_path)
    assert sources.available()["b"].spec == str(tmp_path / "hf-model")  # the command line's name wins
    assert sources.find("a") is None
    (tmp_path / "a.gguf").write_bytes(b"GGUF")  # copied in while serving
    assert sources.find("a:latest").spec == str(tmp_path / "a.gguf")
    with pytest.raises(ValueError, match="no such folder"):
        ModelSources([], tmp_path / "absent")


TOKENS_TYPE = "# TYPE folio:generation_tokens_total counter"


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid


class FakeEngine:
    """What the manager reads of a ProcessEngine."""

    def __init__(self, name: str, load_seconds: float, gate: threading.Event | None) -> None:
        if gate is not None:
            assert gate.wait(10)
        time.sleep(load_seconds)
        self.name, self.alive, self.stopped = name, True, False
        self.process = FakeProcess(1000 + len(name))
        self.info = None
        self.adapters: dict[str, str] = {}  # LoRA adapters registered in this engine

    @property
    def is_alive(self) -> bool:
        return self.alive and not self.stopped

    def shutdown(self) -> None:
        self.stopped = True

    def metrics_text(self) -> str:
        return f'{TOKENS_TYPE}\nfolio:generation_tokens_total{{model_name="{self.name}"}} 1.0\n'

    async def add_lora(self, request: LoRARequest) -> None:
        if "broken" in request.path:
            raise ValueError(f"{request.path} does not fit this model")
        self.adapters[request.name] = request.path

    async def remove_lora(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None


@dataclass
class FakeTokenizer:
    chat_template: str | None = "{{ messages[0].content }}"


@dataclass
class FakeContext:
    model_name: str
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    admission: Admission = field(default_factory=lambda: Admission(4, 0))
    model_card: None = None
    lora_name: str | None = None
    preset: ModelPreset | None = None


class Manager(ModelManager):
    def __init__(
        self, folder: Path, names: list[str], options: ManagerOptions, load_seconds: float = 0.0,
        adapters: AdapterTable | None = None,
    ) -> None:  # fmt: skip
        for name in names:
            (folder / f"{name}.gguf").write_bytes(b"GGUF")
        super().__init__(ModelSources([], folder), EngineArgs(), lambda e, i, n: FakeContext(n), options, adapters,
                         CreatedModels(folder / ".created"))  # fmt: skip
        self.load_seconds = load_seconds
        self.gates: dict[str, threading.Event] = {}
        self.sizes: dict[str, int] = {}
        self.engines: list[FakeEngine] = []

    def estimate_bytes(self, source, args) -> int:
        return self.sizes.get(source.name, 1)

    def _start_engine(self, args: EngineArgs, name: str) -> FakeEngine:
        engine = FakeEngine(name, self.load_seconds, self.gates.get(name))
        self.engines.append(engine)
        return engine

    def loaded(self) -> list[str]:
        return sorted(s.name for s in self.statuses() if s.loaded and s.parent is None)  # models, not adapters


def run(coroutine):
    return asyncio.run(coroutine)


def test_least_recently_used_idle_model_goes_first(tmp_path):
    async def scenario():
        manager = Manager(tmp_path, ["a", "b", "c"], ManagerOptions(max_loaded=2))
        for name in ("a", "b", "a", "c"):  # b is now the least recently used
            async with manager.use(name) as ctx:
                assert ctx.model_name == name
        assert manager.loaded() == ["a", "c"]
        await manager.stops_done()  # b's engine stops on a thread while c loads
        assert [e.name for e in manager.engines if e.stopped] == ["b"]
        async with manager.use("b:latest"):
            pass
        assert manager.loaded() == ["b", "c"]
        manager.shutdown()
        assert all(e.stopped for e in manager.engines)

    run(scenario())


def test_a_busy_model_is_never_unloaded_and_a_load_waits_for_room(tmp_path):
    async def scenario():
        manager = Manager(tmp_path, ["a", "b"], ManagerOptions(max_loaded=1, room_timeout=5))
        async with manager.use("a") as ctx:
            held = ctx.admission.reserve(1)  # a request of a's, admitted and running
        waiting = asyncio.ensure_future(manager.use("b").__aenter__())
        await asyncio.sleep(0.5)
        assert not waiting.done() and manager.loaded() == ["a"]
        assert [s.state for s in manager.statuses()] == ["loaded", "loading"]
        held.release()  # a's request ends: a is idle, so it makes way
        ctx_b = await asyncio.wait_for(waiting, 5)
        assert ctx_b.model_name == "b" and manager.loaded() == ["b"]
        manager.shutdown()

    run(scenario())


def test_every_model_busy_past_the_wait_is_a_503_with_retry_after(tmp_path):
    async def scenario():
        manager = Manager(tmp_path, ["a", "b"], ManagerOptions(max_loaded=1, room_timeout=0.3))
        async with manager.use("a"):
            with pytest.raises(APIError) as busy:
                async with manager.use("b"):
                    pass
        assert busy.value.status == 503 and busy.value.headers["Retry-After"]
        assert manager.loaded() == ["a"]  # the waiting load gave its place back
        async with manager.use("b"):
            pass
        manager.shutdown()

    run(scenario())


def test_requests_awaiting_one_load_share_it_and_no_other_load_takes_it_away(tmp_path):
    async def scenario():
        manager = Manager(tmp_path, ["a", "b"], ManagerOptions(max_loaded=1, room_timeout=5))
        manager.gates["a"] = threading.Event()
        uses = [manager.use("a"), manager.use("a")]
        entered = [asyncio.ensure_future(use.__aenter__()) for use in uses]
        other = asyncio.ensure_future(manager.use("b").__aenter__())  # waits: a is claimed from its arrival
        await asyncio.sleep(0.2)
        manager.gates["a"].set()
        await asyncio.wait_for(asyncio.gather(*entered), 5)
        assert sum(e.name == "a" for e in manager.engines) == 1  # one load for both
        await asyncio.sleep(0.5)
        assert not other.done() and manager.loaded() == ["a"]
        for use in uses:  # both callers done
            await use.__aexit__(None, None, None)
        await asyncio.wait_for(other, 5)
        assert manager.loaded() == ["b"]
        manager.shutdown()

    run(scenario())


def test_idle_models_unload_after_their_keep_alive(tmp_path):
    async def scenario():
        manager = Manager(tmp_path, ["a", "b", "c"], ManagerOptions(max_loaded=3, keep_alive=0.5))
        async with manager.use("a"):
            pass
        async with manager.use("b", keep_alive=-1):  # kept for good
            pass
        async with manager.use("c", keep_alive="0"):  # unloaded once done
            pass
        await asyncio.sleep(0.3)
        assert manager.loaded() == ["a", "b"]
        await asyncio.sleep(0.6)
        assert manager.loaded() == ["b"]
        with pytest.raises(APIError) as bad:
            async with manager.use("b", keep_alive="soon"):
                pass
        assert bad.value.status == 400 and bad.value.param == "keep_alive"
        manager.shutdown()

    run(scenario())


def test_a_dead_engine_is_dropped_and_loaded_again(tmp_path):
    async def scenario():
        manager = Manager(tmp_path, ["a"], ManagerOptions(max_loaded=1))
        async with manager.use("a"):
            pass
        manager.engines[0].alive = False  # killed
        await asyncio.sleep(0.5)
        assert manager.loaded() == []
        async with manager.use("a"):
            pass
        assert len(manager.engines) == 2 and manager.loaded() == ["a"]
        manager.shutdown()

    run(scenario())


def test_names_no_model_serves_and_an_unnamed_request_needs_one_model(tmp_path):
    async def scenario():
        manager = Manager(tmp_path, ["a", "b"], ManagerOptions())
        with pytest.raises(APIError) as unknown:
            async with manager.use("c"):
                pass
        assert unknown.value.status == 404 and "'a', 'b'" in unknown.value.message
        with pytest.raises(APIError, match="name one"):
            async with manager.use(None):
                pass
        async with manager.use("a"):
            pass
        async with manager.use(None) as ctx:  # the only one loaded
            assert ctx.model_name == "a"
        manager.shutdown()

    run(scenario())


def test_metrics_hold_each_family_once_with_every_loaded_models_samples(tmp_path):
    async def scenario():
        manager = Manager(tmp_path, ["a", "b"], ManagerOptions())
        for name in ("a", "b"):
            async with manager.use(name):
                pass
        registry = CollectorRegistry()
        registry.register(MergedEngineMetrics(manager.metrics_texts, manager.admissions))
        text = generate_latest(registry).decode()
        manager.shutdown()
        return text

    text = run(scenario())
    assert text.count(TOKENS_TYPE) == 1
    for name in ("a", "b"):
        assert f'folio:generation_tokens_total{{model_name="{name}"}} 1.0' in text
        assert f'folio:num_requests_admitted{{model_name="{name}"}} 0.0' in text


def test_the_memory_budget_unloads_to_fit_and_refuses_a_model_larger_than_it(tmp_path):
    async def scenario():
        manager = Manager(tmp_path, ["a", "b", "c", "huge"], ManagerOptions(max_loaded=3, memory_budget=10))
        manager.sizes.update(a=4, b=4, c=5, huge=11)
        for name in ("a", "b"):
            async with manager.use(name):
                pass
        assert manager.loaded() == ["a", "b"]  # 8 of 10
        async with manager.use("c"):  # 5 more: a (least recently used) makes way
            pass
        assert manager.loaded() == ["b", "c"]
        with pytest.raises(APIError) as refused:
            async with manager.use("huge"):
                pass
        assert refused.value.status == 500 and refused.value.code == "insufficient_memory"
        assert manager.loaded() == ["b", "c"]  # nothing unloaded for a model that can never fit
        manager.shutdown()

    run(scenario())


@pytest.mark.parametrize("free", [16 << 30, 2 << 30])
def test_a_models_default_kv_pool_is_its_share_of_the_budget(tmp_path, monkeypatch, free):
    # Free memory as read now, held still: the suite's other processes change it between two readings.
    monkeypatch.setattr(platform, "available_memory", lambda device: free)
    manager = Manager(tmp_path, ["a"], ManagerOptions(max_loaded=2, memory_budget=4 << 30))
    source = manager.sources.find("a")
    share = manager.engine_args(source).kv_cache_memory
    # Half the budget over 2 models, or the engine's own default (a quarter of free memory) if smaller.
    assert share == min(default_kv_cache_memory(torch.device("cpu")), 1 << 30) == min(free // 4, 1 << 30)
    assert manager.engine_args(source).model == source.spec
    manager.base_args = EngineArgs(kv_cache_memory="64MiB")
    assert manager.engine_args(source).kv_cache_memory == "64MiB"  # a pool the user sized stays as it is
    manager.shutdown()


def test_a_kept_tokenizer_is_keyed_by_its_files_versions(tmp_path):
    """A model loaded again reuses the tokenizer kept from its last load only while the files it was read
    from are unchanged."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text('{"chat_template": "a"}')
    first = tokenizer_key(str(folder))
    assert first is not None and tokenizer_key(str(folder)) == first
    (folder / "tokenizer_config.json").write_text('{"chat_template": "bb"}')
    assert tokenizer_key(str(folder)) != first
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert tokenizer_key(str(gguf))[1][0][0] == "m.gguf"
    assert tokenizer_key(str(tmp_path / "absent.gguf")) is None and tokenizer_key("hf:org/repo") is None
