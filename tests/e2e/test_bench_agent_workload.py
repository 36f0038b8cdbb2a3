"""`folio bench serve --dataset agent`: multi-turn conversations behind one shared system prompt, and the KV
tiers' counters a run reports (over test_bench_prefix_workloads' small ShareGPT file and a tiny chat model)."""

from __future__ import annotations

import json

import pytest
from folio_tools.bench.harness.datasets import LengthRange
from folio_tools.bench.serve.workload import build_serve_requests, load_tokenizer

from folio.cli import main
from tests.api.server_runner import running_server
from tests.e2e.test_bench_prefix_workloads import MODEL, write_sharegpt
from tests.tiny_models import make_tiny_chat_model

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("peaks_measured_once")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("agent") / "llama")


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory):
    return write_sharegpt(tmp_path_factory.mktemp("sharegpt") / "sharegpt.json")


def test_agent_requests_put_one_shared_system_prompt_before_each_conversation(tiny_llama, sharegpt):
    tokenizer = load_tokenizer(str(tiny_llama), explicit=True)
    common = (tokenizer, 3, LengthRange(1, 500), LengthRange(2, 9), 0, str(sharegpt))
    agent = build_serve_requests("agent", *common, turns=3, document_len=40)
    plain = build_serve_requests("multi-turn", *common, turns=3).requests
    system = agent.requests[0].messages[0]
    assert system["role"] == "system" and agent.facts == {"conversations": 3, "turns": 3, "system_prompt_tokens": 40}
    for ours, theirs in zip(agent.requests, plain, strict=True):
        assert ours.messages == [system, *theirs.messages] and ours.prompt_len == theirs.prompt_len + 40
        assert (ours.conversation, ours.turn, ours.prompt) == (theirs.conversation, theirs.turn, theirs.prompt)


def test_agent_run_reports_blocks_the_ram_tier_gave_back(tiny_llama, sharegpt, tmp_path, capsys):
    from folio import LLM

    # A pool of 8 blocks holds about one conversation: its history is evicted while the others run.
    llm = LLM(tiny_llama, num_kv_blocks=8, kv_offload_ram="8MiB")
    with running_server(llm, MODEL) as (url, _):
        code = main([
            "bench", "serve", "--base-url", url, "--model", MODEL, "--tokenizer", str(tiny_llama),
            "--dataset", "agent", "--dataset-path", str(sharegpt), "--turns", "3", "--num-prompts", "3",
            "--document-len", "40", "--input-len-range", "1:500", "--output-len-range", "2:4",
            "--output-dir", str(tmp_path),
        ])  # fmt: skip
    assert code == 0
    [json_path] = tmp_path.glob("*.json")
    [result] = json.loads(json_path.read_text())["results"]
    assert result["completed"] == 9 and result["kv_tiers"]["ram_loaded_blocks"] > 0
    assert "RAM-tier hit blocks" in capsys.readouterr().out


def test_with_history_from_replies_each_turn_carries_the_servers_earlier_answers(monkeypatch):
    import asyncio
    import math

    import httpx
    from folio_tools.bench.serve import client as serve_client
    from folio_tools.bench.serve.client import ServeRequest, Target, run_rate

    bodies: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        answer = f"reply to {body['messages'][-1]['content']}"
        chunks = [{"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                  for piece in (answer[:5], answer[5:])]  # fmt: skip
        events = [*chunks, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode())

    monkeypatch.setattr(
        serve_client, "make_client", lambda *_: httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    texts = ["system", "user 0", "answer 0", "user 1", "answer 1", "user 2"]
    requests = [
        ServeRequest(
            texts[2 * k + 1],
            1,
            2,
            conversation=0,
            turn=k,
            messages=[{"role": "system", "content": "system"}]
            + [
                {"role": "user" if j % 2 == 0 else "assistant", "content": t}
                for j, t in enumerate(texts[1 : 2 * k + 2])
            ],
        )  # fmt: skip
        for k in range(3)
    ]
    target = Target("http://test", "m", chat=True, include_usage=False)
    records, _ = asyncio.run(run_rate(target, requests, math.inf, 0, None, use_tqdm=False, replies_as_history=True))
    assert all(r.success for r in records), [r.error for r in records]
    assert [[m["content"] for m in body["messages"]] for body in bodies] == [
        ["system", "user 0"],
        ["system", "user 0", "reply to user 0", "user 1"],
        ["system", "user 0", "reply to user 0", "user 1", "reply to user 1", "user 2"],
    ]
