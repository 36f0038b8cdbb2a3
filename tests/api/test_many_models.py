"""`folio serve A B C`: several models behind one URL, each loaded in an engine process of its own when a
request first names it, met through the official openai and ollama clients.

One server for the file: the two catalog models and a tiny chat model, at most two loaded at once. The
tests run in order and each says what it leaves loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import psutil
import pytest

from folio import LLM, LoRARequest, SamplingParams
from folio.paths import folio_home
from tests.api.server_runner import MODEL, ServeProcess
from tests.tiny_models import make_lora_adapter, make_tiny_chat_model

GEMMA = "gemma3-270m"
TINY = "tiny"
TINY_SQL = "tiny-sql"  # a LoRA adapter on tiny
MARIO = "folio-test-mario"  # a model the tests create (in folio's home) and delete


class ManyModelServer(ServeProcess):
    def engine_pid(self, name: str) -> int:
        """The engine process of `name`'s latest load, from the server's log."""
        pids = re.findall(rf"loaded {re.escape(name)} in [\d.]+ s \(engine in process (\d+)\)", self.output())
        assert pids, self.output()[-3000:]
        return int(pids[-1])

    def states(self) -> dict[str, str]:
        listing = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        return {entry["id"]: entry["status"]["value"] for entry in listing}

    def loaded(self) -> set[str]:
        """The loaded models (not their adapters)."""
        listing = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        return {entry["id"] for entry in listing if entry["status"]["value"] == "loaded" and "parent" not in entry}

    def wait_for_loaded(self, expected: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (now := self.loaded()) != expected:
            assert time.monotonic() < deadline, f"loaded: {now}, expected {expected}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("many") / "tiny-chat"))


@pytest.fixture(scope="module")
def tiny_adapters(tiny_chat, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("many-lora")
    return [make_lora_adapter(Path(tiny_chat), root / f"adapter{i}", seed=40 + i) for i in range(2)]


@pytest.fixture(scope="module")
def many(smollm2_gguf, gemma3_gguf, tiny_chat, tiny_adapters) -> Iterator[ManyModelServer]:
    for leftover in (MARIO, f"{MARIO}-copy"):  # from a run that died before deleting them
        shutil.rmtree(folio_home() / "created" / leftover, ignore_errors=True)
    sql = json.dumps({"name": TINY_SQL, "path": tiny_adapters[0], "base_model_name": TINY})
    server = ManyModelServer(MODEL, GEMMA, f"{TINY}={tiny_chat}", "--max-loaded-models", "2", "--keep-alive", "10m",
                             "--num-kv-blocks", "64", "--lora-modules", sql, "--runtime-lora",
                             "--max-lora-rank", "8")  # fmt: skip
    try:
        server.wait_ready(timeout=120)
        yield server
    finally:
        server.process.send_signal(signal.SIGTERM)
        try:
            assert server.process.wait(60) == 0, server.output()[-3000:]
        finally:
            if server.process.poll() is None:
                server.process.kill()


@pytest.fixture(scope="module")
def many_client(many) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{many.url}/v1", api_key="unused", max_retries=0, timeout=180)


def _text(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 12) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def test_every_model_is_listed_and_none_is_loaded_before_a_request(many):
    assert many.states() == {MODEL: "unloaded", GEMMA: "unloaded", TINY: "unloaded", TINY_SQL: "unloaded"}
    tags = ollama.Client(host=many.url).list()
    assert sorted(m.model for m in tags.models) == sorted([MODEL, GEMMA, TINY, TINY_SQL])
    by_name = {m.model: m for m in tags.models}
    assert by_name[MODEL].details.family == "llama" and by_name[GEMMA].details.family == "gemma3"
    assert ollama.Client(host=many.url).ps().models == []


def test_each_catalog_model_answers_as_it_does_alone(many, many_client, client, gemma3_gguf):
    """smollm2 as the single-model server answers; gemma3 as the engine alone does. Both stay loaded."""
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        assert _text(many_client, MODEL, prompt) == _text(client, MODEL, prompt)
    messages = [{"role": "user", "content": "Name three colours."}]
    ours = many_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    theirs = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    alone = LLM(gemma3_gguf, num_kv_blocks=64).generate(
        ["The capital of France is"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )
    assert _text(many_client, GEMMA, "The capital of France is") == alone[0].outputs[0].text
    assert many.loaded() == {MODEL, GEMMA}
    running = {m.model: m for m in ollama.Client(host=many.url).ps().models}
    assert set(running) == {MODEL, GEMMA} and all(m.size > 0 for m in running.values())


def test_loading_a_model_does_not_stall_anothers_stream(many, many_client):
    """While tiny loads (unloading gemma3, the least recently used), smollm2's stream keeps its pace: no gap
    between its tokens comes near the load's length."""
    gaps: list[float] = []
    started = threading.Event()

    def stream() -> None:
        last = None
        chunks = many_client.completions.create(model=MODEL, prompt="Count slowly:", max_tokens=150, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        for _ in chunks:
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            started.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert started.wait(60)
    load_start = time.monotonic()
    ollama.Client(host=many.url).generate(model=TINY)  # Ollama's load-only request
    load_seconds = time.monotonic() - load_start
    streaming.join(120)
    assert len(gaps) == 149
    # A load starts a process that imports torch (seconds): a stalled event loop would show a gap that long.
    assert max(gaps) < max(1.5, load_seconds / 2), (max(gaps), load_seconds)
    assert many.loaded() == {MODEL, TINY}


def test_keep_alive_unloads_idle_models_and_ollama_stop_unloads_at_once(many):
    olla = ollama.Client(host=many.url)
    olla.generate(model=TINY, prompt="t1 t2", options={"num_predict": 2}, keep_alive="1s")
    many.wait_for_loaded({MODEL}, timeout=10)  # about a second after its request ended
    stopped = olla.generate(model=MODEL, keep_alive=0)  # what `ollama stop` sends
    assert stopped.done_reason == "unload"
    assert many.loaded() == set()


def test_a_killed_engine_fails_only_its_own_requests_and_loads_again(many, many_client):
    assert _text(many_client, TINY, "t1 t2 t3", max_tokens=4)
    assert _text(many_client, MODEL, "Hello", max_tokens=2)
    victim = many.engine_pid(TINY)
    failures: list[BaseException] = []
    started = threading.Event()

    def doomed() -> None:
        try:
            for _ in many_client.completions.create(model=TINY, prompt="t1", max_tokens=3000, stream=True,
                                                    extra_body={"ignore_eos": True}):  # fmt: skip
                started.set()
        except openai.APIError as exc:
            failures.append(exc)

    thread = threading.Thread(target=doomed)
    thread.start()
    assert started.wait(60)
    os.kill(victim, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive() and failures  # its stream ended with an error
    assert _text(many_client, MODEL, "Hello", max_tokens=2)  # the other model never noticed
    assert _text(many_client, TINY, "t1 t2 t3", max_tokens=4)  # loaded anew
    assert many.engine_pid(TINY) != victim and not psutil.pid_exists(victim)


def test_adapters_run_on_their_base_model_and_come_back_with_it(many, many_client, tiny_chat, tiny_adapters):
    """An adapter given at start and one loaded at run time (vLLM's route, with the base named) answer as
    offline; unloaded and loaded again, the base model brings its adapters back."""
    offline = LLM(tiny_chat, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def alone(adapter: int | None) -> str:
        request = None if adapter is None else LoRARequest(f"a{adapter}", tiny_adapters[adapter])
        return offline.generate(["t1 t2 t3"], greedy, use_tqdm=False, lora_request=request)[0].outputs[0].text

    def ours(model: str) -> str:
        return many_client.completions.create(model=model, prompt="t1 t2 t3", max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip

    assert ours(TINY_SQL) == alone(0) != alone(None)
    assert ours(TINY) == alone(None)
    body = {"lora_name": "tiny-chat-lora", "lora_path": tiny_adapters[1]}
    unnamed = httpx.post(f"{many.url}/v1/load_lora_adapter", json=body, timeout=60)
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "base_model_name"
    loaded = httpx.post(f"{many.url}/v1/load_lora_adapter", json={**body, "base_model_name": TINY}, timeout=60)
    assert loaded.status_code == 200
    assert ours("tiny-chat-lora") == alone(1)
    assert many.states()["tiny-chat-lora"] == "loaded"
    httpx.post(f"{many.url}/models/unload", json={"model": TINY}, timeout=30)
    many.wait_for_loaded({MODEL}, timeout=10)
    assert many.states()[TINY_SQL] == "unloaded"
    assert ours("tiny-chat-lora") == alone(1)  # tiny loaded again, with both its adapters
    assert ours(TINY_SQL) == alone(0)
    assert httpx.post(f"{many.url}/v1/unload_lora_adapter", json={"lora_name": "tiny-chat-lora"}).status_code == 200
    assert "tiny-chat-lora" not in many.states()


def test_ollama_create_copy_show_and_delete_a_model_made_from_another(many, tiny_adapters):
    """`ollama create` with the official client: an adapter uploaded as blobs, a system prompt and default
    options on tiny. The created model answers as tiny with that adapter, system prompt and options do;
    /api/show writes its Modelfile back; a copy answers alike; deleted, both are gone with their files."""
    olla = ollama.Client(host=many.url)
    folder = Path(tiny_adapters[0])
    digests = {name: olla.create_blob(folder / name) for name in ("adapter_config.json", "adapter_model.safetensors")}
    try:
        assert httpx.head(f"{many.url}/api/blobs/{digests['adapter_config.json']}").status_code == 200
        wrong = httpx.post(f"{many.url}/api/blobs/sha256:{'0' * 64}", content=b"not these bytes")
        assert wrong.status_code == 400 and "digest" in wrong.json()["error"]
        assert httpx.head(f"{many.url}/api/blobs/sha256:{'0' * 64}").status_code == 404
        olla.create(model=MARIO, from_=TINY, adapters=digests, system="t7 t8",
                    parameters={"temperature": 0, "num_predict": 5})  # fmt: skip
        question = [{"role": "user", "content": "t1 t2 t3"}]
        ours = olla.chat(model=MARIO, messages=question)
        theirs = olla.chat(model=TINY_SQL, messages=[{"role": "system", "content": "t7 t8"}, *question],
                           options={"temperature": 0, "num_predict": 5})  # fmt: skip
        assert ours.message.content == theirs.message.content and ours.eval_count == 5
        assert ours.prompt_eval_count == theirs.prompt_eval_count  # its system prompt went in
        shown = olla.show(MARIO)
        assert shown.modelfile.startswith(f"FROM {TINY}\nADAPTER ") and "PARAMETER num_predict 5" in shown.modelfile
        olla.copy(MARIO, f"{MARIO}-copy")
        assert olla.chat(model=f"{MARIO}-copy", messages=question).message.content == ours.message.content
        assert {MARIO, f"{MARIO}-copy"} <= {m.model for m in olla.list().models}
    finally:
        for name in (MARIO, f"{MARIO}-copy"):
            httpx.request("DELETE", f"{many.url}/api/delete", json={"model": name}, timeout=30)
        for digest in digests.values():
            (folio_home() / "blobs" / digest.replace(":", "-")).unlink(missing_ok=True)
    assert not {MARIO, f"{MARIO}-copy"} & {m.model for m in olla.list().models}
    assert not (folio_home() / "created" / MARIO).exists()


def test_load_unload_routes_and_metrics_by_model(many, many_client):
    assert httpx.post(f"{many.url}/models/unload", json={"model": TINY}, timeout=30).json() == {"success": True}
    many.wait_for_loaded({MODEL}, timeout=10)
    assert httpx.post(f"{many.url}/models/load", json={"model": TINY}, timeout=180).json() == {"success": True}
    assert many.loaded() == {MODEL, TINY}
    text = httpx.get(f"{many.url}/metrics", timeout=30).text
    assert text.count("# TYPE folio:generation_tokens_total counter") == 1
    assert f'folio:generation_tokens_total{{model_name="{MODEL}"}}' in text
    assert f'folio:num_requests_admitted{{model_name="{TINY}"}} 0.0' in text


def test_unknown_models_get_each_apis_404_and_the_server_keeps_serving(many, many_client):
    with pytest.raises(openai.NotFoundError) as missing:
        many_client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found" and MODEL in missing.value.body["message"]
    with pytest.raises(ollama.ResponseError) as olla_missing:
        ollama.Client(host=many.url).chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}])
    assert olla_missing.value.status_code == 404
    loading = httpx.post(f"{many.url}/models/load", json={"model": "nope"}, timeout=10)
    assert loading.status_code == 404 and loading.json()["error"]["code"] == "model_not_found"
    assert _text(many_client, f"{MODEL}:latest", "Hello", max_tokens=2)  # Ollama's tag, in any API
