"""`folio run-batch`: an OpenAI batch file in, the batch output format out, every answer the one the
server gives the same request (the shared server is the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from folio.cli import main
from tests.api.server_runner import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
SEEDED = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.9, "seed": 3, "n": 2}


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_batch_file_gets_the_servers_answers_in_order(tmp_path: Path, smollm2_gguf: Path, client: openai.OpenAI,
                                                        capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    lines = [_line(f"chat-{i}", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": f"Hi {i}"}]})
             for i in range(6)]  # fmt: skip
    lines += [
        _line("completion", "/v1/completions", COMPLETION),
        _line("seeded", "/v1/completions", SEEDED),
        _line("embedding", "/v1/embeddings", {"model": MODEL, "input": ["hello", "world"]}),
        _line("response", "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 5, "temperature": 0}),
        _line("bad-body", "/v1/chat/completions", {**CHAT, "temperature": 9}),
        _line("streaming", "/v1/chat/completions", {**CHAT, "stream": True}),
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/models", "body": {}}),
        "{not json",
    ]
    source, target = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    # By its catalog name (pulled by the fixture), the name the bodies carry.
    code = main(["run-batch", MODEL, "-i", str(source), "-o", str(target), "--kv-cache-memory", "64MiB",
                 "--max-num-seqs", "4"])  # fmt: skip
    assert code == 0
    assert "14 requests: 10 answered, 1 answered with an error, 3 not requests" in capsys.readouterr().err
    out = [json.loads(line) for line in target.read_text().splitlines()]
    assert [o["custom_id"] for o in out[:-1]] == [json.loads(line)["custom_id"] for line in lines[:-1]]
    assert len({o["id"] for o in out}) == len(out)
    answers = {o["custom_id"]: o for o in out}
    for i in range(6):
        expected = client.chat.completions.create(**{**CHAT, "messages": [{"role": "user", "content": f"Hi {i}"}]})
        body = answers[f"chat-{i}"]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == expected.choices[0].message.content
    assert answers["completion"]["response"]["body"]["choices"][0]["text"] == client.completions.create(
        **COMPLETION).choices[0].text  # fmt: skip
    seeded = client.completions.create(**SEEDED)
    assert [c["text"] for c in answers["seeded"]["response"]["body"]["choices"]] == [c.text for c in seeded.choices]
    vectors = client.embeddings.create(model=MODEL, input=["hello", "world"], encoding_format="float").data
    for got, want in zip(answers["embedding"]["response"]["body"]["data"], vectors, strict=True):
        assert got["embedding"] == pytest.approx(want.embedding, abs=1e-6)
    assert answers["response"]["response"]["body"]["object"] == "response"
    bad = answers["bad-body"]
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["param"] == "temperature"
    assert answers["streaming"]["error"]["code"] == "invalid_request" and answers["streaming"]["response"] is None
    assert answers["bad-url"]["error"]["code"] == "invalid_url"
    assert out[-1]["error"]["code"] == "invalid_json" and out[-1]["custom_id"] is None
