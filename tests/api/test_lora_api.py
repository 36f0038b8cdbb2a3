"""LoRA adapters behind `folio serve`, met through the official openai client and vLLM's adapter routes: a
request names an adapter as its model and gets what the engine gives offline with that adapter; adapters
load and unload at run time; what cannot be served is a 4xx and the server keeps serving."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import openai
import pytest

from folio import LLM, LoRARequest, SamplingParams
from folio.server.adapters import LoRAModule
from folio.server.serve import ServerOptions
from tests.api.server_runner import free_port, read_until, running_server
from tests.tiny_models import make_lora_adapter, make_tiny_chat_model

pytest.importorskip("peft")
BASE = "tiny"
PROMPT = "t5 t17 t42 t8"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> tuple[str, list[str]]:
    root = tmp_path_factory.mktemp("lora-api")
    folder = make_tiny_chat_model(root / "base")
    return str(folder), [make_lora_adapter(folder, root / f"adapter{i}", seed=20 + i) for i in range(3)]


@pytest.fixture(scope="module")
def llm(adapters) -> LLM:
    return LLM(adapters[0], enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=128)


@pytest.fixture(scope="module")
def expected(llm, adapters) -> dict[str | None, str]:
    """Each adapter's greedy answer offline (and the base model's), before any server runs."""
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    answers = {}
    for name, path in ((None, None), ("first", adapters[1][0]), ("second", adapters[1][1]), ("late", adapters[1][2])):
        request = LoRARequest(name, path) if name else None
        answers[name] = llm.generate([PROMPT], greedy, use_tqdm=False, lora_request=request)[0].outputs[0].text
    llm.engine.remove_lora("late")  # loaded at run time below
    return answers


@pytest.fixture(scope="module")
def server(llm, adapters, expected):
    options = ServerOptions(lora_modules=[LoRAModule("first", adapters[1][0]), LoRAModule("second", adapters[1][1])],
                            runtime_lora=True)  # fmt: skip
    with running_server(llm, BASE, options) as (url, _):
        yield url


def _answer(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.model == model
    return reply.choices[0].text


def test_adapters_are_listed_with_their_parent_and_answer_as_offline(server, expected):
    listed = {m.id: m for m in openai.OpenAI(base_url=f"{server}/v1", api_key="unused").models.list().data}
    assert set(listed) == {BASE, "first", "second"}
    assert listed["first"].model_extra["parent"] == BASE and "parent" not in listed[BASE].model_extra
    assert _answer(server, "first") == expected["first"]
    assert _answer(server, "second") == expected["second"]
    assert _answer(server, BASE) == expected[None]
    assert expected["first"] != expected[None]  # the adapter changes the answer


def test_adapters_load_and_unload_at_run_time(server, expected, adapters):
    loaded = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters[1][2]})
    assert loaded.status_code == 200 and "added" in loaded.text
    assert _answer(server, "late") == expected["late"]
    unloaded = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert unloaded.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _answer(server, "late")
    again = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert again.status_code == 404


def test_an_adapter_that_cannot_be_served_is_a_400_and_the_server_keeps_serving(server, expected, tmp_path):
    missing = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    clash = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": str(tmp_path)})
    assert clash.status_code == 400
    unknown = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora_path"
    assert _answer(server, "first") == expected["first"]


def test_folio_serve_engine_process_serves_adapters_too(adapters, expected):
    """`--engine-process`: the adapters given at start and those loaded at run time reach the engine's own
    process over its wire, and answer as offline."""
    base, paths = adapters
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "folio.cli", "serve", base, "--port", str(port),
                                "--engine-process", "--num-kv-blocks", "128", "--max-loras", "2",
                                "--max-lora-rank", "8", "--lora-modules", f"first={paths[0]}", "--runtime-lora"],
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        assert "engine in process" in read_until(process.stderr, "serving", lines)
        assert _answer(url, "first") == expected["first"]
        assert _answer(url, base) == expected[None]
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths[2]})
        assert loaded.status_code == 200
        assert _answer(url, "late") == expected["late"]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        broken = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": base})
        assert broken.status_code == 400 and "adapter_config.json" in broken.json()["error"]["message"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        stderr = "".join(lines) + process.communicate()[1]
    assert "Traceback" not in stderr, stderr
