"""`folio run-batch` against hostile lines: whatever a line holds, it gets exactly one output line in its
place (an error line, or the server's own 4xx answer) and the good lines around it are still answered."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi import FastAPI, Request

from folio.cli import main
from folio.server.openai.batch_file import run_batch
from tests.api.server_runner import MODEL

GOOD = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
DEEP = "[" * 3000 + "]" * 3000


def _line(custom_id: str, body: str, url: str = "/v1/completions") -> str:
    """A request line whose body is raw JSON text (so it can hold what json.dumps would not write)."""
    return f'{{"custom_id": {json.dumps(custom_id)}, "method": "POST", "url": "{url}", "body": {body}}}'


def _good(custom_id: str) -> str:
    return _line(custom_id, json.dumps(GOOD))


# (custom_id as the output names it, None where the line cannot be read, the raw line)
HOSTILE = [
    ("nan", _line("nan", json.dumps({**GOOD, "temperature": float("nan")}))),
    ("surrogate", _line("surrogate", json.dumps({**GOOD, "prompt": "\ud800"}))),
    (None, _line("deep-body", json.dumps(GOOD)[:-1] + f', "stop": {DEEP}}}')),
    (None, DEEP),
    (None, "[1, 2]"),
    (None, '"just a string"'),
    (None, "42"),
    ("huge-float", _line("huge-float", json.dumps(GOOD)[:-1] + ', "max_tokens": 1e999}')),
    (None, _line("huge-int", json.dumps(GOOD)[:-1] + ', "max_tokens": ' + "9" * 5000 + "}")),
    ("chat-nan", _line("chat-nan", f'{{"model": "{MODEL}", "messages": NaN}}', "/v1/chat/completions")),
    ("surrogate-key", _line("surrogate-key", json.dumps(GOOD)[:-1] + ', "\\udfff": 1}')),
]


def _strict(text: str) -> dict:
    """Output lines must be strict JSON: NaN and Infinity are not JSON."""

    def reject(constant: str) -> None:
        raise AssertionError(f"output holds {constant}")

    return json.loads(text, parse_constant=reject)


def test_every_line_gets_one_answer_in_order_whatever_it_holds(tmp_path: Path, smollm2_gguf: Path,
                                                               capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    lines: list[tuple[str | None, str]] = [("good-0", _good("good-0"))]
    for number, (custom_id, line) in enumerate(HOSTILE, start=1):
        lines += [(custom_id, line), (f"good-{number}", _good(f"good-{number}"))]
    # A custom_id the output cannot write as UTF-8, and a prompt holding a line separator JSON allows raw.
    lines.append(("id-\udc80", _good("id-\udc80")))
    lines.append(("separator", _line("separator", json.dumps({**GOOD, "prompt": "a\u2028b"}, ensure_ascii=False))))
    source, target = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    raw = b"".join(line.encode("utf-8", "surrogatepass") + b"\n" for _, line in lines)
    raw += b'{"custom_id": "not-utf8", "body": "\xff\xfe"}\n'  # bytes that are not UTF-8 at all
    lines.append((None, "not-utf8"))
    source.write_bytes(raw)
    code = main(["run-batch", MODEL, "-i", str(source), "-o", str(target), "--kv-cache-memory", "64MiB",
                 "--max-num-seqs", "4"])  # fmt: skip
    assert code == 0
    out = [_strict(text) for text in target.read_text(encoding="utf-8").splitlines()]
    assert len(out) == len(lines)
    assert len({o["id"] for o in out}) == len(out)
    good = 0
    for (custom_id, _), answer in zip(lines, out, strict=True):
        assert answer["custom_id"] == custom_id, answer
        if custom_id is not None and (custom_id.startswith("good-") or custom_id in ("id-\udc80", "separator")):
            assert answer["error"] is None and answer["response"]["status_code"] == 200, answer
            good += 1
        elif answer["response"] is None:
            assert set(answer["error"]) == {"code", "message"}, answer
        else:
            assert answer["error"] is None and 400 <= answer["response"]["status_code"] < 500, answer
            assert set(answer["response"]["body"]["error"]) >= {"message", "type"}, answer
    summary = capsys.readouterr().err
    assert f"{len(lines)} requests: {good} answered" in summary


def test_a_request_the_app_fails_on_is_its_own_error_line() -> None:
    """An app exception comes back through the ASGI transport as an exception: it ends that line only."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        if body["prompt"] == "boom":
            raise RuntimeError("the app broke")
        return {"text": body["prompt"]}

    lines = [_line(name, json.dumps({"prompt": name})) for name in ("a", "boom", "b")]
    outputs, summary = asyncio.run(run_batch(app, lines, concurrency=2))
    out = [_strict(text) for text in outputs]
    assert [o["custom_id"] for o in out] == ["a", "boom", "b"]
    assert [o["response"]["body"]["text"] for o in (out[0], out[2])] == ["a", "b"]
    assert out[1]["response"] is None and out[1]["error"]["code"] == "request_failed"
    assert (summary.requests, summary.answered_ok, summary.answered_error, summary.invalid_lines, summary.failed) == (
        3, 2, 0, 0, 1)  # fmt: skip
